"""The trace format: round trips, validation of every section, atomic writes, no overwrites."""

import json
import zipfile

import numpy as np
import pytest
from conftest import tiny_attention, tiny_hardware

from kvsim import trace as T
from kvsim.errors import KvsimError


def full_trace():
    return T.Trace(T.new_meta("tests", model="m", context=56), tiny_hardware(), tiny_attention())


def test_round_trip_keeps_every_array_and_meta(tmp_path):
    tr = full_trace()
    T.save(tr, tmp_path / "a.npz")
    back = T.load(tmp_path / "a.npz")
    assert back.meta["schema_version"] == T.SCHEMA_VERSION and back.meta["model"] == "m"
    for a, b in zip(tr.attention.layers, back.attention.layers):
        assert a.layer == b.layer
        np.testing.assert_array_equal(a.k, b.k)
        np.testing.assert_array_equal(a.q_decode, b.q_decode)
        np.testing.assert_array_equal(a.scores["kvzip"], b.scores["kvzip"])
    assert back.attention.context_len == 56 and back.attention.rope["theta"] == 1e4
    np.testing.assert_array_equal(back.hardware.tables["link_h2d_pinned"]["seconds"],
                                  tr.hardware.tables["link_h2d_pinned"]["seconds"])
    assert back.hardware.missing == ["nvml.power"] and back.hardware.extra["flops"] == 6e14


def test_refuses_to_overwrite_without_force(tmp_path):
    p = tmp_path / "a.npz"
    p.write_bytes(b"precious")
    with pytest.raises(KvsimError, match="exists"):
        T.save(full_trace(), p)
    assert p.read_bytes() == b"precious"
    T.save(full_trace(), p, force=True)
    assert T.load(p).attention is not None
    assert [x.name for x in tmp_path.iterdir()] == ["a.npz"]  # no temporary file left


def test_invalid_trace_is_not_written(tmp_path):
    tr = full_trace()
    tr.attention.layers[0].v = tr.attention.layers[0].v[:, :10]
    with pytest.raises(KvsimError, match="v has shape"):
        T.save(tr, tmp_path / "bad.npz")
    assert not list(tmp_path.iterdir())


def _rewrite(src, dst, edit):
    with np.load(src) as z:
        arrays = {k: z[k] for k in z.files}
    edit(arrays)
    np.savez(dst, **arrays)


@pytest.mark.parametrize("edit, message", [
    (lambda a: a.update(meta=np.array(json.dumps({**json.loads(str(a["meta"])),
                                                  "schema_version": 99}))), "schema version 99"),
    (lambda a: a.update(meta=np.array('{"format": "other"}')), "not a kvsim trace"),
    (lambda a: a.pop("meta"), "no 'meta'"),
    (lambda a: a["attn/L0/k"].__setitem__((0, 0, 0), np.nan), "NaN or Inf"),
    (lambda a: a.update({"attn/L3/q_decode": a["attn/L3/q_decode"][:, :, :8]}), "head dim"),
    (lambda a: a.update({"attn/L0/k": a["attn/L0/k"].astype(np.int32)}), "dtype"),
    (lambda a: a.pop("attn/L3/v"), "missing array"),
    (lambda a: a.update({"hw/link_h2d_pinned/seconds": np.array([1.0, np.inf, 1, 1, 1])}),
     "NaN or Inf"),
    (lambda a: a.update({"hw/link_h2d_pinned/bytes": np.arange(3)}), "different lengths"),
    (lambda a: a.update({"attn/decode_pos": np.array([62, 640])}), "positions outside"),
])
def test_load_rejects_bad_content_with_one_line(tmp_path, edit, message):
    good = tmp_path / "good.npz"
    T.save(full_trace(), good)
    bad = tmp_path / "bad.npz"
    _rewrite(good, bad, edit)
    with pytest.raises(KvsimError, match=message) as e:
        T.load(bad)
    assert "\n" not in str(e.value) and str(bad) in str(e.value)


def test_truncated_and_foreign_files(tmp_path):
    good = tmp_path / "good.npz"
    T.save(full_trace(), good)
    cut = tmp_path / "cut.npz"
    cut.write_bytes(good.read_bytes()[:200])
    with pytest.raises(KvsimError, match="not a readable"):
        T.load(cut)
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, x=np.zeros(3))
    with pytest.raises(KvsimError, match="no 'meta'"):
        T.load(foreign)
    text = tmp_path / "t.npz"
    text.write_text("hello")
    with pytest.raises(KvsimError):
        T.load(text)
    with pytest.raises(KvsimError, match="no such"):
        T.load(tmp_path / "missing.npz")
    with zipfile.ZipFile(tmp_path / "z.npz", "w") as z:
        z.writestr("meta.npy", b"garbage")
    with pytest.raises(KvsimError):
        T.load(tmp_path / "z.npz")


def test_save_checks_destination(tmp_path):
    with pytest.raises(KvsimError, match="does not exist"):
        T.save(full_trace(), tmp_path / "no" / "a.npz")
    with pytest.raises(KvsimError, match=".npz"):
        T.save(full_trace(), tmp_path / "a.txt")


def test_unsafe_npz_inputs_are_one_line_before_any_read(tmp_path):
    """A FIFO (would block), a directory, a member that is not .npy, and an .npy header that
    declares 1e12 tokens (a 358 TiB allocation) are refused without reading the data."""
    import io
    import os
    import zipfile

    from kvsim.errors import KvsimError
    from kvsim.io import read_npz
    fifo = tmp_path / "fifo.npz"
    os.mkfifo(fifo)
    odd = tmp_path / "odd.npz"
    with zipfile.ZipFile(odd, "w") as z:
        z.writestr("notes.txt", b"hello")
    huge = tmp_path / "huge.npz"
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f2", "fortran_order": False,
                                               "shape": (3, 10**12, 64)})
    with zipfile.ZipFile(huge, "w") as z:
        z.writestr("attn/L0/k.npy", buf.getvalue())
    for path, msg in ((fifo, "not a regular file"), (tmp_path, "a directory"),
                      (odd, "is not an .npy array"), (huge, "beyond what kvsim reads")):
        with pytest.raises(KvsimError, match=msg):
            read_npz(path, "trace", "kvsim-trace")
