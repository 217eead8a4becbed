"""Fit kvsim's engine on the Mixtral vLLM rows of PR-3240 and PR-4002 only (one family), then
predict PR-2542 (held out): can same-engine MoE sources predict it?"""
import dataclasses
exec(open('scripts/analyses/published-2026-12-05/compare.py').read().split("R = []")[0])
from kvsim.fit import families as F
for train, held in ((list(range(288, 300)), list(range(281, 288))), (list(range(281, 288)) + list(range(295, 300)), list(range(288, 295)))):
    pts = [dataclasses.replace(PTS[r], engine='g') for r in train]
    shared, fams, free = F.fit_joint(pts, PRED, ROOF)
    eng = fams.get('g', shared)
    print('train', train[0], '..', train[-1], {k: round(v.value, 3) for k, v in eng.fields.items() if isinstance(v.value, float)})
    for r in held:
        p = dataclasses.replace(PTS[r], engine='g'); m = p.measured['latency_s']; g = PRED.predict(p, eng)['latency_s']
        print(f"  held row {r} b{p.batch}: measured {m:.3f} s, predicted {g:.3f} s ({100*(g/m-1):+.1f}%)")
