"""The model wiring on a tiny randomly initialised Llama-style model (no download).

Checks: dense through the policy path gives the stock model's logits and tokens; capture records
the model's own K/V, queries and positions and round-trips through the trace loader; KVzip
scores equal a direct computation from eager attention weights; eval scores right answers right,
wrong ones wrong, and reports a failing prompt without stopping.
"""

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from kvsim import trace as T  # noqa: E402
from kvsim.attention.dense import dense_attention  # noqa: E402
from kvsim.measure.evaluate import PolicySpec, evaluate  # noqa: E402
from kvsim.model import (  # noqa: E402
    LoadedModel,
    model_info,
    runner,
)
from kvsim.model.capture import capture  # noqa: E402
from kvsim.model.hooks import install  # noqa: E402
from kvsim.model.tasks import Prompt  # noqa: E402
from kvsim.policies import make  # noqa: E402


class ByteCodec:
    """Bytes as tokens: enough to drive the tiny model end to end."""
    eos_ids: set = set()

    def encode(self, text):
        return list(text.encode())

    def count(self, text):
        return len(text.encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def layout(self, context, question, answer_prefix=""):
        return self.encode(context + "\n\n"), self.encode(question + "\n" + answer_prefix)


def tiny_model(attn="sdpa", seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rope_theta=10000.0, attn_implementation=attn)
    m = transformers.LlamaForCausalLM(cfg).eval()
    # sharpen attention so that it is far from uniform (a random init is nearly flat)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
    return m


@pytest.fixture(scope="module")
def lm():
    m = tiny_model()
    stock = tiny_model()  # same seed: same weights, untouched attention
    install(m)
    out = LoadedModel(m, ByteCodec(), "tiny", "tiny random Llama", 0.0, info=model_info(m))
    out.stock = stock
    return out


PROMPT = Prompt("The vault code is 4711. " * 12 + "Other words follow here.", "What is the code?",
                ["4711"], "The code is", task="niah", id="p0")


def test_dense_through_the_policy_path_gives_the_stock_logits(lm):
    codec = lm.codec
    ctx, q = codec.layout(PROMPT.context, PROMPT.question, PROMPT.answer_prefix)
    with torch.no_grad():
        ref = lm.stock(torch.tensor([ctx + q])).logits[0, len(ctx):]
    pre = runner.prefill(lm.model, ctx)
    g = runner.generate(lm.model, codec, pre, q, 6, policy=make("dense-resident"),
                        return_logits=True, stop=False)
    assert g.question_logits.shape == ref.shape
    torch.testing.assert_close(g.question_logits, ref, atol=1e-4, rtol=1e-4)
    assert len(g.stats) == 3 * g.forwards and g.phases.count("question") == 3
    assert runner.cache_kv(pre.cache, 0)[0].shape[1] == len(ctx)  # cut back to the context
    # greedy decoding through the policy matches the stock model's greedy decoding
    ids = torch.tensor([ctx + q])
    with torch.no_grad():
        for _ in range(5):
            nxt = lm.stock(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    assert g.ids[:5] == ids[0, len(ctx) + len(q):].tolist()
    # and a policy that drops most of the context does change the logits (the path is live)
    g2 = runner.generate(lm.model, codec, pre, q, 1, return_logits=True, stop=False,
                         policy=make("topk", {"compression": 8, "sink": 2, "local": 2}))
    assert (g2.question_logits - ref).abs().max() > 1e-3


def test_capture_records_the_models_tensors_and_round_trips(lm, tmp_path):
    layers = [0, 2]
    tr = capture(lm, PROMPT, layers, decode_steps=3, progress=False)
    path = T.save(tr, tmp_path / "t.npz")
    back = T.load(path)
    a = back.attention
    ctx, q = lm.codec.layout(PROMPT.context, PROMPT.question, PROMPT.answer_prefix)
    n = len(ctx) + len(q) + 3
    assert [la.layer for la in a.layers] == layers and a.context_len == len(ctx)
    assert a.n_tokens == n and a.n_kv_heads == 2 and a.n_q_heads == 4 and a.head_dim == 16
    np.testing.assert_array_equal(a.question_pos, np.arange(len(ctx), len(ctx) + len(q)))
    np.testing.assert_array_equal(a.decode_pos, np.arange(len(ctx) + len(q), n))
    assert a.rope == {"theta": 10000.0, "type": "default"}
    assert back.meta["task"] == "niah" and back.meta["model"] == "tiny random Llama"
    for la in a.layers:
        assert la.k.dtype == np.float16 and la.q_decode.shape == (4, 3, 16)
        assert set(la.scores) == {"snapkv", "kvzip"}
        assert (la.scores["kvzip"][:, :len(ctx)] > 0).all()
        assert (la.scores["kvzip"][:, len(ctx):] == 0).all()
    # the stored rows reproduce the stock model's attention weights (eager) at those positions
    tokens = (ctx + q + _decoded(lm, ctx, q, 3))[:n]
    eager = tiny_model("eager")
    with torch.no_grad():
        att = eager(torch.tensor([tokens]), output_attentions=True).attentions
    for la in a.layers:
        rows = np.concatenate([a.question_pos, a.decode_pos])
        qs = torch.from_numpy(np.concatenate([la.q_question, la.q_decode], 1)).float()
        k, v = torch.from_numpy(la.k).float(), torch.from_numpy(la.v).float()
        s = torch.einsum("hmd,hnd->hmn", qs, k.repeat_interleave(2, 0)) / 4.0
        s = s.masked_fill(torch.arange(n)[None, None] > torch.from_numpy(rows)[None, :, None],
                          float("-inf"))
        torch.testing.assert_close(torch.softmax(s, -1), att[la.layer][0][:, rows],
                                   atol=3e-3, rtol=0)
        out, _ = dense_attention(qs, k, v, torch.from_numpy(rows))
        assert torch.isfinite(out).all()


def _decoded(lm, ctx, q, steps):
    ids = torch.tensor([ctx + q])
    out = []
    with torch.no_grad():
        for _ in range(steps):
            nxt = int(lm.stock(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def test_kvzip_scores_are_max_attention_from_the_reconstruction_rows(lm):
    ctx = lm.codec.encode("alpha beta gamma delta epsilon " * 6)
    recon = lm.codec.encode("\nRepeat:\n") + ctx
    pre = runner.prefill(lm.model, ctx, kvzip_ids=recon)
    assert runner.cache_kv(pre.cache, 1)[0].shape[1] == len(ctx)
    eager = tiny_model("eager")
    with torch.no_grad():
        att = eager(torch.tensor([ctx + recon]), output_attentions=True).attentions
    for layer in range(3):
        p = att[layer][0][:, len(ctx):, :len(ctx)]  # (n_q, recon rows, context keys)
        want = p.amax(dim=1).view(2, 2, len(ctx)).amax(dim=1)
        torch.testing.assert_close(pre.scores[layer]["kvzip"], want, atol=1e-5, rtol=1e-4)
        assert pre.scores[layer]["snapkv"].shape == (2, len(ctx))


def test_eval_scores_right_answers_right_and_wrong_ones_wrong(lm, monkeypatch):
    pre = runner.prefill(lm.model, lm.codec.layout(PROMPT.context, PROMPT.question,
                                                    PROMPT.answer_prefix)[0])
    ctx, q = lm.codec.layout(PROMPT.context, PROMPT.question, PROMPT.answer_prefix)
    said = runner.generate(lm.model, lm.codec, pre, q, 8).text
    assert said.strip()
    right = Prompt(PROMPT.context, PROMPT.question, [said.strip()[:3]], PROMPT.answer_prefix,
                   task="niah", id="right")
    wrong = Prompt(PROMPT.context, PROMPT.question, ["\u2603never"], PROMPT.answer_prefix,
                   task="niah", id="wrong")
    broken = Prompt("boom", "?", ["x"], id="broken")
    real_layout = lm.codec.layout

    def layout(context, *a):
        if context == "boom":
            raise ValueError("cannot lay out this prompt")
        return real_layout(context, *a)

    monkeypatch.setattr(lm.codec, "layout", layout)
    out = evaluate(lm, [right, broken, wrong],
                   [PolicySpec("dense-resident"),
                    PolicySpec("topk", {"scorer": "kvzip", "compression": 4, "sink": 2,
                                        "local": 2}),
                    PolicySpec("topk", {"scorer": "oracle", "compression": 4, "sink": 2,
                                        "local": 2}, label="oracle")],
                   max_new_tokens=8, progress=False)
    assert out["n"] == 2 and out["n_failed"] == 1 and "cannot lay out" in \
        out["failures"][0]["error"]
    assert out["dense_accuracy"] == 0.5
    dense, topk, oracle = out["results"]
    assert dense["accuracy"] == 0.5 and dense["relative_accuracy"] == 1.0
    assert dense["kv_read_frac"] == 0.0 and dense["overall_kv_read_frac"] == 0.0
    assert dense["stats"]["resident_frac"] == 1.0  # measured as on traces (kvsim.measure.stats)
    assert topk["stats"]["resident_frac"] == pytest.approx(0.25, abs=0.02)  # 4x
    assert topk["stats"]["meta_frac"] == 0.0 and topk["kv_read_frac"] == 0.0
    assert out["kvzip_scores"] is True and 0.0 <= topk["accuracy"] <= 1.0
    assert out["oracle_scores"] is True and 0.0 <= oracle["accuracy"] <= 1.0


def test_missing_model_is_one_line(tmp_path):
    from conftest import run_cli
    rc, out, err = run_cli("eval", "--model", tmp_path / "nowhere", "--policy", "dense")
    assert rc == 2 and err.count("\n") == 1 and "nothing is downloaded" in err


def _char_tokenizer():
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(string.printable)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    t.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>",
                                                eos_token="</s>")


def test_cli_on_a_local_model_directory_with_user_prompts(tmp_path):
    """`--model PATH` and `--prompts FILE` end to end: eval's JSON keys, a bad line reported,
    capture writes a loadable trace and refuses to overwrite it."""
    import json

    from conftest import run_cli
    d = tmp_path / "tiny-model"
    tiny_model().save_pretrained(d)
    _char_tokenizer().save_pretrained(d)
    prompts = tmp_path / "p.jsonl"
    good = {"context": "The vault code is 4711. " * 8, "question": "What is the code?",
            "answers": ["4711"], "answer_prefix": "The code is"}
    prompts.write_text(json.dumps(good) + "\n{broken\n" + json.dumps(good) + "\n")
    rc, out, err = run_cli("eval", "--model", d, "--prompts", prompts, "--policy", "dense",
                           "--max-new-tokens", "4", "--json", "--no-progress")
    assert rc == 0, err
    res = json.loads(out)
    for key in ("accuracy", "dense_accuracy", "relative_accuracy", "kv_read_frac", "n"):
        assert key in res
    assert res["n"] == 2 and res["n_failed"] == 1 and ":2:" in res["failures"][0]["error"]
    assert res["accuracy"] == res["dense_accuracy"]  # dense through the policy path = dense
    trace_path = tmp_path / "t.npz"
    args = ["capture", "--model", d, "--prompts", prompts, "--index", "1", "--layers", "0,2",
            "--decode-steps", "2", "--out", trace_path, "--no-progress"]
    rc, out, err = run_cli(*args)
    assert rc == 0, err
    t = T.load(trace_path)
    assert [la.layer for la in t.attention.layers] == [0, 2] and t.meta["prompt_index"] == 1
    rc, out, err = run_cli(*args)
    assert rc == 2 and "--force" in err


def test_gguf_file_is_parsed_once_while_loading_and_gguf_is_restored(monkeypatch):
    """kvsim.model.loading.gguf_parsed_once, against a stand-in ``gguf`` module: three readers
    of one file are one parse, the tensor-name map is built once per (arch, depth) and a
    call whose arguments cannot be a cache key still works; on leaving, the module's own
    functions are back."""
    import types

    from kvsim.model.loading import gguf_parsed_once

    calls = {"read": 0, "names": 0}

    def reader(path, mode="r"):
        calls["read"] += 1
        return ("reader", str(path), mode)

    def names(arch, n_blocks):
        calls["names"] += 1
        return ("map", arch, str(n_blocks))

    fake = types.ModuleType("gguf")
    fake.GGUFReader, fake.get_tensor_name_map = reader, names
    monkeypatch.setitem(__import__("sys").modules, "gguf", fake)
    with gguf_parsed_once():
        got = [fake.GGUFReader("m.gguf") for _ in range(3)]
        assert got == [("reader", "m.gguf", "r")] * 3 and calls["read"] == 1
        assert fake.GGUFReader("m.gguf", mode="c") == ("reader", "m.gguf", "c")
        assert calls["read"] == 2
        maps = [fake.get_tensor_name_map(7, 30) for _ in range(397)]
        assert maps == [("map", 7, "30")] * 397 and calls["names"] == 1
        assert fake.get_tensor_name_map(7, [30]) == ("map", 7, "[30]")  # not hashable
    assert fake.GGUFReader is reader and fake.get_tensor_name_map is names
    with pytest.raises(RuntimeError), gguf_parsed_once():  # restored on an error too
        raise RuntimeError("load failed")
    assert fake.GGUFReader is reader and fake.get_tensor_name_map is names
