"""A generated corpus of bad inputs (traces, flags, workloads, profiles): each gets exit
status 2 and one line on stderr, never a traceback, a hang or a silent pass. Built from the tiny
test trace at run time; nothing is stored."""

import json
import os
import zipfile

import numpy as np
import pytest
from conftest import tiny_attention

from kvsim import trace as T
from kvsim.cli import main


def _arrays(tmp_path):
    p = tmp_path / "base.npz"
    T.save(T.Trace(T.new_meta("tests", model="random", context=56), None, tiny_attention()), p)
    with np.load(p) as z:
        arrays = {k: z[k] for k in z.files}
    return json.loads(str(arrays.pop("meta"))), arrays


def _write(path, meta, arrays):
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)
    return path


def _mutate(kind):
    """(meta, arrays) -> None, changing them in place."""
    def heads(meta, arrays, n_kv=0, d=None):
        for l in meta["attention"]["layers"]:
            for x in ("k", "v"):
                a = arrays[f"attn/L{l}/{x}"]
                arrays[f"attn/L{l}/{x}"] = a[:n_kv] if d is None else a[..., :d]
            if d is not None:
                for x in ("q_question", "q_decode"):
                    arrays[f"attn/L{l}/{x}"] = arrays[f"attn/L{l}/{x}"][..., :d]

    def no_rows(meta, arrays):
        arrays["attn/question_pos"] = arrays["attn/question_pos"][:0]
        arrays["attn/decode_pos"] = arrays["attn/decode_pos"][:0]
        for l in meta["attention"]["layers"]:
            for x in ("q_question", "q_decode"):
                arrays[f"attn/L{l}/{x}"] = arrays[f"attn/L{l}/{x}"][:, :0]

    def huge(meta, arrays):
        for l in meta["attention"]["layers"]:
            arrays[f"attn/L{l}/k"] = arrays[f"attn/L{l}/k"].astype(np.float64) * 1e300

    def set_attn(key, value):
        return lambda meta, arrays: meta["attention"].__setitem__(key, value)

    return {
        "zero KV heads": lambda m, a: heads(m, a, 0),
        "zero head dim": lambda m, a: heads(m, a, 2, d=0),
        "context_len string": set_attn("context_len", "56"),
        "context_len fraction": set_attn("context_len", 55.5),
        "scores null": set_attn("scores", None),
        "layers as a string": set_attn("layers", "0"),
        "layers duplicated": set_attn("layers", [0, 0]),
        "rope a string": set_attn("rope", "default"),
        "no query rows": no_rows,
        "keys of 1e300": huge,
        "hardware spec a string": lambda m, a: m.update(hardware={
            "device": {"name": "x"}, "tables": {"link": "bytes,seconds"}}),
    }[kind]


KINDS = ["zero KV heads", "zero head dim", "context_len string", "context_len fraction",
         "scores null", "layers as a string", "layers duplicated", "rope a string",
         "no query rows", "keys of 1e300", "hardware spec a string"]


def _one_line_exit_2(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (argv, err)
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_traces_are_one_line(kind, tmp_path, capsys):
    meta, arrays = _arrays(tmp_path)
    _mutate(kind)(meta, arrays)
    path = _write(tmp_path / "bad.npz", meta, arrays)
    _one_line_exit_2(["replay", str(path), "--policy", "verkv", "--sink", "1", "--local", "1",
                      "--compression", "4", "--json"], capsys)


def test_files_that_are_not_traces_are_one_line(tmp_path, capsys):
    fifo = tmp_path / "fifo.npz"
    os.mkfifo(fifo)
    loop = tmp_path / "loop.npz"
    loop.symlink_to(loop)
    member = tmp_path / "member.npz"
    with zipfile.ZipFile(member, "w") as z:
        z.writestr("meta.npy", b"\x93NUMPY junk")
        z.writestr("readme.txt", b"not an array")
    for path in (fifo, loop, member, tmp_path):
        _one_line_exit_2(["replay", str(path), "--policy", "dense-offload", "--json"], capsys)


@pytest.mark.parametrize("argv", [
    ["replay", "--qps", "nan"], ["replay", "--host-gib", "nan"], ["replay", "--requests", "0"],
    ["replay", "--concurrency", "0"], ["replay", "--gpu", ""], ["replay", "--batch", "1000000000"],
    ["replay", "--requests", "1000000000"], ["replay", "--policy", "verkv:sketch=3bit"],
    ["replay", "--policy", "verkv", "--eps", "-1"], ["replay", "--context", "-1"],
    ["plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--context", "4096", "--policy",
     "dense", "--out", "/nonexistent/dir/p"],
    ["policy-profile", "--show", "/nonexistent.json", "--policy", "verkv"],
    ["replay", "--policy", "verkv", "--sink", "4", "--local", "4", "--context", "999999"],
])
def test_bad_flags_are_one_line(argv, capsys):
    _one_line_exit_2(argv, capsys)


@pytest.mark.parametrize("text, msg", [
    ("arrival,prompt,output\n0,100.7,10\n", "not a whole number"),
    ("arrival,prompt,prompt,output\n0,100,100,10\n", "more than once"),
])
def test_bad_workload_rows_are_one_line(text, msg, tmp_path, capsys):
    p = tmp_path / "w.csv"
    p.write_text(text)
    line = _one_line_exit_2(["replay", "--policy", "dense-offload", "--workload", str(p),
                             "--json"], capsys)
    assert msg in line, line


@pytest.mark.parametrize("edit, msg", [
    (lambda m, a: m.update(version=99), "version 99"),
    (lambda m, a: a.update({k: v.astype(np.complex64) for k, v in a.items() if "basis" in k}),
     "real floats"),
    (lambda m, a: a.update({k: np.zeros_like(v) for k, v in a.items() if "basis" in k}),
     "all-zero"),
    (lambda m, a: m.update(R=0), "0 < R <= D"),
])
def test_bad_varrate_bases_are_one_line(edit, msg, tmp_path):
    from kvsim.errors import KvsimError
    from kvsim.policies.varrate import calibrate
    from kvsim.replay import DEFAULT_TRACE
    shipped = DEFAULT_TRACE.parent / "smollm2-varrate-basis.npz"
    with np.load(shipped) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta")))
    edit(meta, arrays)
    path = _write(tmp_path / "basis.npz", meta, arrays)
    with pytest.raises(KvsimError, match=msg):
        calibrate.load(path)


@pytest.mark.parametrize("flag", [["--window", "-1"], ["--anchors-c", "0"], ["--stride", "0"]])
def test_calibrate_refuses_what_replay_would_refuse_before_any_work(flag, tmp_path, capsys):
    _one_line_exit_2(["calibrate", "--traces", "nothing.npz", "--out", str(tmp_path / "b.npz"),
                      *flag], capsys)
