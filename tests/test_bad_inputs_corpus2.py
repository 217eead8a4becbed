"""The second generated corpus of bad inputs (issue #28): Hugging Face configs, public-trace
workload files, deployment, scheduler and SLO flags, engine and policy-profile files, kvsim fit
CSVs and interrupted plans. Each case gets exit status 2 and one line on stderr naming the
problem (never a traceback), or the right result; no file that was there before is changed or
removed. Built from a few tables at run time, run in-process."""

import contextlib
import errno
import gzip
import hashlib
import json
import os
import tempfile
from pathlib import Path

import pytest

from kvsim.cli import main
from kvsim.hw.engine import BUILTIN
from kvsim.policy_profile import FORMAT as PROFILE_FORMAT

GOOD_CONFIG = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
               "hidden_size": 512, "intermediate_size": 1024, "vocab_size": 1000,
               "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256}
FAST = ["--context", "1024", "--requests", "2", "--output-len", "4", "--json"]


def _snapshot(root: Path) -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*")
            if p.is_file() and not p.is_symlink()}


def _check(argv, capsys, root: Path, word: str | None, outputs: Path | None = None):
    """Run ``kvsim ARGV``: exit 2 with one line holding ``word`` (None: exit 0); every file
    under ``root`` that was there before is still there, unchanged (but for those under
    ``outputs`` on success)."""
    before = {p: h for p, h in _snapshot(root).items()
              if word is not None or outputs is None or outputs not in p.parents}
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    if word is None:
        assert code == 0, err
    else:
        assert code == 2, (argv, err)
        errors = [line for line in err if not line.startswith("warning:")]
        assert len(errors) == 1 and "Traceback" not in errors[0], err
        assert len(errors[0]) < 600, errors[0][:600]  # a line, not the file read back
        assert word.lower() in errors[0].lower(), (word, errors[0])
    after = _snapshot(root)
    assert {p: h for p, h in after.items() if p in before} == before
    assert not [p for p in root.rglob("*.tmp")], "a partial file was left"
    return err


def _write(path: Path, content) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(json.dumps(content))
    return path


def _deep(n: int = 100_000) -> str:
    return "[" * n + "]" * n


# --------------------------------------------------------------- Hugging Face config.json
def _cfg(**change):
    out = dict(GOOD_CONFIG)
    for k, v in change.items():
        if v is _DROP:
            out.pop(k, None)
        else:
            out[k] = v
    return out


_DROP = object()
CONFIGS = {  # name -> (content, keyword; None: the right result)
    "empty file": ("", "not JSON"),
    "truncated": (json.dumps(GOOD_CONFIG)[:40], "not JSON"),
    "trailing comma": ('{"num_hidden_layers": 4,}', "not JSON"),
    "an array": ("[1, 2]", "not a JSON object"),
    "null": ("null", "not a JSON object"),
    "a string": ('"config"', "not a JSON object"),
    "nested 100,000 deep": (_deep(), "nests deeper"),
    "nested 40 deep in a field": ('{"a": ' + _deep(40) + "}", "nests deeper"),
    "gzip": (gzip.compress(json.dumps(GOOD_CONFIG).encode()), "gzip"),
    "latin-1 bytes": (b'{"name": "\xe9"}', "not UTF-8"),
    "NaN layers": (json.dumps(GOOD_CONFIG).replace('"num_hidden_layers": 4',
                                                   '"num_hidden_layers": NaN'), "NaN"),
    "Infinity heads": (json.dumps(GOOD_CONFIG).replace('"num_attention_heads": 8',
                                                       '"num_attention_heads": Infinity'),
                       "Infinity"),
    "-Infinity theta": (json.dumps(GOOD_CONFIG)[:-1] + ', "rope_theta": -Infinity}',
                        "Infinity"),
    "1e400 hidden": (json.dumps(GOOD_CONFIG).replace('"hidden_size": 512', '"hidden_size": 1e400'),
                     "finite"),
    "5000-digit vocabulary": (json.dumps(GOOD_CONFIG).replace('"vocab_size": 1000',
                                                              '"vocab_size": ' + "9" * 5000),
                              "not JSON"),
    "layers a string": (_cfg(num_hidden_layers="32"), "num_hidden_layers"),
    "layers fractional": (_cfg(num_hidden_layers=2.5), "num_hidden_layers"),
    "layers zero": (_cfg(num_hidden_layers=0), "num_hidden_layers"),
    "layers negative": (_cfg(num_hidden_layers=-4), "num_hidden_layers"),
    "layers 1e15": (_cfg(num_hidden_layers=10**15), "beyond"),
    "layers true": (_cfg(num_hidden_layers=True), "num_hidden_layers"),
    "heads an object": (_cfg(num_attention_heads={"a": 1}), "num_attention_heads"),
    "heads an empty list": (_cfg(num_attention_heads=[]), "empty list"),
    "rope_theta a string": (_cfg(rope_theta="abc"), "rope_theta"),
    "rope_theta negative": (_cfg(rope_theta=-1.0), "rope_theta"),
    "dtype unknown": (_cfg(torch_dtype="float8"), "dtype"),
    "heads not a multiple of KV heads": (_cfg(num_key_value_heads=3), "multiple"),
    "no head_dim and an odd width": (_cfg(hidden_size=500), "head_dim"),
    "rope scaling base a string": (_cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": "x"}),
                                   "original_max_position_embeddings"),
    "MLA (kv_lora_rank)": (_cfg(kv_lora_rank=512), "latent attention"),
    "MoE top-k above the experts": (_cfg(**MOE | {"num_experts_per_tok": 16}), "experts"),
    "MoE top-k missing": (_cfg(**{k: v for k, v in MOE.items() if k != "num_experts_per_tok"}),
                          "moe_topk"),
    "MoE top-k a string": (_cfg(**MOE | {"num_experts_per_tok": "2"}), "num_experts_per_tok"),
    "MoE sparse step zero": (_cfg(**MOE | {"decoder_sparse_step": 0}), "decoder_sparse_step"),
    "MoE dense layers a string": (_cfg(**MOE | {"first_k_dense_replace": "a"}),
                                  "first_k_dense_replace"),
    "MoE mlp_only_layers a string": (_cfg(**MOE | {"mlp_only_layers": "0,1"}),
                                     "mlp_only_layers"),
    "MoE shared experts a string": (_cfg(**MOE | {"n_shared_experts": "1"}),
                                    "n_shared_experts"),
    **{f"no {k}": (_cfg(**{k: _DROP}), k) for k in
       ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")},
    "layers null": (_cfg(num_hidden_layers=None), "num_hidden_layers"),
    "good": (GOOD_CONFIG, None),
    "good MoE": (_cfg(**MOE), None),
    "good with a BOM and CRLF": (b"\xef\xbb\xbf" + json.dumps(GOOD_CONFIG, indent=1).replace(
        "\n", "\r\n").encode(), None),
    "good under text_config": ({"text_config": GOOD_CONFIG, "model_type": "x"}, None),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_hf_configs(name, tmp_path, capsys):
    content, word = CONFIGS[name]
    path = _write(tmp_path / "config.json", content)
    _check(["replay", "--model", path, "--policy", "dense-resident", *FAST], capsys, tmp_path,
           word)


@pytest.mark.parametrize("given, word", [
    ("missing.json", "no such"), ("no such file", "is a directory"),
    ("fifo.json", "not a regular file"), ("loop.json", "cannot read")])
def test_config_paths(given, word, tmp_path, capsys):
    (tmp_path / "no such file").mkdir()
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "loop.json").symlink_to(tmp_path / "loop.json")
    _check(["replay", "--model", tmp_path / given, "--policy", "dense-resident", *FAST], capsys,
           tmp_path, word)


# ------------------------------------------------------------------------ workload files
AZ = "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
BG = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
MC = '{"timestamp": 0, "input_length": 100, "output_length": 10}\n'
WORKLOADS = {
    "header only": ("arrival,prompt,output\n", "no requests"),
    "empty": ("", "empty"),
    "BOM and CRLF": ("\ufeffarrival,prompt,output\r\n0,100,4\r\n0.5,100,4\r\n", None),
    "Azure with CRLF": (AZ + "2023-11-16 18:15:46.6805900,100,4\r\n"
                        "2023-11-16 18:15:47.1,120,4\r\n", None),
    "unsorted times": ("arrival,prompt,output\n2,100,4\n0,100,4\n1,100,4\n", None),
    "duplicate times": ("arrival,prompt,output\n0,100,4\n0,100,4\n0,100,4\n", None),
    "gzip": (gzip.compress(b"arrival,prompt,output\n0,100,4\n"), "not UTF-8"),
    "time 1e300": ("arrival,prompt,output\n0,100,4\n1e300,100,4\n", "beyond"),
    "time inf": ("arrival,prompt,output\ninf,100,4\n", "finite"),
    "time nan": ("arrival,prompt,output\nnan,100,4\n", "finite"),
    "time negative": ("arrival,prompt,output\n-1,100,4\n", "negative"),
    "prompt 1e12": ("arrival,prompt,output\n0,1000000000000,4\n", "too large"),
    "prompt fractional": ("arrival,prompt,output\n0,100.5,4\n", "whole number"),
    "huge row": ("arrival,prompt,output\n0,100," + "9" * 200_000 + "\n", "output '999"),
    "BurstGPT time 1e300": (BG + "1e300,ChatGPT,100,4,104,Conversation log\n", "beyond"),
    "Azure bad date": (AZ + "yesterday,100,4\r\n", "date"),
    "Mooncake NaN": ('{"timestamp": NaN, "input_length": 100, "output_length": 10}\n', "NaN"),
    "Mooncake 1e300 ms": (MC + '{"timestamp": 1e300, "input_length": 100, '
                               '"output_length": 10}\n', "beyond"),
    "Mooncake deep line": (MC + '{"timestamp": 1, "x": ' + _deep(5000) + "}\n", "nests deeper"),
    "Mooncake array line": (MC + "[1, 2]\n", "not a JSON object"),
    "Mooncake unsorted": (MC.replace("0,", "5,") + MC, None),
}


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_files(name, tmp_path, capsys):
    content, word = WORKLOADS[name]
    path = _write(tmp_path / "w.csv", content)
    _check(["replay", "--workload", path, "--policy", "dense-resident", "--context", "1024",
            "--json"], capsys, tmp_path, word)


def test_a_directory_called_no_such_file(tmp_path, capsys):
    (tmp_path / "no such file").mkdir()
    _check(["replay", "--workload", tmp_path / "no such file", "--json"], capsys, tmp_path,
           "is a directory")


# ----------------------------------------------------------------------- numeric flags
REPLAY_FLAGS = [
    (["--seed", "-1"], "--seed: must be a whole number >= 0"),
    (["--seed", "1.5"], "--seed"), (["--seed", "x"], "--seed"), (["--seed", "1e30"], "beyond"),
    (["--seed", "nan"], "--seed"),
    (["--link-gbps", "inf"], "--link-gbps: must be finite"),
    (["--link-gbps", "nan"], "must be finite"), (["--link-gbps", "0"], "--link-gbps"),
    (["--link-gbps", "-1"], "--link-gbps"),
    (["--decide-ms", "-1"], "--decide-ms"), (["--decide-ms", "inf"], "finite"),
    (["--step-overhead-ms", "nan"], "finite"), (["--step-overhead-ms", "-0.5"], "overhead"),
    (["--allreduce-kernel", "ring"], "--allreduce-kernel must be one of nccl, custom"),
    (["--kv-read-frac", "1.5"], "share"), (["--kv-read-frac", "-0.1"], "share"),
    (["--kv-read-frac", "nan"], "finite"),
    (["--qps", "0"], "--qps"), (["--qps", "-2"], "--qps"), (["--qps", "inf"], "finite"),
    (["--requests", "0"], "--requests"), (["--requests", "-1"], "--requests"),
    (["--context", "0"], "--context"), (["--context", "-1"], "--context"),
    (["--context", "1.5"], "--context"), (["--output-len", "0"], "--output-len"),
    (["--batch", "0"], "--batch"), (["--batch", "1e12"], "beyond"),
    (["--concurrency", "-1"], "--concurrency"), (["--timeline-steps", "0"], "--timeline-steps"),
    (["--jobs", "0"], "--jobs"), (["--jobs", "-1"], "--jobs"),
    (["--tp", "0"], "--tp"), (["--tp", "-1"], "--tp"), (["--tp", "2.5"], "--tp"),
    (["--tp", "x"], "--tp"), (["--tp", "3"], "tp"),
    (["--replicas", "0"], "--replicas"), (["--replicas", "inf"], "--replicas"),
    (["--router", "random"], "--router"),
    (["--kv-dtype", "int3"], "--kv-dtype"), (["--weight-dtype", "fp4x"], "--weight-dtype"),
    (["--host-gib", "-1"], "--host-gib"), (["--host-gib", "inf"], "finite"),
    (["--workspace-gib", "nan"], "finite"),
    (["--scheduler", "fifo"], "--scheduler"), (["--max-batched-tokens", "0"], "tokens"),
    (["--max-batched-tokens", "-5"], "--max-batched-tokens"),
    (["--admission", "maybe"], "--admission"), (["--preemption", "drop"], "--preemption"),
    (["--slo-tpot-ms", "0"], "slo"), (["--slo-tpot-ms", "-1"], "slo"),
    (["--slo-ttft-ms", "nan"], "finite"), (["--slo-e2e-s", "inf"], "finite"),
    (["--slo-tpot-ms", "abc"], "--slo-tpot-ms"),
    (["--time-scale", "0", "--workload", "w.csv"], "--time-scale"),
    (["--limit", "0", "--workload", "w.csv"], "--limit"),
    (["--eps", "-1", "--policy", "verkv"], "eps"),
]


@pytest.mark.parametrize("argv, word", REPLAY_FLAGS, ids=lambda a: " ".join(a)
                         if isinstance(a, list) else None)
def test_replay_flags(argv, word, tmp_path, capsys):
    _check(["replay", *argv, "--json"], capsys, tmp_path, word)


PLAN = ["plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--context", "1024", "--policy",
        "dense-resident", "--output-len", "8", "--requests", "4", "--jobs", "1", "--json"]
PLAN_FLAGS = [
    (["--slo-tpot-ms", "50@p77"], "--slo-tpot-ms"), (["--slo-tpot-ms", "@p99"], "--slo-tpot-ms"),
    (["--slo-tpot-ms", "abc"], "--slo-tpot-ms"), (["--slo-ttft-ms", "inf"], "--slo-ttft-ms"),
    (["--slo-e2e-s", "-5@p50"], "--slo-e2e-s"), (["--slo-tpot-ms", "50@"], "--slo-tpot-ms"),
    (["--tp", "1,x"], "--tp"), (["--tp", "1,-2"], "--tp"), (["--tp", "1,0"], "tp"),
    (["--replicas", "0"], "--replicas"), (["--batch", "4,-1"], "--batch"),
    (["--batch", "4,1.5"], "--batch"), (["--qps", "1,nan"], "finite"),
    (["--host-gib", "64,inf"], "finite"), (["--kv-dtype", "bf16,int3"], "int3"),
    (["--max-batched-tokens", "2048,-1"], "--max-batched-tokens"),
    (["--seed", "-1"], "--seed"), (["--target-qps", "inf"], "finite"),
    (["--target-qps", "-1"], "target"), (["--slo-requests", "0"], "slo-requests"),
    (["--link-gbps", "inf"], "--link-gbps: must be finite"), (["--jobs", "0"], "--jobs"),
    (["--price", "h100-sxm=nan"], "price"), (["--price", "h100-sxm=inf"], "price"),
]


@pytest.mark.parametrize("argv, word", PLAN_FLAGS, ids=lambda a: " ".join(a)
                         if isinstance(a, list) else None)
def test_plan_flags(argv, word, tmp_path, capsys):
    _check([*PLAN, *argv, "--out", tmp_path / "p"], capsys, tmp_path, word)


# --------------------------------------------------------- engine and policy-profile files
ENGINE = json.loads(BUILTIN["vllm-paper"].read_text())


def _engine(**change):
    out = json.loads(json.dumps(ENGINE))
    out.update({k: v for k, v in change.items() if k != "fields"})
    out["fields"].update(change.get("fields", {}))
    return out


ENGINES = {
    "truncated": (json.dumps(ENGINE)[:200], "not JSON"),
    "empty": ("", "not JSON"),
    "nested 100,000 deep": (_deep(), "nests deeper"),
    "an array": ("[]", "not a kvsim engine"),
    "version 2": (_engine(version=2), "version 2"),
    "version a string": (_engine(version="1"), "version '1'"),
    "no version": ({k: v for k, v in ENGINE.items() if k != "version"}, "version None"),
    "wrong format": (_engine(format="kvsim-trace"), "not a kvsim engine"),
    "NaN overhead": (json.dumps(ENGINE).replace('"fields": {', '"fields": {"step_overhead_ms": '
                                                '{"value": NaN, "source": "fit"}, '), "NaN"),
    "Infinity link": (json.dumps(ENGINE).replace('"fields": {', '"fields": {"link_gbps": '
                                                 '{"value": Infinity, "source": "fit"}, '),
                      "Infinity"),
    "a string overhead": (_engine(fields={"step_overhead_ms": {"value": "1", "source": "fit"}}),
                          "step_overhead_ms"),
    "negative overhead": (_engine(fields={"step_overhead_ms": {"value": -1, "source": "fit"}}),
                          "step_overhead_ms"),
    "efficiency above 1": (_engine(fields={"hbm_efficiency": {"value": 1.5, "source": "fit"}}),
                           "hbm_efficiency"),
    "unknown field": (_engine(fields={"warp_speed": {"value": 1, "source": "fit"}}),
                      "warp_speed"),
    "field without a source": (_engine(fields={"step_overhead_ms": {"value": 1}}), "source"),
    "a field that is a number": (_engine(fields={"step_overhead_ms": 1}), "step_overhead_ms"),
    "decide model negative": (_engine(fields={"decide.verkv": {"value": {
        "per_layer_us": -1, "per_ktoken_us": 0, "per_kfetched_us": 0, "serial_share": 1},
        "source": "fit"}}), "per_layer_us"),
    "good copy": (ENGINE, None),
}


@pytest.mark.parametrize("name", ENGINES)
def test_engine_files(name, tmp_path, capsys):
    content, word = ENGINES[name]
    path = _write(tmp_path / "engine.json", content)
    _check(["replay", "--engine", path, "--policy", "dense-resident", *FAST], capsys, tmp_path,
           word)


PROFILES = {
    "truncated": ('{"format": "' + PROFILE_FORMAT + '", "version": 1, "rows": [[0, 0,',
                  "not JSON"),
    "version 2": ({"format": PROFILE_FORMAT, "version": 2}, "version 2"),
    "wrong format": ({"format": "kvsim-engine", "version": 1}, "not a kvsim policy profile"),
    "NaN": ('{"format": "' + PROFILE_FORMAT + '", "version": 1, "seed": NaN}', "NaN"),
    "nested 100,000 deep": (_deep(), "nests deeper"),
    "an array": ("[]", "not a JSON object"),
    "rows a string": ({"format": PROFILE_FORMAT, "version": 1, "columns": "x", "settings": [],
                       "captures": [], "rows": "x"}, "columns"),
}


@pytest.mark.parametrize("name", PROFILES)
def test_policy_profile_files(name, tmp_path, capsys):
    replay_profile(*PROFILES[name], tmp_path, capsys)


def replay_profile(content, word, tmp_path, capsys):
    """Replay VerKV with the policy profile ``content``: refused with ``word``."""
    path = _write(tmp_path / "profile.json", content)
    _check(["replay", "--policy-profile", path, "--policy", "verkv", "--sink", "4", "--local",
            "4", "--compression", "16", *FAST], capsys, tmp_path, word)


# -------------------------------------------------------------------------- kvsim fit CSVs
FIT_HEAD = "gpu,model,policy,context,batch,tpot_ms,kv_read_frac,tp\n"
FIT_ROW = ["h100-sxm", "qwen3-4b", "dense-resident", "32768", "1", "5.8", "", ""]
FIT_CELLS = [("batch", "1e12", "beyond"), ("batch", "0", "batch"), ("batch", "1.5", "batch"),
             ("batch", "-4", "batch"), ("batch", "abc", "batch"),
             ("context", "1e30", "beyond"), ("context", "nan", "context"),
             ("tpot_ms", "nan", "finite"), ("tpot_ms", "inf", "finite"),
             ("tpot_ms", "-1", "tpot_ms must be a number in"), ("tpot_ms", "fast", "tpot_ms"),
             ("kv_read_frac", "2", "share"), ("kv_read_frac", "nan", "finite"),
             ("tp", "0", "tp"), ("tp", "1e9", "tp"), ("gpu", "h900", "h900"),
             ("policy", "magic", "magic"), ("model", "", "model is empty")]
FIT_FILES = {
    "empty": (b"", "no measured points"),
    "header only": (FIT_HEAD.encode(), "no measured points"),
    "no batch column": (b"gpu,model,policy,context,tpot_ms\nh100-sxm,qwen3-4b,dense-resident,"
                        b"1024,5\n", "missing column"),
    "gzip": (gzip.compress((FIT_HEAD + ",".join(FIT_ROW) + "\n").encode()), "not a readable"),
    "ragged row": ((FIT_HEAD + ",".join(FIT_ROW) + ",extra\n").encode(), "more cells"),
    "huge cell": ((FIT_HEAD + ",".join(FIT_ROW[:5]) + "," + "9" * 200_000 + ",,\n").encode(),
                  "readable"),
}


def _fit(tmp_path, capsys, text, word):
    path = _write(tmp_path / "points.csv", text)
    _check(["fit", path, "--out", tmp_path / "engine.json"], capsys, tmp_path, word)
    assert not (tmp_path / "engine.json").exists()


@pytest.mark.parametrize("col, value, word", FIT_CELLS)
def test_fit_cells(col, value, word, tmp_path, capsys):
    row = dict(zip(FIT_HEAD.strip().split(","), FIT_ROW)) | {col: value}
    _fit(tmp_path, capsys, FIT_HEAD + ",".join(row.values()) + "\n", word)


@pytest.mark.parametrize("name", FIT_FILES)
def test_fit_files(name, tmp_path, capsys):
    _fit(tmp_path, capsys, *FIT_FILES[name])


@pytest.mark.parametrize("argv, word", [
    (["--fix", "step_overhead_ms=inf"], "finite"), (["--fix", "step_overhead_ms=abc"], "--fix"),
    (["--fix", "step_overhead_ms"], "NAME=NUMBER"), (["--base", "deep.json"], "nests deeper"),
    (["--base", "nan.json"], "NaN"), (["--base", "."], "is a directory")])
def test_fit_flags(argv, word, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "deep.json", _deep())
    _write(tmp_path / "nan.json", json.dumps(ENGINE).replace('"version": 1', '"version": NaN'))
    _write(tmp_path / "points.csv", FIT_HEAD + ",".join(FIT_ROW) + "\n")
    _check(["fit", "points.csv", "--out", "engine.json", *argv], capsys, tmp_path, word)
    assert not (tmp_path / "engine.json").exists()


def test_fit_csv_with_a_bom_and_crlf_reads_its_header(tmp_path):
    from kvsim.fit import read_points
    path = _write(tmp_path / "p.csv", ("\ufeff" + FIT_HEAD + ",".join(FIT_ROW) + "\n")
                  .replace("\n", "\r\n"))
    (p,) = read_points(path)
    assert (p.gpu, p.batch, p.measured["tpot_ms"]) == ("h100-sxm", 1, 5.8)


# -------------------------------------------------------------------- interrupted plans
@pytest.fixture(scope="module")
def done_plan(tmp_path_factory):
    """A finished plan over a model config, a workload and an engine file, to damage copies
    of."""
    root = tmp_path_factory.mktemp("plan")
    _inputs(root)
    with contextlib.chdir(root):
        assert main(_plan_argv()) == 0
    return root


def _inputs(root: Path) -> None:
    _write(root / "config.json", GOOD_CONFIG)
    _write(root / "w.csv", "arrival,prompt,output\n0,512,4\n0.1,512,4\n0.2,256,4\n")
    _write(root / "engine.json", ENGINE)


def _plan_argv(*extra) -> list[str]:
    """The plan, its paths relative to the folder it runs in (a copy of the folder resumes)."""
    return [*PLAN[:4], "config.json", "--workload", "w.csv", "--engine", "engine.json",
            *PLAN[7:], "--out", "out", *extra]


def _copy_of(done: Path, tmp_path: Path, monkeypatch) -> Path:
    import shutil
    shutil.copytree(done, tmp_path / "c", symlinks=True)
    monkeypatch.chdir(tmp_path / "c")
    return tmp_path / "c"


def _journal(root: Path, *lines: bytes) -> None:
    results = root / "out" / "results.csv"
    import pandas as pd
    rows = pd.read_csv(results).to_dict("records")
    results.unlink()
    good = json.dumps(rows).encode()
    (root / "out" / ".kvsim-plan-journal.jsonl").write_bytes(
        b"\n".join(good if x == b"GOOD" else x for x in lines))


PLAN_DAMAGE = {  # name -> (what is done to a finished plan's copy, keyword; None: resumes)
    "journal line garbage": (lambda r: _journal(r, b"GOOD", b"@@garbage", b"GOOD\n"), "damaged"),
    "journal line an object": (lambda r: _journal(r, b'{"key": 1}', b"GOOD\n"), "damaged"),
    "journal line of numbers": (lambda r: _journal(r, b"[1, 2]", b"GOOD\n"), "damaged"),
    "journal line Infinity": (lambda r: _journal(r, b'[{"key": "k", "x": Infinity}]',
                                                 b"GOOD\n"), "damaged"),
    "journal line 100,000 deep": (lambda r: _journal(r, _deep().encode(), b"GOOD\n"),
                                  "damaged"),
    "journal torn last line (kill -9)": (lambda r: _journal(r, b"GOOD", b'[{"key": "x", "st'),
                                         None),
    "journal a directory": (lambda r: _journal(r, b"") or
                            (r / "out" / ".kvsim-plan-journal.jsonl").unlink() or
                            (r / "out" / ".kvsim-plan-journal.jsonl").mkdir(), "is a directory"),
    "manifest NaN": (lambda r: _write(r / "out" / ".kvsim-plan-manifest.json",
                                      '{"files": [], "plan": NaN}'), "NaN"),
    "manifest an array": (lambda r: _write(r / "out" / ".kvsim-plan-manifest.json", "[]"),
                          "not a JSON object"),
    "manifest files a string": (lambda r: _write(r / "out" / ".kvsim-plan-manifest.json",
                                                 {"files": "x", "plan": {}}), "damaged"),
    "manifest truncated": (lambda r: _write(r / "out" / ".kvsim-plan-manifest.json", '{"fi'),
                           "not JSON"),
    "config edited": (lambda r: _write(r / "config.json", GOOD_CONFIG | {"num_hidden_layers": 8}),
                      "changed since"),
    "workload edited": (lambda r: _write(r / "w.csv", "arrival,prompt,output\n0,999,4\n"),
                        "changed since"),
    "engine edited": (lambda r: _write(r / "engine.json", _engine(description="edited")),
                      "changed since"),
    "nothing changed": (lambda r: None, None),
}


@pytest.mark.parametrize("name", PLAN_DAMAGE)
def test_interrupted_plans(name, done_plan, tmp_path, capsys, monkeypatch):
    root = _copy_of(done_plan, tmp_path, monkeypatch)
    damage, word = PLAN_DAMAGE[name]
    damage(root)
    _check(_plan_argv(), capsys, root, word, root / "out")


def test_a_different_sweep_into_the_same_directory_is_refused(done_plan, tmp_path, capsys,
                                                               monkeypatch):
    root = _copy_of(done_plan, tmp_path, monkeypatch)
    _check(_plan_argv("--seed", "7"), capsys, root, "holds a different plan")


def test_an_edited_input_reruns_with_force(done_plan, tmp_path, capsys, monkeypatch):
    root = _copy_of(done_plan, tmp_path, monkeypatch)
    _write(root / "w.csv", "arrival,prompt,output\n0,999,4\n")
    assert main(_plan_argv("--force")) == 0
    assert main(_plan_argv()) == 0  # the new contents are recorded: it resumes


def test_two_plans_at_once_in_one_directory(done_plan, tmp_path, capsys, monkeypatch):
    from kvsim.plan.outputs import only_plan
    root = _copy_of(done_plan, tmp_path, monkeypatch)
    with only_plan(root / "out"):
        _check(_plan_argv("--batch", "2"), capsys, root, "another kvsim plan")


@pytest.mark.parametrize("fail, word", [
    ("fsync", "no space left"), ("mkstemp", "read-only file system"), ("mkdir", "read-only")])
def test_a_full_or_read_only_disk(fail, word, tmp_path, capsys, monkeypatch):
    """Every write fails: one line, and nothing partial left behind."""
    _inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    code = errno.ENOSPC if fail == "fsync" else errno.EROFS

    def refuse(*a, **k):
        raise OSError(code, os.strerror(code))
    target = {"fsync": (os, "fsync"), "mkstemp": (tempfile, "mkstemp"),
              "mkdir": (Path, "mkdir")}[fail]
    monkeypatch.setattr(*target, refuse)
    _check(_plan_argv(), capsys, tmp_path, word)


def test_a_lost_worker_is_one_line(tmp_path):
    from types import SimpleNamespace

    from kvsim.errors import KvsimError
    from kvsim.plan.executors import RayExecutor, run_all

    class WorkerCrashedError(Exception):
        pass
    errors = SimpleNamespace(**{n: type(n, (Exception,), {}) for n in (
        "NodeDiedError", "ObjectLostError", "OwnerDiedError", "LocalRayletDiedError",
        "RaySystemError")}, WorkerCrashedError=WorkerCrashedError)

    def get(ref):
        raise WorkerCrashedError("the worker died")
    ex = object.__new__(RayExecutor)
    ex.ray = SimpleNamespace(exceptions=errors, get=get,
                             remote=lambda f: SimpleNamespace(remote=lambda *a: 1),
                             wait=lambda refs, num_returns, timeout=None: (refs[:1], refs[1:]))
    with pytest.raises(KvsimError, match="Ray worker was lost.*resume"):
        run_all(ex, abs, [1], progress=False)


def test_a_killed_worker_process_is_one_line():
    from kvsim.errors import KvsimError
    from kvsim.plan.executors import LocalExecutor, run_all
    with pytest.raises(KvsimError, match="worker process died.*resume"):
        run_all(LocalExecutor(2), os._exit, [9, 9], progress=False)  # the worker dies at once
