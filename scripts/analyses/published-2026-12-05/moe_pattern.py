"""Q3: the held-out MoE errors (data/published-cv.json) by source, GPU, TP, dtype, batch."""
exec(open('scripts/analyses/published-2026-12-05/load.py').read())
import numpy as np
m = M[M.categories.apply(lambda c: 'moe' in c)].copy()
m['w'] = m.weight_dtype
g = m.groupby(['source', 'gpu', 'tp', 'model', 'w', 'metric']).agg(
    n=('err_pct', 'size'), med=('err_pct', 'median'), lo=('err_pct', 'min'), hi=('err_pct', 'max'),
    within=('err_pct', lambda e: int((e.abs() <= 20).sum())), rows=('row', lambda r: ','.join(map(str, sorted(set(r))))))
print(g.round(1).to_string())
# batch trend within sources that sweep batch
for s in ('llm-inference-bench-anl-2024', 'vllm-pr-2542', 'vllm-pr-3240'):
    x = m[(m.source == s) & (m.metric != 'ttft_ms')]
    print(s, 'err vs batch:', x.groupby('batch').err_pct.median().round(1).to_dict(),
          ' spearman(batch, err) = %.2f' % x[['batch', 'err_pct']].corr('spearman').iloc[0, 1])
