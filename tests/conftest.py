import contextlib
import io
import sys
import traceback

import numpy as np
import pytest

from kvsim import trace as T


def tiny_attention(n=64, n_kv=2, n_q=4, d=16, seed=0) -> T.Attention:
    rng = np.random.default_rng(seed)
    f16 = lambda *s: rng.standard_normal(s).astype(np.float16)  # noqa: E731
    layers = [T.LayerAttention(l, f16(n_kv, n, d), f16(n_kv, n, d), f16(n_q, 4, d),
                               f16(n_q, 2, d), {"kvzip": rng.random((n_kv, n)).astype(np.float32)})
              for l in (0, 3)]
    return T.Attention(layers, n - 8, np.arange(n - 8, n - 4), np.arange(n - 2, n),
                       {"theta": 1e4, "type": "default"}, "random test tensors")


def verkv_layer(options: dict, **shape):
    """One synthetic layer (``kvsim.model.synthetic``, float32 tensors) compressed by VerKV with
    ``options``: (policy, state, attention, k, v, question queries, decode queries, question
    positions, decode positions)."""
    import torch

    from kvsim.model.synthetic import synthetic_attention_trace
    from kvsim.policies import make
    tr = synthetic_attention_trace(n_layers=1, kvzip=False, **shape)
    la, a = tr.attention.layers[0], tr.attention
    k, v, qq, qd = (torch.as_tensor(x).to(torch.float32)
                    for x in (la.k, la.v, la.q_question, la.q_decode))
    n = a.context_len
    pol = make("verkv", {"sink": 4, "local": 4, "scorer": "snapkv", **options})
    pol.bind(a.rope, a.head_dim)
    qpos, dpos = torch.as_tensor(a.question_pos), torch.as_tensor(a.decode_pos)
    state = pol.compress(k[:, :n], v[:, :n], {}, qq, qpos, torch.Generator().manual_seed(0),
                         layer=0, obs_k=k[:, n:]).state
    return pol, state, a, k, v, qq, qd, qpos, dpos


def tiny_hardware() -> T.Hardware:
    sizes = np.array([4096, 65536, 1 << 20, 16 << 20, 256 << 20], dtype=np.int64)
    link = {"bytes": sizes, "seconds": 5e-6 + sizes / 50e9}
    tokens = np.array([1024, 8192, 65536, 131072])
    return T.Hardware(
        device={"name": "FakeGPU", "kind": "cuda"},
        tables={"link_h2d_pinned": link, "link_d2h_pinned": dict(link),
                "kernel_decode_attn": {"tokens": tokens, "seconds": 4e-6 + tokens * 4096 / 2.5e12}},
        units={"link_h2d_pinned": {"bytes": "B", "seconds": "s"}},
        provenance="fake table written by tests", missing=["nvml.power"],
        extra={"hbm_bytes": 80 * 1024**3, "hbm_bw": 2.8e12, "flops": 6e14})


@pytest.fixture
def attn_trace(tmp_path):
    path = tmp_path / "attn.npz"
    T.save(T.Trace(T.new_meta("tests", model="random", context=56), None, tiny_attention()), path)
    return path


@pytest.fixture
def hw_trace(tmp_path):
    path = tmp_path / "hw.npz"
    T.save(T.Trace(T.new_meta("tests"), tiny_hardware(), None), path)
    return path


def run_cli(*args):
    """Run ``kvsim ARGS`` in this process (a subprocess would only add an interpreter and its
    imports); return (exit status, stdout, stderr). An uncaught exception is status 1 with its
    traceback on stderr, as from the command line."""
    from kvsim.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
        except Exception:
            traceback.print_exc()
            code = 1
    return code, out.getvalue(), err.getvalue()


RUN_OPTIONS = ("timeline", "timeline_steps", "force", "jobs")


def replay_json(**kw) -> dict:
    """``kvsim replay --json``'s report of the configuration ``kw`` names (configure's keyword
    names; ``timeline``, ``timeline_steps``, ``force`` and ``jobs`` go to run_replay)."""
    from kvsim.replay import configure, run_replay
    run = {k: kw.pop(k) for k in RUN_OPTIONS if k in kw}
    return run_replay(configure(**kw), **run).to_json()
