"""kvsim plan: sweep GPUs x models x contexts x policies x batches; table, plots and a report."""

from __future__ import annotations

import argparse
import shlex
import sys

from kvsim.commands._out import print_json, table

HELP = "sweep configurations; write a table, plots and a report"

EPILOG = """example:
  kvsim plan --gpu h100-sxm,h200 --model qwen3-4b --context 8192,32768,131072 \\
      --policy dense-offload,verkv --compression 16 --sink 4 --local 4 --batch 1,4,16 --out plan/

(--sink 4 --local 4: the shipped default trace is a 2K-token capture; without them sink and
local are the default 64 each shrunk to a quarter of the 16x budget, with a warning.)

Decide a deployment (the cheapest that carries 20 req/s with p99 TPOT <= 30 ms):
  kvsim plan --gpu h100-sxm,l40s --model qwen3-4b --context 4096 --tp 1,2 \\
      --policy dense-resident,streamingllm --batch 4,8,16 --slo-tpot-ms 30 --target-qps 20 \\
      --price l40s=0.9 --out deploy/
writes DIR/answer.json (the answer, the runner-up, why each other configuration lost) and opens
the terminal output and report.md with the answer.

Writes DIR/results.csv and DIR/results.parquet (one row per configuration, every metric of
kvsim replay and its provenance), PNG and SVG plots, and DIR/report.md. Each finished
configuration is journaled as it completes, so a plan stopped by Ctrl-C, SIGTERM or kill -9
resumes where it stopped; re-running with the same DIR skips configurations already done
(failed ones are retried). Files in DIR that kvsim plan did not write are never overwritten
without --force. Exit status: 0, 1 when some configurations failed (what succeeded is written),
2 when all failed or the input is bad.
"""


USAGE = ("%(prog)s --gpu GPU[,...] --model MODEL[,...] (--context N[,...] | --workload FILE)\n"
         "                  --policy SPEC[,...] [--batch N[,...]] [--qps R[,...]] --out DIR "
         "[OPTION ...]")


def add_parser(sub) -> None:
    from kvsim.commands._policy_flags import add_policy_flags, parse_list, policy_help
    p = sub.add_parser("plan", help=HELP, usage=USAGE,
                       description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    lst = lambda kind: (lambda text: parse_list(kind, text))  # noqa: E731
    p.add_argument("--gpu", type=lst(str), required=True, metavar="GPU[,...]",
                   help="catalog GPUs or profiled traces (.npz from kvsim profile)")
    p.add_argument("--model", type=lst(str), required=True, metavar="MODEL[,...]",
                   help="model shapes: catalog names or Hugging Face config.json paths")
    p.add_argument("--context", type=lst(int), metavar="N[,...]",
                   help="prompt lengths (tokens); required unless --workload")
    p.add_argument("--policy", type=lst(str), required=True, metavar="SPEC[,...]",
                   help="policies to sweep, each " + policy_help() + "; to sweep a policy's "
                        "own option, list one item per value: verkv:sketch=2bit,"
                        "verkv:sketch=perfect")
    p.add_argument("--batch", type=lst(int), metavar="N[,...]",
                   help=f"max batch sizes [default: 1; with --target-qps "
                        f"{','.join(map(str, DEFAULT_BATCHES))}]")
    p.add_argument("--qps", type=lst(float), metavar="R[,...]",
                   help="Poisson rates instead of closed loops (max batch: largest --batch)")
    p.add_argument("--output-len", type=int, default=128, metavar="N",
                   help="output tokens per request [default: 128]")
    p.add_argument("--workload", metavar="FILE",
                   help="replay this workload file (as kvsim replay --workload: kvsim's CSV or "
                        "a public trace) in every configuration, instead of --context; the SLO "
                        "search scales its arrival times to each rate it tries")
    p.add_argument("--requests", type=int, metavar="N",
                   help="requests per run (default as kvsim replay)")
    p.add_argument("--trace", help="trace with attention (for policies that need one) and/or "
                                   "hardware; default: the shipped default trace")
    slo_group = p.add_argument_group(
        "SLO search", "find the highest Poisson rate the deployment sustains (completions keep "
                      "pace with arrivals, the queue stays bounded) within every limit given; "
                      "a limit is VALUE or VALUE@p50 / VALUE@p99 (default p99); they also set "
                      "the goodput of every run")
    for metric, what in (("tpot_ms", "TPOT (each request's mean time per output token), ms"),
                         ("ttft_ms", "TTFT, ms"), ("e2e_s", "end-to-end latency, s"),
                         ("itl_ms", "ITL (every token's gap to the one before, prefill stalls "
                                    "included; p50, p90 or p99 of tokens), ms")):
        slo_group.add_argument(f"--slo-{metric.replace('_', '-')}", metavar="LIMIT",
                               dest=f"slo_{metric}", help=what)
    slo_group.add_argument("--target-qps", type=float, metavar="R",
                           help="decide a deployment: for each configuration the fewest "
                                "replicas, behind each --router, whose fleet replay at R req/s "
                                "meets the SLO (one fewer fails, and by what); the cheapest in "
                                "DIR/answer.json with the runner-up and why the rest lost "
                                f"[--tp default: {','.join(map(str, NODE_TP))}, those that split "
                                "the model]")
    slo_group.add_argument("--slo-requests", type=int, default=1000, metavar="N",
                           help="requests per SLO probe; a rate that passes is run again twice "
                                "as long and must pass there too [default: 1000]")
    from kvsim.commands.replay import (
        add_caching_flags,
        add_deployment_flags,
        add_engine_flags,
        add_scheduling_flags,
    )
    add_deployment_flags(p)
    add_scheduling_flags(p)
    add_caching_flags(p)
    from kvsim.plan.sweep import CACHING_AXES, DEPLOYMENT_AXES, SCHEDULING_AXES
    kinds = {"kv_dtype": str, "host_gib": float, "router": str,
             **dict.fromkeys(CACHING_AXES, float)}
    for action in p._actions:  # plan sweeps these: comma-separated values
        if action.dest == "cache_host_gib":
            action.help = action.help.replace(
                "[default: 0, none]", f"[default: with --target-qps and a workload that names "
                f"its prefix blocks, {','.join(map(str, DEFAULT_CACHE_HOST_GIB))} (the answer "
                f"names the size), else 0]")
        if action.dest in DEPLOYMENT_AXES + SCHEDULING_AXES + CACHING_AXES + ("router",):
            action.type, action.choices = lst(kinds.get(action.dest, int)), None
            if action.dest == "router":  # (argparse would convert a text default: unset is
                action.default = None  # every router, for a deployment search)
            action.metavar = f"{action.metavar or action.dest.upper()}[,...]"
    add_engine_flags(p)
    cost_group = p.add_argument_group(
        "cost", "each GPU's hourly price: the catalog's examples (public on-demand list prices, "
                "with source and date in the report) unless replaced; results carry usd_per_hour "
                "(replicas x TP x price), usd_per_m_tokens (output tokens) and usd_per_request")
    cost_group.add_argument("--price", action="append", default=[],
                            metavar="GPU=USD_PER_HOUR", help="one GPU's price (repeatable)")
    cost_group.add_argument("--prices", metavar="FILE",
                            help="prices from a JSON object {gpu: usd_per_gpu_hour}; --price "
                                 "entries win over it")
    from kvsim.plan.cost import DISK_GIB_HOUR, MEMORY_GIB_HOUR
    cost_group.add_argument("--memory-price", type=float, default=MEMORY_GIB_HOUR,
                            metavar="USD", help="a prefix cache's host memory and pool, per "
                            f"GiB-hour [default: {MEMORY_GIB_HOUR:g}, Google Cloud N2 on-demand "
                            "memory, us-central1]")
    cost_group.add_argument("--disk-price", type=float, default=DISK_GIB_HOUR, metavar="USD",
                            help=f"a prefix cache's disk, per GiB-hour [default: "
                                 f"{DISK_GIB_HOUR:.3g}, $0.04 per GiB-month]")
    p.add_argument("--quality", nargs="+", metavar="JSON",
                   help="kvsim eval --json results for the quality-vs-throughput plot")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (resumable: "
                   "each finished configuration is journaled, a rerun continues)")
    p.add_argument("--force", action="store_true",
                   help="overwrite files in DIR that kvsim plan did not write, or replace a "
                        "plan with other settings there (otherwise refused; the same plan "
                        "resumes, and more GPUs, models, contexts, policies, batches, TP sizes, "
                        "KV dtypes, host memories or tokens per step extend it)")
    p.add_argument("--executor", choices=["local", "ray"], default="local", metavar="NAME",
                   help="local (processes) or ray [default: local]")
    p.add_argument("--jobs", type=int, metavar="N", help="parallel workers [default: all cores]")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="[default: 0]")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    add_policy_flags(p, lists=True)
    p.set_defaults(run=run)


DEFAULT_BATCHES = (4, 16, 64)  # a deployment search's batches when --batch is not given
DEFAULT_CACHE_HOST_GIB = (0, 64, 256)  # and its host cache per GPU, for a workload with hashes
NODE_TP = (1, 2, 4, 8)  # a deployment search's TP sizes when --tp is not given: a node's GPUs


def sweep_spec(args):
    """The plan the flags ask for; a deployment search (``--target-qps``) fills in the TP sizes
    of a node that split the model and a few batch sizes where the flags leave them out (and
    says so: :attr:`SweepSpec.defaulted`)."""
    from kvsim.commands._option_flags import changed_options, journal_key
    from kvsim.commands._policy_flags import policy_options
    from kvsim.commands.replay import engine_options
    from kvsim.errors import KvsimError
    from kvsim.plan.slo import parse_limit
    from kvsim.plan.sweep import SweepSpec
    from kvsim.sim.records import Deployment, PrefixCaching
    from kvsim.sim.rules import Scheduling
    limits = [parse_limit(m, getattr(args, f"slo_{m}"))
              for m in ("tpot_ms", "ttft_ms", "e2e_s", "itl_ms")
              if getattr(args, f"slo_{m}") is not None]
    if (args.context is None) == (args.workload is None):
        raise KvsimError("give --context (prompt lengths) or --workload FILE, one of them")
    deployment = changed_options(args, Deployment)
    routers = deployment.pop("router", None)
    if isinstance(routers, str):
        routers = [routers]
    if routers and args.target_qps is None:  # no search: the replicas' router, as replay's
        if len(routers) > 1:
            raise KvsimError("--router takes several routers only with --target-qps (the "
                             "deployment search tries each); give one")
        deployment["router"], routers = routers[0], None
    defaulted = set()
    batches = args.batch
    if batches is None:
        batches = list(DEFAULT_BATCHES) if args.target_qps is not None else [1]
        defaulted.add("batch")
    if args.target_qps is not None and "tp" not in deployment:
        deployment["tp"] = [t for t in NODE_TP if _splits(args.model, t)]
        defaulted.add("tp")
    caching = changed_options(args, PrefixCaching)
    if args.target_qps is not None and "cache_host_gib" not in caching and \
            caching.get("prefix_caching") != "off" and args.workload is not None:
        from kvsim.replay.configuration import file_workload
        if file_workload(args.workload).prefix_hashes is not None:
            caching["cache_host_gib"] = [float(g) for g in DEFAULT_CACHE_HOST_GIB]
            defaulted.add("cache_host_gib")
    return SweepSpec(gpus=args.gpu, models=args.model, contexts=args.context or [],
                     policies=args.policy, batches=batches, qps=args.qps,
                     option_grid=policy_options(args), output_len=args.output_len,
                     requests=args.requests, seed=args.seed, trace=args.trace, slo=limits,
                     slo_requests=args.slo_requests, scheduling=journal_key(args, Scheduling),
                     engine=engine_options(args), deployment=deployment,
                     target_qps=args.target_qps, workload=args.workload, routers=routers,
                     defaulted=frozenset(defaulted), caching=caching)


def _splits(models: list[str], tp: int) -> bool:
    """Whether every model splits ``tp`` ways (heads, MLP width)."""
    from kvsim.errors import KvsimError
    from kvsim.hw import catalog
    try:
        for m in models:
            catalog.model(m).shard(tp)
    except KvsimError:
        return False
    return True


def run(args) -> int:
    from kvsim.plan.executors import make_executor
    from kvsim.plan.planner import plan
    from kvsim.plan.report import answer_lines, summary_columns
    spec = sweep_spec(args)
    spec.validate()
    if spec.engine.get("engine") is not None:
        from kvsim.hw.engine import load
        eng = load(spec.engine["engine"])
        if eng.fit.get("stand_in"):  # said once here; every row's interval is widened
            print(f"warning: {eng.fit['stand_in']}: intervals widened by the spread between "
                  f"engine families", file=sys.stderr)
    from kvsim.plan.cost import load_prices, parse_price, resolve
    prices = (load_prices(args.prices) if args.prices else {}) | \
        dict(parse_price(text) for text in args.price)
    resolve(spec.gpus, prices)  # an unknown GPU's price fails before the sweep
    from kvsim.plan.cost import MemoryPrices, parse_memory_price
    memory = MemoryPrices(parse_memory_price(args.memory_price, "--memory-price"),
                          parse_memory_price(args.disk_price, "--disk-price"))
    if (memory.memory, memory.disk) != (MemoryPrices.memory, MemoryPrices.disk):
        memory = MemoryPrices(memory.memory, memory.disk, f"user: DRAM ${memory.memory:g}/GiB-h, "
                              f"disk ${memory.disk:g}/GiB-h (--memory-price, --disk-price)")
    executor = make_executor(args.executor, args.jobs)
    command = "kvsim " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    done = plan(spec, args.out, executor, args.quality, progress=not args.json,
                command=command, force=args.force, prices=prices, memory=memory)
    summary, df = done.summary, done.table.copy()
    failed = df[df["status"] == "failed"] if "status" in df else df.iloc[:0]
    if args.json:
        print_json(summary)
    else:
        if summary["answer"] is not None:
            print("\n".join(answer_lines(summary["answer"])).replace("`", "") + "\n")
        cols = summary_columns(df)
        # a swept setting's values (as run: the default resolved), after the batch
        for flag, col, group in (("--host-gib", "host_capacity_gib", spec.deployment),
                                 ("--max-batched-tokens", "max_batched_tokens", spec.scheduling),
                                 ("--cache-host-gib", "cache_host_gib", spec.caching)):
            swept = group.get(col.replace("_capacity", ""))
            if isinstance(swept, list) and len(swept) > 1 and col in df:
                df[flag] = df[col]
                cols.insert(cols.index("batch") + 1, flag)
        table(df[cols].to_dict("records"))
        print(f"\n{summary['rows']} rows ({summary['new_runs']} run now, {summary['skipped']} "
              f"already done; {summary['infeasible']} infeasible, {summary['failed']} failed)")
        print(f"wrote {args.out}/results.csv, results.parquet, report.md and "
              f"{len(summary['plots'])} plots")
    for _, r in failed.iterrows():  # what succeeded is written; the failures are named
        print(f"kvsim plan: failed: {r['gpu']} {r['model']} {r['context']} {r['label']} batch "
              f"{r['batch']}: {r['error']}", file=sys.stderr)
    return 1 if len(failed) else 0
