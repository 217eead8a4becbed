"""kvsim catalog: the GPUs (with an example price per GPU-hour), model shapes and engine
profiles kvsim knows, with their sources."""

from __future__ import annotations

import dataclasses

from kvsim.commands._out import print_json, table
from kvsim.hw import catalog

HELP = ("list catalog GPUs (with example prices), model shapes, built-in engine profiles and "
        "the shipped policy profile with their sources")


def add_parser(sub) -> None:
    p = sub.add_parser("catalog", help=HELP, epilog="example: kvsim catalog --json | jq .gpus",
                       description=__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    gpus = [dataclasses.asdict(g) for g in catalog.GPUS.values()]
    models = [{**dataclasses.asdict(m), "params_b": m.params / 1e9,
               "kv_kib_per_token": m.kv_bytes_per_token / 1024} for m in catalog.MODELS.values()]
    from kvsim.hw import engine as E
    engines = [E.ROOFLINE] + [E.load(name) for name in E.BUILTIN]
    from kvsim import policy_profile as pp
    prof = pp.load(pp.DEFAULT)
    profiles = [{"file": str(pp.DEFAULT.relative_to(pp.DEFAULT.parents[1])),
                 "summary": prof.summary(),
                 "policies": {n: prof.describe_grid(n) for n in sorted({n for n, _ in
                                                                        prof.settings})}}]
    if args.json:
        print_json({"gpus": gpus, "models": models, "policy_profiles": profiles,
                    "engines": [{**e.to_json(), "origin": e.origin} for e in engines]})
        return 0
    table([{k: g[k] or "-" for k in ("name", "hbm_gib", "hbm_gbps", "bf16_tflops", "fp8_tflops",
                                     "int8_tops", "int4_tops", "mma_rows", "link", "h2d_gbps",
                                     "peer", "peer_gbps", "usd_per_hour")} for g in gpus])
    print("(dense tensor-core peak rates; '-': no published rate in the catalog: that type "
          "computes at the bf16 rate; mma_rows: the tokens a decode matmul computes at least; "
          "usd_per_hour: an example on-demand price per GPU-hour, '-': none found (kvsim plan "
          "--price GPU=USD))")
    print()
    table([{k: m[k] for k in ("name", "params_b", "layers", "q_heads", "kv_heads", "head_dim",
                              "hidden", "intermediate", "vocab", "kv_kib_per_token")}
           for m in models])
    print()
    table([{"engine": e.name, "fitted_on": _fitted(e.fitted_on),
            "fields": ", ".join(e.fields) or "none (the hardware as it is)"} for e in engines])
    print("\nsources")
    for g in catalog.GPUS.values():
        print(f"  {g.name}: {g.source}")
        print(f"    rates by type: {g.rates_source}")
        print(f"    tensor-core rows: {g.mma_source}")
        print(f"    example price: {_price(g.usd_per_hour)} ({g.price_source})")
    for m in catalog.MODELS.values():
        print(f"  {m.name}: {m.source}")
    for e in engines:
        print(f"  engine {e.name} ({e.origin}): {e.description}")
    for p in profiles:
        print(f"  policy profile {p['file']} (the default of replay and plan): {p['summary']}")
        for name, grid in p["policies"].items():
            print(f"    {name}: {grid}")
    return 0


def _price(usd: float | None) -> str:
    return "none" if usd is None else f"${usd:g} per GPU-hour"


def _fitted(on: dict) -> str:
    """``h100-sxm/qwen3-4b`` for one setup; ``9 GPUs, 16 models`` for published points."""
    if "gpus" in on:
        return f"{len(on['gpus'])} GPUs, {len(on.get('models', []))} models"
    return "/".join(on.values()) or "-"
