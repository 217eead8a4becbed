"""Q1: measured/measured comparisons across publications, scaled by kvsim's `roofline` engine
(no overheads, 0.85 x spec HBM, 0.6 x peak FLOP/s: it knows no source and no engine).
For rows A (a missing source) and B (another source) at (nearly) the same configuration:
  raw = m_A / m_B   (same metric, per-token time or throughput)
  scale = r_A / r_B (the roofline's ratio for the two configurations)
  D = raw / scale   (>1.5 or <1/1.5: no prediction that does not know the source puts both
                     within +-20%, unless a configuration field tells them apart)
Rows not in data/published.csv (ANL's untranscribed TP2/TP4 batch-1 rows) are built from
Plots/All_results.csv of argonne-lcf/LLM-Inference-Bench@4211f5d (throughput = B*out/latency)."""
import dataclasses, sys
exec(open('scripts/analyses/published-2026-12-05/pred.py').read())
ROOF = load('roofline')

def roof(p, metric):
    return PRED.predict(p, ROOF)[metric]

def per_token_ms(p):
    """Per generated token (ms) from a row's headline: TPOT as is; throughput: B/thr; latency:
    latency/out*1000/B*B = latency/out."""
    k = p.headline
    v = p.measured[k]
    if k == 'tpot_ms': return v, 'tpot_ms'
    if k == 'throughput_tok_s': return 1000 * p.batch / v, 'throughput_tok_s'
    if k == 'latency_s': return 1000 * v / p.output_len, 'latency_s'
    return v, k

def metric_val(p, metric):
    """measured value converted to ms per step of the batch (B * out / thr) for throughput/latency."""
    v = p.measured[metric]
    if metric == 'throughput_tok_s': return 1000 * p.batch * p.output_len / v / p.output_len
    if metric == 'latency_s': return 1000 * v / p.output_len
    return v

def rmetric(p, metric):
    g = PRED.predict(p, ROOF)
    if metric == 'throughput_tok_s': return 1000 * p.batch / g[metric]
    if metric == 'latency_s': return 1000 * g[metric] / p.output_len
    return g[metric]

def mk(base_row, **kw):
    p = PTS[base_row]
    meas = kw.pop('measured')
    meta = dict(p.meta); meta['source'] = kw.pop('source', meta.get('source'))
    return dataclasses.replace(p, measured=meas, meta=meta, row=kw.pop('row', -1), **kw)

def compare(label, A, B, note=''):
    k = A.headline
    assert k in B.measured or B.headline in ('throughput_tok_s','latency_s','tpot_ms')
    mA, mB = metric_val(A, A.headline), metric_val(B, B.headline)  # ms per batch step (incl. prefill share)
    rA, rB = rmetric(A, A.headline), rmetric(B, B.headline)
    raw = mA / mB; scale = rA / rB; D = raw / scale
    verdict = 'DISAGREE' if (D > 1.5 or D < 1/1.5) else ('tension' if (D > 1.2 or D < 1/1.2) else 'agree')
    return dict(label=label, A=f"{A.row} {A.meta.get('source','')[:22]}", B=f"{B.row} {B.meta.get('source','')[:22]}",
                A_cfg=f"{A.gpu} tp{A.tp} {A.model} {A.weight_dtype}/{A.kv_dtype} {A.context}/{A.output_len} b{A.batch}",
                B_cfg=f"{B.gpu} tp{B.tp} {B.model} {B.weight_dtype}/{B.kv_dtype} {B.context}/{B.output_len} b{B.batch}",
                mA_ms=round(mA,3), mB_ms=round(mB,3), raw=round(raw,3), roof_scale=round(scale,3), D=round(D,3), verdict=verdict, note=note)

import pandas as pd
ANL = pd.read_csv('scripts/analyses/published-2026-12-05/anl_all_results.csv'); ANL.columns = ['hw','n','fw','model','io','b','lat','thr']
def anl_row(fw, model, n, io, b, base):
    x = ANL[(ANL.hw.str.contains('H100')) & (ANL.fw == fw) & (ANL.model == model) & (ANL.n == n) & (ANL.io == io) & (ANL.b == b)]
    lat = float(x.lat.iloc[0])
    return mk(base, tp=n, context=io, output_len=io, batch=b, measured={'throughput_tok_s': b * io / lat},
              source=f'anl-{fw}-untranscribed', row=-(100*n+b))

R = []
# ---- C1 vLLM batch-1 decode, Llama-3(.1)-8B on H100 (blog v0.19.1 vs ANL v0.5.x)
for a in (301, 302, 303):
    for b in (10, 12):
        R.append(compare('C1 vLLM b1 H100 8B: 0.19.1 vs 0.5.x', PTS[a], PTS[b]))
R.append(compare('C1 blog vLLM 0.19.1 vs ANL TRT-LLM', PTS[301], PTS[18], 'cross-engine'))
R.append(compare('C1 blog B200 vs blog H100 (same source)', PTS[307], PTS[301], 'within source'))
# ---- C2 vLLM fp8 on H100, b64
anl_fp16_1024 = mk(13, context=1024, output_len=1024, measured={'throughput_tok_s': 64*1024/18.808667415499894}, row=-13,
                   source='anl (All_results, untranscribed)')
R.append(compare('C2 vLLM fp8W b64 1024/1024 (0.6.4) vs ANL fp16 b64 1024/1024 (0.5.x)', PTS[313], anl_fp16_1024))
R.append(compare('C2 vLLM 0.6.4 fp8W/bf16KV vs ANL 0.5 fp8W/fp8KV 2048/2048 b64', PTS[313], PTS[42]))
R.append(compare('C2 vLLM 0.6.4 fp8W/bf16KV vs ANL 0.5 fp8W/fp8KV 128/128 b64', PTS[313], PTS[41]))
R.append(compare('C2 ANL: fp16W/fp8KV vs fp16W/fp16KV (same source)', PTS[43], PTS[44], 'within source'))
R.append(compare('C2 ANL: fp8W/fp8KV vs fp16 (same source) 2048/2048 b64', PTS[42], PTS[13], 'within source'))
# ---- C3 TP scaling at batch 1: gpt-fast (A100) vs ANL TRT-LLM / vLLM (H100) 8B
for tp in (1, 2, 4):
    gf = PTS[{1: 70, 2: 71, 4: 72}[tp]]
    R.append(compare(f'C3 gpt-fast A100 8B tp{tp} vs ANL TRT H100 8B tp{tp} (b1)', gf, anl_row('TensorRT-LLM', 'meta-llama/Meta-Llama-3-8B', tp, 128, 1, 18)))
    R.append(compare(f'C3 gpt-fast A100 8B tp{tp} vs ANL vLLM H100 8B tp{tp} (b1)', gf, anl_row('vLLM', 'meta-llama/Meta-Llama-3-8B', tp, 128, 1, 10)))
R.append(compare('C3 gpt-fast A100 8B tp8 vs ANL TRT H100 8B tp4 (b1)', PTS[73], anl_row('TensorRT-LLM', 'meta-llama/Meta-Llama-3-8B', 4, 128, 1, 18), 'tp differs'))
for gfr, lr in ((68, 114), (75, 114)):
    R.append(compare('C3 gpt-fast 70B tp4 b1 vs lmdeploy 70B tp4 b1 (A100)', PTS[gfr], PTS[lr]))
R.append(compare('C3 gpt-fast 3.1-70B tp4 vs ANL TRT 3.1-70B tp4 H100 (b1)', PTS[75], PTS[23]))
R.append(compare('C3 gpt-fast 3.1-70B tp4 vs ANL vLLM 3.1-70B tp4 H100 (b1)', PTS[75], PTS[15]))
R.append(compare('C3 gpt-fast 3.1-70B tp4 vs Qwen vLLM 0.6.3 Qwen2-72B tp4 A100 (b1)', PTS[75], PTS[321]))
R.append(compare('C3 gpt-fast 3.1-8B tp1 vs lmdeploy llama-2-7b tp1 A100 (b1)', PTS[70], PTS[81]))
# ---- C4 Qwen2.5-7B vLLM A100 b1 vs gpt-fast / lmdeploy
R.append(compare('C4 Qwen vLLM 0.6.3 qwen2.5-7b b1 vs gpt-fast 3.1-8b b1 (A100)', PTS[314], PTS[70]))
R.append(compare('C4 Qwen vLLM 0.6.3 qwen2.5-7b b1 vs lmdeploy llama-2-7b b1 (A100)', PTS[314], PTS[81]))
R.append(compare('C4 Qwen vLLM 0.4.2 vs 0.6.3, 72B tp4 in 14336 (same source)', PTS[330], PTS[323], 'within source'))
R.append(compare('C4 Qwen vLLM 0.4.2 vs 0.6.3, 72B tp4 in 30720 (same source)', PTS[331], PTS[324], 'within source'))
# ---- C5 Mixtral vLLM 0.2/0.3/0.4 + gpt-fast
for a_, b_ in ((281, 288), (284, 291), (287, 294)):
    R.append(compare('C5 Mixtral vLLM: PR-2542 H100 tp8 vs PR-3240 A100 tp2', PTS[a_], PTS[b_]))
R.append(compare('C5 Mixtral PR-2542 H100 tp8 b8 vs PR-4002 8x22B A100 tp8 b8', PTS[284], PTS[298]))
R.append(compare('C5 Mixtral PR-3240 A100 tp2 b1 vs gpt-fast A100 tp2 b1', PTS[288], PTS[77]))
R.append(compare('C5 Mixtral PR-2542 H100 tp8 b1 vs gpt-fast A100 tp8 b1', PTS[281], PTS[79]))
R.append(compare('C5 Mixtral ANL TRT H100 tp4 b1 128 vs gpt-fast A100 tp4 b1', PTS[25], PTS[78]))
R.append(compare('C5 Mixtral ANL TRT H100 tp4 b16 128 vs b1 (same source)', PTS[45], PTS[25], 'within source'))
# ---- C6 TRT-LLM perf doc v0.6.1 vs v0.9.0 (same GPU, model, lengths; batch within 10%)
for a_, b_ in ((258, 186), (259, 187), (260, 188), (261, 189), (255, 183), (254, 182), (257, 185), (256, 184), (262, 214), (263, 215), (264, 216), (265, 234), (266, 235), (267, 236), (268, 229)):
    R.append(compare('C6 TRT doc v0.6.1 vs v0.9.0', PTS[a_], PTS[b_]))
# ---- C7 Qwen3 SGLang H20 vs VerKV vLLM H100 (Qwen3-4B bf16, b1, ~32K context)
R.append(compare('C7 SGLang H20 qwen3-4b 30720 b1 vs VerKV H100 qwen3-4b 32768 b1', PTS[137], PTS[334]))
R.append(compare('C7 SGLang H20 qwen3-4b in1 b1 vs VerKV H100 qwen3-4b 32768 b1', PTS[134], PTS[334], 'context differs'))
R.append(compare('C7 SGLang H20 qwen3-8b vs qwen3-4b bf16 in1 (same source)', PTS[146], PTS[134], 'within source'))
R.append(compare('C7 SGLang H20 qwen3-8b fp8 vs bf16 in1 (same source)', PTS[152], PTS[146], 'within source'))
R.append(compare('C7 SGLang H20 qwen3-4b fp8 vs bf16 in1 (same source)', PTS[140], PTS[134], 'within source'))
# ---- C8 70B A100 TP4 b64 : vllm-pr-2192 vs lmdeploy / TRT doc
R.append(compare('C8 vLLM PR-2192 70B tp4 b64 256/256 vs lmdeploy 128/128 b64 (A100)', PTS[300], PTS[129]))
R.append(compare('C8 vLLM PR-2192 70B tp4 b64 256/256 vs lmdeploy 128/2048 b64 (A100)', PTS[300], PTS[130]))
R.append(compare('C8 vLLM PR-2192 70B tp4 b64 vs TRT doc v0.9 2048/2048 b64 (A100)', PTS[300], PTS[221], 'lengths differ'))
# ---- C9 ANL TTFT vLLM vs TRT (same source) and vs TRT doc TTFT
R.append(compare('C9 ANL TTFT 16x1024 vLLM vs TRT (same source)', PTS[35], PTS[37], 'within source'))
R.append(compare('C9 ANL TTFT vLLM 8B 16x1024 H100 vs TRT doc llama-2-7b A100 1x2048 fp16', PTS[35], PTS[251], 'different GPU/model'))
df = pd.DataFrame(R)
pd.set_option('display.width', 300); pd.set_option('display.max_colwidth', 80); pd.set_option('display.max_rows', 200)
print(df.drop(columns=['A_cfg','B_cfg']).to_string(index=False))
df.to_csv('scripts/analyses/published-2026-12-05/q1_comparisons.csv', index=False)
