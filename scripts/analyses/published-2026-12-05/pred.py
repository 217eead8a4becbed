"""Helpers: predictions of published rows under the built-in (full-fit) engines, and what-ifs."""
import sys, json, math, contextlib
sys.path.insert(0, '.')
import numpy as np
from kvsim.fit import read_points, Predictor
from kvsim.hw.engine import load
from kvsim.hw import catalog
PTS = {p.row: p for p in read_points('data/published.csv')}
PRED = Predictor(None)
ENG = {f: load(f) for f in ('vllm', 'sglang', 'trtllm')}
def eng_for(p):
    return ENG.get(p.engine, ENG['trtllm'])  # other engines: trtllm's shared parts are the same
def predict(row, eng=None, **over):
    p = PTS[row]
    e = eng or eng_for(p)
    if over:
        e = e.with_fields('override', **over)
    return PRED.predict(p, e)

@contextlib.contextmanager
def collapsed_routing():
    """Every sequence of the batch routes like the first (identical prompts, greedy decoding): an
    MoE layer reads the k experts one token picks, whatever the batch, and each gets every token."""
    from kvsim.hw import costs as C
    orig_lwb = catalog.ModelSpec.layer_weight_bytes
    orig_init = C.Matmuls.__init__
    def lwb(self, tokens=None):
        if not self.experts or tokens is None:
            return orig_lwb(self, tokens)
        t = np.asarray(tokens, float)
        return np.where(t > 0, orig_lwb(self, np.minimum(t, 1.0)), 0.0)
    def init(self, *a, **k):
        orig_init(self, *a, **k)
        if self.per_expert:
            self.per_expert = 1.0
    catalog.ModelSpec.layer_weight_bytes = lwb
    C.Matmuls.__init__ = init
    try:
        yield
    finally:
        catalog.ModelSpec.layer_weight_bytes = orig_lwb
        C.Matmuls.__init__ = orig_init

@contextlib.contextmanager
def moe_fp8_at_bf16_rate():
    """fp8-weight MoE models: every matmul at the bf16 rate (weight-only fp8), bytes still fp8."""
    from kvsim.hw import costs as C
    orig = C.CostModel.gemm_flops
    def gf(self, m):
        if m.experts and m.weight_elem == 1:
            return self.flops
        return orig(self, m)
    C.CostModel.gemm_flops = gf
    try:
        yield
    finally:
        C.CostModel.gemm_flops = orig
