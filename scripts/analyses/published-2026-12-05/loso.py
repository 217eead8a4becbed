"""Targeted leave-one-source-out refits (the same kvsim.fit.families.fit_joint as the project's CV)
with one legitimate change each, to see what a configuration field would buy on the held-out
source. Usage: python loso.py NAME"""
import dataclasses, sys, time, json
exec(open('scripts/analyses/published-2026-12-05/compare.py').read().split("R = []")[0])  # helpers (PTS, PRED, anl_row, mk)
from kvsim.fit import families as F, Predictor
import pandas as pd

class FlagPredictor(Predictor):
    """Rows whose meta says prompts=identical are predicted with collapsed MoE routing; rows whose
    meta says moe_rate=bf16 with MoE fp8 matmuls at the bf16 rate."""
    def predict(self, p, engine):
        if p.meta.get('prompts') == 'identical':
            with collapsed_routing():
                return super().predict(p, engine)
        if p.meta.get('moe_rate') == 'bf16':
            with moe_fp8_at_bf16_rate():
                return super().predict(p, engine)
        return super().predict(p, engine)

ALL = list(PTS.values())

def tag(p, **meta):
    m = dict(p.meta); m.update(meta)
    return dataclasses.replace(p, meta=m)

def run(name, held_source, transform=lambda pts: pts, pred=None, extra_rest=()):
    pred = pred or FlagPredictor(None)
    pts = transform(ALL)
    rows = [p for p in pts if p.meta.get('certainty') not in ('plot-kernel',)]
    held = [p for p in rows if p.meta.get('source') == held_source]
    rest = [p for p in pts if p.use == 'fit' and p.meta.get('source') != held_source] + list(extra_rest)
    t = time.time()
    shared, engines, _ = F.fit_joint(rest, pred, ROOF)
    out = []
    for p in held:
        eng = engines.get(p.engine, shared)
        for v in F.held_values(p, pred.predict(p, eng)):
            out.append(dict(case=name, row=p.row, engine=p.engine, metric=v['metric'], measured=v['measured'],
                            predicted=round(v['predicted'], 4), err_pct=round(v['err_pct'], 1)))
    df = pd.DataFrame(out)
    print(f"== {name}: held {held_source} ({len(df)} values), fit {len(rest)} rows in {time.time()-t:.0f}s: "
          f"within20 {100*(df.err_pct.abs()<=20).mean():.0f}%, median |err| {df.err_pct.abs().median():.1f}%", flush=True)
    return df

ANL_TRT_MOE = {r for r in [25, 26] + list(range(45, 63))}
V09_MOE_FP8 = {162, 163, 164, 165, 178, 179, 180, 181, 224, 225, 232, 233}
CASES = {
  'L0-anl-baseline': lambda: run('L0-anl-baseline', 'llm-inference-bench-anl-2024'),
  'L1-anl-collapsed': lambda: run('L1-anl-collapsed', 'llm-inference-bench-anl-2024',
        lambda pts: [tag(p, prompts='identical') if p.row in ANL_TRT_MOE else p for p in pts]),
  'L2-gptfast-baseline': lambda: run('L2-gptfast-baseline', 'gpt-fast-readme'),
  'L2-gptfast-anlTP': lambda: run('L2-gptfast-anlTP', 'gpt-fast-readme', extra_rest=[
        anl_row(fw, 'meta-llama/Meta-Llama-3-8B', tp, io, 1, 18 if fw == 'TensorRT-LLM' else 10)
        for fw in ('TensorRT-LLM', 'vLLM') for tp in (2, 4) for io in (128, 2048)]),
  'L3-v061-baseline': lambda: run('L3-v061-baseline', 'trtllm-perf-doc-v0.6.1'),
  'L3-v061-pqh': lambda: run('L3-v061-pqh', 'trtllm-perf-doc-v0.6.1',
        lambda pts: [dataclasses.replace(p, attention='per-query-head') if p.meta.get('source') == 'trtllm-perf-doc-v0.6.1' and catalog.model(p.model).kv_heads < catalog.model(p.model).q_heads else p for p in pts]),
  'L5-pr2542-baseline': lambda: run('L5-pr2542-baseline', 'vllm-pr-2542'),
  'L5-pr2542-merged': lambda: run('L5-pr2542-merged', 'vllm-pr-2542',
        lambda pts: [dataclasses.replace(p, engine='vllm') if p.engine == 'vllm-0.3' else p for p in pts]),
  'L6-pr3240-merged': lambda: run('L6-pr3240-merged', 'vllm-pr-3240',
        lambda pts: [dataclasses.replace(p, engine='vllm') if p.engine == 'vllm-0.3' else p for p in pts]),
  'L7-blog-baseline': lambda: run('L7-blog-baseline', 'vllm-blog-2026-04-fp8-kvcache'),
  'L8-v09-moefp8': lambda: run('L8-v09-moefp8', 'trtllm-perf-doc-v0.9.0',
        lambda pts: [tag(p, moe_rate='bf16') if p.row in V09_MOE_FP8 else p for p in pts]),
  'L8-v09-baseline': lambda: run('L8-v09-baseline', 'trtllm-perf-doc-v0.9.0'),
}

def capped(fn, lo=0.05, hi=0.9):
    """Run with hbm_efficiency bounded above by `hi` (spec bandwidth is not reachable; breaks the
    bandwidth / per-layer-overhead trade-off that batch-1 TP1 rows cannot resolve)."""
    from kvsim.fit import solve
    old = solve.PARAMS['hbm_efficiency']
    solve.PARAMS['hbm_efficiency'] = (lo, hi)
    try:
        return fn()
    finally:
        solve.PARAMS['hbm_efficiency'] = old

CASES.update({
  'L2-gptfast-hbmcap': lambda: capped(lambda: run('L2-gptfast-hbmcap', 'gpt-fast-readme')),
  'L7-blog-hbmcap': lambda: capped(lambda: run('L7-blog-hbmcap', 'vllm-blog-2026-04-fp8-kvcache')),
  'L9-qwen-baseline': lambda: run('L9-qwen-baseline', 'qwen-speed-benchmark-vllm'),
  'L9-qwen-pqh042': lambda: run('L9-qwen-pqh042', 'qwen-speed-benchmark-vllm',
        lambda pts: [dataclasses.replace(p, attention='per-query-head') if p.meta.get('source') == 'qwen-speed-benchmark-vllm' and str(p.meta.get('engine_version', '')).startswith('0.4') else p for p in pts]),
})
if __name__ == '__main__':
    res = [CASES[c]() for c in sys.argv[1:]]
    df = pd.concat(res)
    df.to_csv('scripts/analyses/published-2026-12-05/loso_' + '_'.join(sys.argv[1:]) + '.csv', index=False)
    pd.set_option('display.width', 200); pd.set_option('display.max_rows', 500)
    print(df.to_string(index=False))
