"""Consistency of groups of rows from different publications: kvsim's own joint fit
(kvsim.fit.families.fit_joint) on ONLY the group's rows, every row given the same engine family
(so nothing can tell the publications apart). In-sample errors are a lower bound on what any
source-agnostic kvsim engine can do on those rows: a row still off by >20% here cannot be
brought within 20% together with the rest of its group without a new configuration field."""
import dataclasses, time
exec(open('scripts/analyses/published-2026-12-05/compare.py').read().split("R = []")[0])  # helpers only
from kvsim.fit import families as F
import pandas as pd

def group_fit(name, rows, fam='g', extra=()):
    pts = [dataclasses.replace(PTS[r], engine=fam) for r in rows] + [dataclasses.replace(p, engine=fam) for p in extra]
    t = time.time()
    shared, fams, free = F.fit_joint(pts, PRED, ROOF)
    eng = fams.get(fam, shared)
    out = []
    for p in pts:
        for v in F.held_values(p, PRED.predict(p, eng)):
            out.append(dict(group=name, row=p.row, source=p.meta.get('source','')[:26], metric=v['metric'],
                            measured=round(v['measured'], 4), fitted=round(v['predicted'], 4), err_pct=round(v['err_pct'], 1)))
    df = pd.DataFrame(out)
    print(f"== {name}: {len(pts)} rows, {time.time()-t:.0f}s; free {free}; within20 {100*(df.err_pct.abs()<=20).mean():.0f}%")
    print('   fitted', {k: round(v.value, 4) for k, v in eng.fields.items() if isinstance(v.value, float)})
    print(df.to_string(index=False))
    return df

if __name__ == '__main__':
    import sys
    groups = {
      'G1 Mixtral vLLM (PR-2542, PR-3240, PR-4002)': (list(range(281, 300)), ()),
      'G1b Mixtral vLLM without PR-2542': (list(range(288, 300)), ()),
      'G2 vLLM b1 Llama-3(.1)-8B H100 (ANL 0.5 + blog 0.19.1)': ([10, 12, 301, 302, 303, 304, 305, 306], ()),
      'G3 b1 TP scaling: gpt-fast dense (A100) + ANL TRT 8B TP1/2/4 + 70B TP4 (H100)': (
          list(range(63, 77)) + [18, 23],
          tuple(anl_row('TensorRT-LLM', 'meta-llama/Meta-Llama-3-8B', tp, io, 1, 18) for tp in (2, 4) for io in (128, 2048))),
      'G4 Qwen3 b1: SGLang H20 bf16+fp8 + VerKV H100': (list(range(134, 158)) + [334], ()),
      'G5 vLLM H100 Llama-3(.1)-8B fp16/fp8 (ANL 0.5 + issue-9471 0.6.4)': ([10, 11, 12, 13, 39, 40, 41, 42, 43, 44, 313], ()),
      'G6 TRT doc GQA 70B H100 fp8 v0.6.1 + v0.9.0': ([186, 187, 188, 189, 258, 259, 260, 261], ()),
    }
    sel = sys.argv[1:] or list(groups)
    res = []
    for g in groups:
        if any(g.startswith(s) for s in sel):
            rows, extra = groups[g]
            res.append(group_fit(g, rows, extra=extra))
    pd.concat(res).to_csv('scripts/analyses/published-2026-12-05/groupfit_' + '_'.join(s.replace(' ', '') for s in sel) + '.csv', index=False)
