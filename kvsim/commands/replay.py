"""kvsim replay: simulate serving a model on a GPU under a KV policy."""

from __future__ import annotations

import argparse
import sys

from kvsim.commands._out import print_json, table

HELP = "simulate decode under a KV policy on a GPU"
EPILOG = """examples:
  kvsim replay --policy dense-offload --gpu h100-sxm --model qwen3-4b --context 32768
  kvsim replay traces/smollm2-mk-2k.npz --policy verkv --compression 16 --sink 4 --local 4 --json
  kvsim replay --policy verkv:sketch=perfect:eps=0.1 --sink 4 --local 4
  kvsim replay --policy dense --batch 16 --qps 2 --requests 200

TRACE is a kvsim trace (.npz): its hardware section (kvsim profile) gives measured costs, its
attention section (kvsim capture) the tensors the policy runs on. Without TRACE, policies that
need attention take their statistics from the shipped policy profile (SmolLM2 at 1K-8K tokens,
fitted and extrapolated to --context with a 90% interval: the _lo/_hi figures), the others from
the shipped default trace. Each figure's source is under "provenance"; --json groups figures
(sim, memory, policy_cost, policy_stats, policy_timings) beside the headline ones.
"""


USAGE = ("%(prog)s [TRACE] [--policy SPEC] [--gpu GPU] [--model MODEL] [--context N]\n"
         "                    [--batch N] [--qps R | --concurrency N | --workload FILE] "
         "[OPTION ...]")


def add_parser(sub) -> None:
    from kvsim.commands._policy_flags import add_policy_flags, policy_help
    from kvsim.hw.costs import DEFAULT_GPU
    p = sub.add_parser("replay", help=HELP, description=__doc__, epilog=EPILOG, usage=USAGE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="?", metavar="TRACE",
                   help="trace file (default: the shipped default trace)")
    p.add_argument("--policy", default="dense-offload", metavar="SPEC",
                   help=policy_help() + " [default: dense-offload]")
    p.add_argument("--gpu", help=f"a catalog GPU (kvsim catalog lists them) [default: the "
                                 f"trace's profiled hardware if any, else {DEFAULT_GPU}]")
    p.add_argument("--model", default="qwen3-4b",
                   help="a catalog model or a Hugging Face config.json (file or directory; "
                        "dense or MoE) [default: qwen3-4b]")
    add_deployment_flags(p)
    p.add_argument("--context", type=int, default=32768, metavar="N",
                   help="prompt tokens per request [default: 32768]")
    p.add_argument("--output-len", type=int, default=128, metavar="N",
                   help="output tokens per request [default: 128]")
    p.add_argument("--batch", type=int, default=1, metavar="N",
                   help="max sequences in the decode batch [default: 1]")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--qps", type=float, metavar="R",
                      help="Poisson arrivals at this rate (open loop)")
    load.add_argument("--concurrency", type=int, metavar="N",
                      help="closed loop, N requests in flight [default: --batch]")
    load.add_argument("--workload", metavar="FILE",
                      help="requests from a file, in a format of --workload-format")
    p.add_argument("--workload-format", default="auto", metavar="F",
                   choices=["auto", "kvsim", "azure", "burstgpt", "mooncake"],
                   help="kvsim (CSV: arrival s, prompt, output), azure, burstgpt, mooncake, "
                        "or auto (by its first line) [default: auto]")
    p.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                   help="multiply the --workload file's arrival times by X (0.5: twice the "
                        "rate) [default: 1]")
    p.add_argument("--limit", type=int, metavar="N",
                   help="only the --workload file's first N requests by arrival")
    p.add_argument("--requests", type=int, metavar="N",
                   help="requests [default: 2 x concurrency, or 64 with --qps]")
    p.add_argument("--reuse", metavar="SPEC", help="with --qps: prompts reusing prefixes: "
                   "conversations[:KEY=V,...] or shared-prompts[:...]")
    p.add_argument("--block-tokens", type=int, default=512, metavar="N",
                   help="--reuse's prefix block [default: 512]")
    add_scheduling_flags(p)
    add_caching_flags(p)
    add_engine_flags(p)
    for metric, what, unit in (("tpot-ms", "TPOT", "MS"), ("ttft-ms", "TTFT", "MS"),
                               ("e2e-s", "end-to-end", "S")):
        p.add_argument(f"--slo-{metric}", type=float, metavar=unit,
                       help=f"per-request {what} limit for goodput")
    p.add_argument("--timeline", metavar="JSON",
                   help="write a Perfetto trace of the first decode steps")
    p.add_argument("--timeline-steps", type=int, default=16, metavar="N",
                   help="decode steps in the timeline [default: 16]")
    p.add_argument("--force", action="store_true", help="overwrite an existing --timeline file")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="[default: 0]")
    p.add_argument("--jobs", type=int, metavar="N",
                   help="processes for 100,000+ requests, open loop [default: CPUs]")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_policy_flags(p)
    p.set_defaults(run=run)


def add_scheduling_flags(p) -> None:
    """How the engine batches (:class:`kvsim.sim.rules.Scheduling`): shared by replay and plan."""
    from kvsim.commands._option_flags import add_option_flags
    from kvsim.sim.rules import Scheduling
    add_option_flags(p, Scheduling, "scheduling", "how the engine batches (vLLM's defaults)")
    _compact(p._action_groups[-1])


def add_deployment_flags(p) -> None:
    """Element types, memory, tensor parallelism and replicas
    (:class:`kvsim.sim.records.Deployment`): shared by replay and plan."""
    from kvsim.commands._option_flags import add_option_flags
    from kvsim.sim.records import Deployment
    add_option_flags(p, Deployment, "deployment", "element types, memory, how many GPUs")
    _compact(p._action_groups[-1])


def add_caching_flags(p) -> None:
    """Prefix caching and the tiers below the GPU (:class:`kvsim.sim.records.PrefixCaching`):
    shared by replay and plan."""
    from kvsim.commands._option_flags import add_option_flags
    from kvsim.sim.records import PrefixCaching
    add_option_flags(p, PrefixCaching, "prefix caching", "cached prefixes are not prefilled; "
                     "blocks evicted from HBM go to the tiers below (host, pool, disk)")
    _compact(p._action_groups[-1])


def _compact(group) -> None:
    """Short metavars (``--kv-dtype TYPE``, not ``--kv-dtype {bf16,fp16,fp8}``) so that each
    flag's help starts on its own line; the choices are named in the help, once."""
    for action in group._group_actions:
        if action.metavar is not None:
            continue
        last = action.dest.rsplit("_", 1)[-1].upper()
        if not action.choices:
            action.metavar = last
            continue
        action.metavar = "TYPE" if last == "DTYPE" else "NAME"
        text = action.help or ""
        if not all(str(c) in text for c in action.choices):
            head, sep, tail = text.partition(" [default")
            action.help = f"{head}: {', '.join(map(str, action.choices))}{sep}{tail}"


def add_engine_flags(p) -> None:
    """The engine profile and what-if overrides: shared by replay and plan."""
    g = p.add_argument_group(
        "engine", "what the serving engine adds to the hardware (kvsim fit writes a profile); "
                  "each override below is recorded in provenance as such")
    g.add_argument("--engine", metavar="NAME|JSON",
                   help="a fitted family (trtllm, vllm, vllm-v0, sglang, lmdeploy, gpt-fast, "
                        "hf, ...), vllm==0.6.3; other names: the shared fit, warned; "
                        "vllm-paper, roofline, a fit file [default: trtllm; AMD: vllm]")
    g.add_argument("--policy-profile", metavar="FILE|default|none",
                   help="policy statistics fitted to the context with a 90%% interval; "
                        "'none': the trace's [default: the shipped one without a trace]")
    g.add_argument("--kv-read-frac", type=float, metavar="F",
                   help="KV read per decode step, a share of the cache (replaces "
                        "the trace's; plan: fetching policies)")
    g.add_argument("--decide-ms", type=float, metavar="MS",
                   help="decide time per request and decode step, all layers")
    g.add_argument("--step-overhead-ms", type=float, metavar="MS",
                   help="engine overhead per step, whatever its batch")
    g.add_argument("--link-gbps", type=float, metavar="GBPS",
                   help="host-link GB/s of every path (gather keeps its ratio)")
    g.add_argument("--allreduce-kernel", metavar="nccl|custom",
                   help="what-if all-reduce kernel [default: the engine's]")


def engine_options(args) -> dict:
    return {k: getattr(args, k) for k in ("engine", "policy_profile", "kv_read_frac",
                                          "decide_ms", "step_overhead_ms", "link_gbps",
                                          "allreduce_kernel")
            if getattr(args, k) is not None}


def lengths_words(r: dict) -> str:
    """``context 32768``, or a workload's prompt lengths: ``prompts mean 70,527, p50 65,598,
    p99 129,466, max 131,051 tokens``."""
    p = r.get("prompt_tokens")
    if p is None:
        return f"context {r['context']}"
    return (f"prompts mean {p['mean']:,.0f}, p50 {p['p50']:,.0f}, p99 {p['p99']:,.0f}, max "
            f"{p['max']:,} tokens (outputs mean {r['output_tokens']['mean']:,.0f})")


def run(args) -> int:
    from kvsim.commands._option_flags import option_values
    from kvsim.commands._policy_flags import policy_options
    from kvsim.errors import KvsimError
    from kvsim.policies import parse
    from kvsim.replay import configure, run_replay
    from kvsim.sim.records import Deployment, PrefixCaching
    from kvsim.sim.rules import Scheduling
    specs, ignored = parse(args.policy, policy_options(args))
    if len(specs) != 1:
        raise KvsimError(f"replay runs one policy; --policy names {len(specs)}")
    spec = specs[0]
    cfg = configure(trace=args.trace, policy=spec, gpu=args.gpu, model=args.model,
                    context=args.context, batch=args.batch, qps=args.qps,
                    concurrency=args.concurrency, requests=args.requests,
                    output_len=args.output_len, workload_csv=args.workload, seed=args.seed,
                    workload_format=args.workload_format, time_scale=args.time_scale,
                    workload_limit=args.limit, reuse=args.reuse,
                    block_tokens=args.block_tokens, **option_values(args, Scheduling),
                    **option_values(args, Deployment), **option_values(args, PrefixCaching),
                    **engine_options(args),
                    slo={k: v for k, v in (("tpot_ms", args.slo_tpot_ms),
                                           ("ttft_ms", args.slo_ttft_ms),
                                           ("e2e_s", args.slo_e2e_s)) if v is not None})
    result = run_replay(cfg, progress=not args.json,  # the analysis can take a minute
                        timeline=args.timeline, timeline_steps=args.timeline_steps,
                        force=args.force, jobs=args.jobs)
    if ignored:
        result.warnings.insert(0, f"{', '.join(ignored)} ignored: not options of {spec.name}")
    r = result.to_json()
    if args.json:
        for w in r["warnings"]:
            print(f"warning: {w}", file=sys.stderr)
        print_json(r)
        return 0
    print(f"{r['policy']} on {r['gpu']}, {r['model']}, {lengths_words(r)}, batch {r['batch']}"
          + (f", {r['replicas']} replicas" if r["replicas"] > 1 else ""))
    cols = ["tpot_ms", "tpot_p99_ms", "itl_p99_ms", "throughput_tok_s", "decode_tok_s",
            "ttft_ms", "ttft_p99_ms", "e2e_s", "mean_batch", "hbm_gib", "host_gib", "link_util",
            "kv_read_frac"]
    table([{c: r[c] if c in r else r["sim"][c] for c in cols}])
    s = r["sim"]
    if s.get("served_frac_window") is not None and s["served_frac_window"] < 0.95:
        print(f"overloaded: {100 * s['served_frac_window']:.0f}% of the arrivals were served "
              f"over the measured window and the queue grew by {s['queue_growth_window']:,} "
              f"requests: the latencies above grow with the run's length, they are not "
              f"the deployment's (more replicas, or a lower rate)")
    if (pc := r.get("prefix_cache")) is not None:
        tiers = ", ".join(f"{t} {100 * pc[f'prefix_hit_frac_{t}']:.1f}%"
                          for t in ("gpu", "host", "pool", "disk")
                          if pc[f"prefix_hit_frac_{t}"] or t == "gpu")
        print(f"prefix cache: {100 * pc['prefix_hit_frac']:.1f}% of prompt tokens hit "
              f"({tiers}); {pc['prefix_tokens_prefilled']:,} of "
              f"{pc['prefix_prompt_tokens']:,} prefilled")
    if "tpot_ms_lo" in r:
        read = (f"KV read {r['kv_read_frac_lo']:.4g}..{r['kv_read_frac_hi']:.4g} (policy "
                f"profile), " if "kv_read_frac_lo" in r else "")
        print(f"interval (the engine's checked error, with the policy profile's where it has "
              f"one): {read}TPOT {r['tpot_ms_lo']:.4g}..{r['tpot_ms_hi']:.4g} ms, TTFT "
              f"{r['ttft_ms_lo']:.4g}..{r['ttft_ms_hi']:.4g} ms, throughput "
              f"{r['throughput_tok_s_lo']:.4g}..{r['throughput_tok_s_hi']:.4g} tok/s")
    if "goodput_rps" in r["sim"]:
        s = r["sim"]
        print(f"goodput {s['goodput_rps']:.4g} requests/s ({100 * s['slo_attainment']:.1f}% of "
              f"requests meet every SLO given); p99 TPOT {s['tpot_p99_ms']:.4g} ms, p99 TTFT "
              f"{s['ttft_p99_ms']:.4g} ms")
    stats = {k: v for k, v in r["policy_stats"].items() if isinstance(v, (int, float))}
    if stats and set(stats) - {"kv_read_frac", "output_rel_err_mean"}:
        where = "the policy profile at this context" if "policy_profile" in r else "the trace"
        print(f"\npolicy statistics (from {where}; --json has them by phase: question, "
              f"decode, overall)")
        iv = r.get("policy_profile", {}).get("intervals", {})
        basis = "decode" if "decode.kv_read_frac" in iv else "question"

        def ends(k):  # the profile's 90% interval: traffic per decode step, the rest overall
            from kvsim.policy_profile import TRAFFIC
            return iv.get(f"{basis if k in TRAFFIC else 'overall'}.{k}", ("", ""))
        table([{"statistic": k, "value": v, **({"90% lo": ends(k)[0], "90% hi": ends(k)[1]}
                                                if iv else {})} for k, v in stats.items()])
    for w in r["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    print("\nprovenance")
    width = max(map(len, r["provenance"]))
    for k, v in r["provenance"].items():
        print(f"  {k.ljust(width)}  {v}")
    return 0
