"""Build ``data/published.csv`` (the rows ``kvsim fit`` reads) from the transcriptions in
``data/published/*.csv`` (one file per search area, every row with its source; the ``.md`` next to
each says how each source measured).

Kept: rows with a stated batch (a static batch, or one request at a time) of a model in kvsim's
catalog on a catalog GPU, in a dense attention engine (every policy here is ``dense-resident``).
Left out, each for a reason printed per source with ``--why``:

* serving runs whose running batch is not stated (Poisson arrivals, "max throughput"), and runs
  at a fixed concurrency with long prompts arriving while others decode (their TPOT includes
  prefills that a static batch does not have);
* systems that are not a dense engine (ShadowKV's sparse attention, MInference's sparse prefill,
  QServe's 4-bit KV cache) and int8/int4 weights (no W8A8 int8 or W4 path in kvsim's rates);
* batches whose weights and KV cache do not fit in the GPUs' memory: the engine ran fewer
  sequences at once than the table says;
* LMDeploy's first-token latency at batch > 1 (requests sent at once queue for the prefill:
  their mean TTFT is not one prefill step, the source's own minimum is 100x lower);
Families: the ``engine`` column, except that vLLM is split by its engine generation
(:data:`VLLM_GENERATIONS`): before 0.4 (the early-2024 pull requests) ``vllm-0.3``, whose per-step
costs are several times today's (one vLLM family fitted to both missed either by 30-90%); 0.4 to
0.7, the V0 engine, ``vllm-v0``; 0.8 on, the V1 engine, ``vllm``. Pooled, the V0 rows' per-step
costs made every V1 row 21-34% slow in leave-one-source-out (docs/results/published.md).

* end-to-end latency where the row also gives throughput (the same measurement: B x O / latency),
  and a decode-only throughput where the row gives its TPOT (batch / TPOT): said in the note, or
  a throughput that is batch / TPOT beside a latency it does not match (then the latency stays).

    python scripts/build_published_dataset.py [--why]
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
from pathlib import Path

from kvsim.hw.catalog import MODEL_IDS as MODELS  # Hugging Face id -> catalog name
from kvsim.hw.engine import VLLM_GENERATIONS  # vLLM's generations, each a family

ROOT = Path(__file__).resolve().parents[1]
RAW = ROOT / "data" / "published"
OUT = ROOT / "data" / "published.csv"

FAMILIES = {"vllm": "vllm", "sglang": "sglang", "trtllm": "trtllm", "lmdeploy": "lmdeploy",
            "other:hf-transformers-fa2": "hf", "other:shadowkv-fullattn-baseline": "hf",
            "other:gpt-fast": "gpt-fast"}
# versions a source does not state but its harness shows, by (source, engine); data/published/*.md
HARNESS_VERSION = {("llm-inference-bench-anl-2024", "vllm"): "0.5 (its script's API)"}
DTYPES = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8", "": ""}
# harnesses that repeat one prompt across the batch and decode greedily: every sequence routes
# to the same experts (ModelSpec.routing "shared"), by (source, engine); data/published/*.md
SHARED_ROUTING = {("llm-inference-bench-anl-2024", "trtllm")}
# TensorRT-LLM added FP8 for Mixtral in 0.10 ("Added FP8 quantization support for Mixtral", its
# release notes): an earlier "fp8" MoE row ran its GEMMs at the bf16 rate (ModelSpec.weight_only)
FP8_MOE_SINCE = {"trtllm": (0, 10)}
# engines whose decode attention was not GQA-aware before these versions (ModelSpec: a KV head is
# read once per query head of its group, ``attention=per-query-head``): TensorRT-LLM's masked MHA
# before its XQA kernel (news of 2024-01-30; 0.5 and 0.6 here), vLLM's PagedAttention before
# flash-attn decoding (PR #2744: "does not leverage the benefits of MQA/GQA"; PR #4907 of
# 2024-05-19 brought flash-attn decoding back after 0.4.2); data/published/*.md
GQA_AWARE_SINCE = {"trtllm": (0, 7, 0), "vllm": (0, 4, 3)}
COLUMNS = ("use", "engine", "engine_version", "gpu", "tp", "model", "weight_dtype", "kv_dtype",
           "attention", "routing", "weight_only", "policy", "context", "batch", "output_len",
           "tpot_ms", "ttft_ms", "throughput_tok_s", "latency_s", "certainty", "source", "where",
           "url", "note")


def convert(r: dict) -> tuple[dict | None, str]:
    """The fit row of a transcribed row, or None and why it is left out."""
    if not r["batch"]:
        return None, "running batch not stated (a serving run)"
    if "fixed concurrency" in r["note"] and int(r["batch"]) > 1:
        return None, "fixed concurrency with prompts arriving during decode"
    fam = FAMILIES.get(r["engine"])
    if fam is None:
        return None, f"not a dense engine ({r['engine']})"
    model = MODELS.get(r["model"].lower())
    if model is None:
        return None, f"model {r['model']} not in the catalog"
    w, kv = r["weight_dtype"], r["kv_dtype"]
    if w not in DTYPES or kv not in DTYPES:
        return None, f"dtype {w}/{kv} has no rate in kvsim"
    out = {c: "" for c in COLUMNS}
    version = r["engine_version"] or HARNESS_VERSION.get((r["source"], fam), "")
    release = re.match(r"~?(\d+)\.(\d+)(?:\.(\d+))?", version)
    release = tuple(int(x or 0) for x in release.groups()) if release else None
    major_minor = release[:2] if release else None
    gqa_since = GQA_AWARE_SINCE.get(fam)
    if fam == "vllm":
        if major_minor is None:
            return None, "vLLM version neither stated nor shown by the harness"
        fam = next(f for since, f in VLLM_GENERATIONS if major_minor >= since)
    out.update(use="fit", engine=fam, engine_version=version, gpu=r["gpu"],
               tp=r["tp"] or "1", model=model, weight_dtype=DTYPES[w], kv_dtype=DTYPES[kv],
               policy="dense-resident", context=r["input_len"], batch=r["batch"],
               output_len=r["output_len"] or "1")
    from kvsim.hw import catalog
    if gqa_since and release and release < gqa_since:
        out["attention"] = "per-query-head"
    if catalog.model(model).experts:
        if (r["source"], fam) in SHARED_ROUTING:
            out["routing"] = "shared"
        since = FP8_MOE_SINCE.get(fam)
        if since and w == "fp8" and major_minor and major_minor < since:
            out["weight_only"] = "true"
    for k in ("tpot_ms", "ttft_ms", "throughput_tok_s", "latency_s", "certainty", "source",
              "where", "url", "note"):
        out[k] = r[k]
    if fam == "lmdeploy" and int(r["batch"]) > 1:
        out["ttft_ms"] = ""
    if out["throughput_tok_s"] and out["latency_s"]:
        b, o = int(out["batch"]), int(out["output_len"])
        if _near(float(out["throughput_tok_s"]) * float(out["latency_s"]), b * o, 0.02):
            out["latency_s"] = ""  # the same measurement
        elif out["tpot_ms"] and _near(float(out["throughput_tok_s"]) * float(out["tpot_ms"]),
                                      1e3 * b, 1e-3):
            out["throughput_tok_s"] = ""  # decode only, batch / TPOT: the TPOT again
    if "Decode-only throughput" in r["note"] and out["tpot_ms"]:
        out["throughput_tok_s"] = ""  # batch / TPOT: the same measurement as the TPOT
    if not out["context"]:
        return None, "prompt length not stated"
    need, have = _memory(out)
    if need > have:
        return None, (f"the batch does not fit ({need / 2**30:.0f} of {have / 2**30:.0f} GiB per "
                      f"GPU): the engine ran fewer at once")
    if not any(out[k] for k in ("tpot_ms", "ttft_ms", "throughput_tok_s", "latency_s")):
        return None, "no measured value left (LMDeploy TTFT at batch > 1)"
    return out, ""


def _near(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


def _memory(row: dict) -> tuple[float, float]:
    """Bytes one GPU needs to hold the batch (its weights, and every sequence's KV cache at its
    longest), and its HBM."""
    from kvsim.hw import catalog
    from kvsim.replay import with_dtypes
    tp = int(row["tp"])
    m = with_dtypes(catalog.model(row["model"]), row["kv_dtype"] or None,
                    row["weight_dtype"] or None).shard(tp)
    tokens = int(row["batch"]) * (int(row["context"]) + int(row["output_len"]))
    return m.weight_bytes + m.kv_bytes_per_token * tokens, catalog.gpu(row["gpu"]).hbm_gib * 2**30


def verkv_paper_dense() -> list[dict]:
    """The VerKV paper's dense rows (``data/verkv-paper-h100.csv``: vLLM, one H100, Qwen3-4B at
    32K; resident and offloaded to host memory), as one source: its offload rows are the
    dataset's only measurement of a KV cache read over PCIe."""
    out = []
    with (ROOT / "data" / "verkv-paper-h100.csv").open(newline="") as f:
        for r in csv.DictReader(line for line in f if not line.startswith("#")):
            if not r["policy"].startswith("dense"):
                continue
            row = {c: "" for c in COLUMNS}
            row.update({k: r[k] for k in ("gpu", "model", "policy", "context", "batch",
                                          "output_len", "tpot_ms", "certainty", "note")},
                       use="fit", engine="vllm-paper", tp="1", weight_dtype="bf16",
                       kv_dtype="bf16", source="verkv-paper", where=r["source"],
                       url="../shared/seeds/000_e722851d81b01a2a.txt (data/verkv-paper-h100.csv)")
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--why", action="store_true", help="print what was left out and why")
    args = ap.parse_args()
    rows, left = [], collections.Counter()
    for path in sorted(p for p in RAW.glob("*.csv") if p.name != "serving.csv"):
        for r in csv.DictReader(path.open(newline="")):
            row, why = convert(r)
            if row is None:
                left[(r["source"], why)] += 1
            else:
                rows.append(row)
    rows += verkv_paper_dense()
    with OUT.open("w", newline="") as f:
        f.write("# Published serving measurements, built by scripts/build_published_dataset.py "
                "from data/published/*.csv (see data/published/README.md)\n")
        w = csv.DictWriter(f, COLUMNS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    per = collections.Counter(r["source"] for r in rows)
    print(f"wrote {OUT.relative_to(ROOT)}: {len(rows)} rows from {len(per)} sources")
    for s, n in per.most_common():
        print(f"  {n:4d}  {s}")
    if args.why:
        print("left out:")
        for (s, why), n in sorted(left.items()):
            print(f"  {n:4d}  {s}: {why}")


if __name__ == "__main__":
    main()
