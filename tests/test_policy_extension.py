"""Room for the next policy: the worked examples of docs/howto/add-policy.md (tests/examples/: an
H2O scored mask policy on ScoredPolicy.score, an InfLLM-style block-retrieval fetching policy on
BlockFetchPolicy), registered here for the tests only, held to the same contract checks as every
registered policy (tests/test_policy_contract.py's), checked against brute-force readings of
their definitions, and the decide bench of a block policy planned through the shared layout."""

from __future__ import annotations

import ast
import importlib
import inspect
import math

import pytest
import torch
from examples import h2o, infllm

from kvsim.contract import HeadShape
from kvsim.measure import traffic
from kvsim.model.synthetic import synthetic_attention_trace
from kvsim.policies import load_all, make, registry
from kvsim.policies.base import DecideKernel, DecideStep, FetchPolicy, MaskPolicy
from kvsim.policies.bench_requests import CompactBench
from kvsim.policies.blocks import BlockBench, BlockFetchPolicy
from kvsim.policies.scored import ScoredPolicy

EXAMPLES = {"h2o": h2o.H2O, "infllm": infllm.InfLLM}
F64 = torch.float64


@pytest.fixture
def examples(monkeypatch):
    """The examples registered by name for one test, as ``@register`` would ship them."""
    load_all()
    for name, cls in EXAMPLES.items():
        monkeypatch.setitem(registry.REGISTRY, name, cls)
    from kvsim.measure import harness
    monkeypatch.setattr(harness, "TIMING_REPEATS", 1)
    return EXAMPLES


@pytest.fixture(scope="module")
def traces():
    """The contract's two synthetic traces (tests/test_policy_contract.py's fixtures)."""
    kw = dict(n_layers=2, n_q=4, n_kv=2, d=32, question=8, decode=3, seed=0)
    return (synthetic_attention_trace(context=512, **kw),
            synthetic_attention_trace(context=1024, **kw))


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_example_keeps_the_contract_of_every_registered_policy(name, examples, traces,
                                                                   tmp_path):
    """analyze on a synthetic trace (shares in [0, 1], the harness's read verification, the
    same seed the same result), the cost at two context lengths and at two head sizes, replay."""
    contract = importlib.import_module("test_policy_contract")
    trace, long_trace = traces
    contract.test_every_registered_policy_keeps_the_contract(name, trace)
    contract.test_the_cost_from_one_length_charges_what_the_policy_holds_at_another(
        name, trace, long_trace)
    contract.test_every_policy_states_its_cost_for_the_model_it_serves(name, trace)
    contract.test_every_policy_replays_and_its_report_flattens_without_loss(name, tmp_path, trace)
    contract.test_every_policy_is_a_mask_or_a_fetching_policy()
    assert ("infllm" in registry.deciding()) and "h2o" not in registry.deciding()


@pytest.mark.parametrize("name,base", [("h2o", ScoredPolicy), ("infllm", BlockFetchPolicy)])
def test_each_example_is_one_short_file_on_its_base(name, base):
    """Each is one class on the base that fits it, overriding only that base's hooks."""
    cls = EXAMPLES[name]
    assert issubclass(cls, base) and cls.__module__ == f"examples.{name}"
    code = set()  # the lines of its statements, a compound one's header only, no docstring
    for node in ast.walk(ast.parse(inspect.getsource(inspect.getmodule(cls)))):
        if isinstance(node, ast.stmt) and not (isinstance(node, ast.Expr) and
                                               isinstance(node.value, ast.Constant)):
            end = node.body[0].lineno - 1 if hasattr(node, "body") else node.end_lineno
            code |= set(range(node.lineno, end + 1))
    assert len(code) <= 50, len(code)
    own = {n for n, v in vars(cls).items() if inspect.isfunction(v)}
    assert own <= {"score", "prefill_work", "index", "block_bytes", "select"}, own


# -------------------------------------------------------------------------------------- H2O

def _layer(seed, n_kv=2, g=3, n=96, d=16, after=4, rows=6):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n_kv, n + after, d, generator=gen, dtype=F64)
    v = torch.randn(n_kv, n + after, d, generator=gen, dtype=F64)
    q = torch.randn(n_kv * g, rows, d, generator=gen, dtype=F64)
    return k, v, q, n


@pytest.mark.parametrize("seed", range(3))
def test_h2o_keeps_sink_local_and_the_heaviest_hitters_of_the_window(seed, examples):
    k, v, q, n = _layer(seed, after=6)
    pol = make("h2o", {"compression": 4.0, "sink": 2, "local": 3})
    obs_pos = torch.arange(n, n + q.shape[1])  # question rows after the context
    c = pol.compress(k[:, :n], v[:, :n], {}, q, obs_pos, torch.Generator(), layer=0,
                     obs_k=k[:, n:])
    n_kv, g, d = k.shape[0], q.shape[0] // k.shape[0], k.shape[2]
    for h in range(n_kv):
        heavy = torch.zeros(n, dtype=F64)  # attention accumulated over rows and query heads
        for j in range(g):
            for r, pos in enumerate(obs_pos.tolist()):
                w = torch.softmax(k[h, :pos + 1] @ q[h * g + j, r] / math.sqrt(d), 0)
                heavy += w[:n]
        heavy[:2] = heavy[n - 3:] = float("inf")
        want = torch.zeros(n, dtype=torch.bool)
        want[heavy.topk(n // 4).indices] = True
        assert torch.equal(c.resident[h], want)
    out, _ = traffic.attend(pol, c, q[:, :1], obs_pos[:1], k, v, verify=True)
    assert out.shape == (q.shape[0], 1, d)


def test_the_default_score_is_the_named_scorer_and_topk_keeps_the_best_scored():
    from kvsim.policies.scorers import context_scores
    k, v, q, n = _layer(5)
    pos = torch.arange(n, n + q.shape[1])
    for name in ("topk", "poissoncomp"):
        pol = make(name, {"compression": 4.0, "sink": 2, "local": 3, "scorer": "oracle"})
        oracle = {"oracle": torch.rand(k.shape[0], n, generator=torch.Generator().manual_seed(1),
                                       dtype=F64)}
        assert torch.equal(pol.score(k[:, :n], oracle, q, pos),
                           context_scores("oracle", oracle, k[:, :n], q, pos))
    top = make("topk", {"compression": 4.0, "sink": 2, "local": 3, "scorer": "oracle"})
    kept = top.compress(k[:, :n], v[:, :n], oracle, q, pos, torch.Generator(), 0).resident
    best = oracle["oracle"].clone()
    best[:, :2] = best[:, n - 3:] = float("inf")
    assert torch.equal(kept.sum(-1), torch.full((k.shape[0],), n // 4))
    assert all(kept[h, best[h].topk(n // 4).indices].all() for h in range(k.shape[0]))


# ----------------------------------------------------------------------------------- InfLLM

@pytest.mark.parametrize("seed", range(3))
def test_infllm_reads_the_blocks_whose_representatives_score_best(seed, examples):
    k, v, q, n = _layer(seed, n=77, rows=2)  # a partial last block
    block, reps, budget, sink, local = 8, 3, 24, 2, 3
    pol = make("infllm", {"block_size": block, "representatives": reps, "token_budget": budget,
                          "sink": sink, "local": local})
    c = pol.compress(k[:, :n], v[:, :n], {}, None, None, None, layer=0)
    pos = torch.tensor([n, n + 2])
    out, stats = traffic.attend(pol, c, q, pos, k, v, verify=True)
    n_kv, g, d = k.shape[0], q.shape[0] // k.shape[0], k.shape[2]
    blocks = math.ceil(n / block)
    for h in range(n_kv):
        rep = []
        for b in range(blocks):
            keys = k[h, [min(i, n - 1) for i in range(b * block, b * block + block)]]
            near = sorted(range(block), key=lambda i: -float(keys[i] @ keys.mean(0)))[:reps]
            rep.append(keys[near])
        for r in range(2):
            score = [sum(float((rep[b] @ q[h * g + j, r]).sum()) for j in range(g))
                     for b in range(blocks)]
            chosen = sorted(range(blocks), key=lambda b: -score[b])[:budget // block]
            keep = torch.zeros(n, dtype=torch.bool)
            for b in chosen:
                keep[b * block:b * block + block] = True
            keep[:sink] = keep[n - local:] = True
            assert float(stats["fetched_tokens"][h * g, r]) == float((keep & ~c.resident[h])
                                                                     .sum())
            for j in range(g):
                idx = torch.cat([keep.nonzero().flatten(), torch.arange(n, int(pos[r]) + 1)])
                w = torch.softmax(k[h, idx] @ q[h * g + j, r] / math.sqrt(d), 0)
                torch.testing.assert_close(out[h * g + j, r], w @ v[h, idx])
    assert c.meta_bytes == blocks * reps * d * 2  # fp16 representatives, per KV head
    cost = pol.decode_cost({}, HeadShape(128))
    assert cost.decide_bytes_per_token == reps * 128 * 2 / block
    assert cost.host_read_tokens == budget and cost.host_read_frac == 0.0


def test_a_share_budget_is_charged_as_a_share(examples, traces):
    """A block policy whose fetch is a share of the context (fetch_budget) reads whole blocks
    within it and is charged as a share, not as a fixed count."""
    from kvsim.measure.harness import analyze

    class Share(infllm.InfLLM):
        def fetch_budget(self):
            return 0.25, 0.0
    pol = Share(make("infllm", {"block_size": 16, "token_budget": 16, "sink": 0,
                                "local": 0}).params)
    a = analyze(pol, traces[0], seed=0)
    assert (a.cost.host_read_frac, a.cost.host_read_tokens) == (0.25, 0.0)
    assert 0 < a.stats["decode"]["kv_read_frac"] <= 0.25 + 1e-12
    assert a.cost.hbm_read_frac == pytest.approx(a.cost.meta_frac + 0.25)


def test_infllms_decide_bench_plans_through_the_shared_layout(examples):
    """The bench a block policy inherits: the policy's own selection on a synthetic layer, laid
    out by the one compact-layout code (CompactBench.plan) that Quest's and VerKV's use, and
    what kvsim profile and kvsim validate need (the DecideKernel protocol)."""
    from kvsim.hw.catalog import model
    m, n = model("smollm2-135m"), 2048
    pol = make("infllm", {"block_size": 64, "token_budget": 512})
    bench = pol.decide_kernel(torch.device("cpu"), m, n, seed=1)
    assert isinstance(bench, BlockBench) and isinstance(bench, DecideKernel)
    assert type(bench).plan is CompactBench.plan
    idx, slot, bias, counts = bench.plan()
    chosen = pol.select(bench.state, bench.q, bench.q_pos, bench.budget)[:, 0]
    fetched = chosen & ~bench.state.resident
    h, t = idx // n, idx % n
    assert torch.equal(fetched.nonzero(as_tuple=True)[0], h)
    assert torch.equal(fetched.nonzero(as_tuple=True)[1], t)
    assert torch.equal(counts, fetched.sum(-1)) and int(counts.max()) <= 512
    assert bool((slot // bench.t_max == h).all())
    assert bool((slot % bench.t_max >= bench.resident[h]).all())  # behind the resident tokens
    finite = torch.isfinite(bias)
    assert bool((bias[finite] == 0).all())  # InfLLM does not reweight
    assert torch.equal(finite[:, 0].sum(-1), bench.resident + counts)
    assert bench.fetched_frac == pytest.approx(float(counts.double().mean()) / n)
    two = bench.stack(2, workers=1)
    _, _, _, counts2 = two.plan()
    assert torch.equal(counts2[:m.kv_heads], counts)  # request 0 decided as alone
    assert two.trace.attention.layers[0].k.shape[0] == 2 * m.kv_heads


def test_the_profiler_times_a_block_policys_bench(examples):
    from kvsim.hw.catalog import model
    from profiler import kernels
    from profiler.backend import make_backend
    pol = make("infllm", {"block_size": 64, "token_budget": 256})
    be = make_backend(None, "cpu")
    tab, missing = kernels.sweep_decide(be, model("smollm2-135m"), [1024], [1, 2],
                                        lambda: None, pol.decide_kernel, "kernel_decide_infllm")
    t = tab["kernel_decide_infllm"]
    assert missing == [] and t["batch"].tolist() == [1, 2] and (t["seconds"] > 0).all()
    assert ((0 < t["fetched_frac"]) & (t["fetched_frac"] <= 256 / 1024)).all()


def test_every_deciding_policys_bench_meets_the_protocol():
    from kvsim.hw.catalog import model
    m = model("smollm2-135m")
    for name in registry.deciding():
        bench = make(name).decide_kernel(torch.device("cpu"), m, 1024, 0)
        assert isinstance(bench, DecideKernel) and isinstance(bench, CompactBench), name
        assert isinstance(bench, DecideStep)
    assert issubclass(h2o.H2O, MaskPolicy) and issubclass(infllm.InfLLM, FetchPolicy)
