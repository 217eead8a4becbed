"""Full-fit (built-in kvsim/hw/engines/*.json, in-sample) what-ifs quoted in report.md."""
import dataclasses
exec(open('scripts/analyses/published-2026-12-05/pred.py').read())
def show(label, rows, ctx=None, rowfix=lambda p: p, **over):
    n0 = n1 = 0
    for r in rows:
        p = PTS[r]; k = p.headline; m = p.measured[k]
        e = eng_for(p)
        a = PRED.predict(p, e)[k]
        e2 = e.with_fields('override', **over) if over else e
        if ctx:
            with ctx(): b = PRED.predict(rowfix(p), e2)[k]
        else:
            b = PRED.predict(rowfix(p), e2)[k]
        n0 += abs(a / m - 1) <= .2; n1 += abs(b / m - 1) <= .2
        print(f"{label:14s} row {r:3d} {p.gpu:9s} tp{p.tp} {p.model:13s} {p.weight_dtype} {p.context}/{p.output_len} b{p.batch} {k}: "
              f"measured {m:.4g}  base {100*(a/m-1):+.1f}%  what-if {100*(b/m-1):+.1f}%")
    print(f"{label}: within 20% {n0}/{len(rows)} -> {n1}/{len(rows)}\n")
show('collapsed', [25] + list(range(45, 63)) + [26], ctx=collapsed_routing)
show('moe-fp8@bf16', [162, 163, 164, 165, 178, 179, 180, 181, 224, 225, 232, 233, 194, 195, 196, 197, 240, 241], ctx=moe_fp8_at_bf16_rate)
show('pqh v0.6.1', [258, 259, 260, 261], attention='per-query-head')
show('pqh v0.5.0', [274, 275, 276, 277], attention='per-query-head')
show('pqh vllm0.4.2', [327, 328, 329, 330, 331, 332, 333], attention='per-query-head')
