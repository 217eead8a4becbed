"""kvsim catalog: the GPUs and model shapes kvsim knows, with their public sources."""

from __future__ import annotations

import dataclasses

from kvsim.commands._out import print_json, table
from kvsim.hw import catalog

HELP = "list catalog GPUs and model shapes with their sources"


def add_parser(sub) -> None:
    p = sub.add_parser("catalog", help=HELP,
                       description=__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    gpus = [dataclasses.asdict(g) for g in catalog.GPUS.values()]
    models = [{**dataclasses.asdict(m), "params_b": m.params / 1e9,
               "kv_kib_per_token": m.kv_bytes_per_token / 1024} for m in catalog.MODELS.values()]
    if args.json:
        print_json({"gpus": gpus, "models": models})
        return 0
    table([{k: g[k] for k in ("name", "hbm_gib", "hbm_gbps", "bf16_tflops", "link", "h2d_gbps")}
           for g in gpus])
    print()
    table([{k: m[k] for k in ("name", "params_b", "layers", "q_heads", "kv_heads", "head_dim",
                              "hidden", "intermediate", "vocab", "kv_kib_per_token")}
           for m in models])
    print("\nsources")
    for g in catalog.GPUS.values():
        print(f"  {g.name}: {g.source}")
    for m in catalog.MODELS.values():
        print(f"  {m.name}: {m.source}")
    return 0
