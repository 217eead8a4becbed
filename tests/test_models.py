"""Model shapes from Hugging Face config.json files: the published Qwen3-4B config plans exactly
as the catalog entry, MoE configs count their active and total parameters as published, KV and
weight dtypes change bytes everywhere, and a config kvsim cannot read gets one line."""

import json

import pytest
from conftest import replay_json, run_cli

from kvsim.errors import KvsimError
from kvsim.hw import catalog, hfconfig
from kvsim.hw.costs import CostModel

QWEN3_4B = {  # config.json of Qwen/Qwen3-4B as published (fields kvsim does not read kept)
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 9728,
    "max_position_embeddings": 40960, "model_type": "qwen3", "num_attention_heads": 32,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "vocab_size": 151936}
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B: 30.5B parameters, 3.3B active (model card)
    "architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 1, "head_dim": 128,
    "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "mlp_only_layers": [], "moe_intermediate_size": 768, "model_type": "qwen3_moe",
    "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936}
MIXTRAL = {  # mistralai/Mixtral-8x7B-v0.1: 46.7B parameters, 12.9B active (model card)
    "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "rope_theta": 1e6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 32000}


def _write(tmp_path, cfg, name="m"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _replay(trace, **kw):
    return replay_json(trace=trace, gpu="h100-sxm", context=16384, batch=4,
                       output_len=16, **kw)


@pytest.mark.parametrize("policy", ["dense-resident", "dense-offload"])
def test_the_published_qwen3_4b_config_plans_as_the_catalog_entry(attn_trace, tmp_path, policy):
    d = _write(tmp_path, QWEN3_4B)
    a = _replay(attn_trace, policy=policy, model="qwen3-4b")
    for where in (d, d / "config.json"):
        b = _replay(attn_trace, policy=policy, model=str(where))
        assert b["sim"] == a["sim"] and b["memory"] == a["memory"] and b["tpot_ms"] == a["tpot_ms"]
        assert str(d / "config.json") in b["provenance"]["model"]
    m = catalog.model(str(d))
    ref = catalog.model("qwen3-4b")
    assert (m.params, m.kv_bytes_per_token, m.weight_bytes) == (ref.params,
                                                                ref.kv_bytes_per_token,
                                                                ref.weight_bytes)


def test_moe_configs_count_active_and_total_parameters_as_published(tmp_path):
    q = hfconfig.load(_write(tmp_path, QWEN3_30B_A3B, "q"))
    x = hfconfig.load(_write(tmp_path, MIXTRAL, "x"))
    assert q.params / 1e9 == pytest.approx(30.5, rel=0.01)
    assert q.active_params / 1e9 == pytest.approx(3.3, rel=0.03)
    assert x.params / 1e9 == pytest.approx(46.7, rel=0.01)
    assert x.active_params / 1e9 == pytest.approx(12.9, rel=0.01)
    # a decode step of one token reads its 8 experts' weights; a large batch reads nearly all
    c = CostModel.from_spec(catalog.gpu("h100-sxm"))
    one, many = float(c.gemm_time(1, q)), float(c.gemm_time(512, q))
    assert q.layer_weight_bytes(1) < 0.2 * q.layer_weight_bytes()
    assert q.layer_weight_bytes(512) == pytest.approx(q.layer_weight_bytes(), rel=0.03)
    assert one == pytest.approx(q.layer_weight_bytes(1) / c.hbm_bw)
    assert many > 5 * one
    # prefill FLOPs use the active parameters
    assert q.prefill_flops(1000) - q.attention_flops(1000) == pytest.approx(
        2 * q.active_params * 1000 - 2 * q.embed_params * 1000)


def test_a_moe_config_plans_with_its_active_parameters(attn_trace, tmp_path):
    d = _write(tmp_path, QWEN3_30B_A3B, "q")
    r = _replay(attn_trace, policy="dense-resident", model=str(d))
    assert r["memory"]["hbm_weights_gib"] == pytest.approx(30.5e9 * 2 / 2**30, rel=0.01)
    assert "30.53B params (3.35B active" in catalog.model(str(d)).describe()


def test_kv_and_weight_dtypes_change_bytes_everywhere(attn_trace):
    kw = dict(policy="dense-offload", model="qwen3-4b", engine="roofline", requests=4,
              scheduler="prefill-first")  # the batch decoding alone: link-bound
    base, fp8 = _replay(attn_trace, **kw), _replay(attn_trace, kv_dtype="fp8", **kw)
    assert fp8["host_gib"] == pytest.approx(base["host_gib"] / 2, rel=1e-3)
    assert fp8["tpot_ms"] == pytest.approx(base["tpot_ms"] / 2, rel=0.05)  # half the bytes
    assert "--kv-dtype" in fp8["provenance"]["model"]
    # decoding alone (prefill-first): 4-bit weights read faster; mixed with 16K-token prefill
    # chunks a W4A16 kernel's compute rate (0.623 of bf16's) would make the steps slower
    kw = dict(policy="dense-resident", model="qwen3-4b", scheduler="prefill-first")
    w4, ref = _replay(attn_trace, weight_dtype="int4", **kw), _replay(attn_trace, **kw)
    m = catalog.model("qwen3-4b")
    assert w4["memory"]["hbm_weights_gib"] == pytest.approx(
        (m.layers * m.layer_params * 0.5 + m.embed_params * 2) / 2**30)
    assert w4["tpot_ms"] < ref["tpot_ms"]


def test_configs_kvsim_cannot_plan_get_one_line(tmp_path):
    cases = [({**QWEN3_4B, "num_hidden_layers": 0},
              "num_hidden_layers must be a whole number >= 1"),
             ({k: v for k, v in QWEN3_4B.items() if k != "hidden_size"}, "no hidden_size"),
             ({**QWEN3_4B, "num_key_value_heads": 5}, "not a multiple"),
             ({**QWEN3_4B, "kv_lora_rank": 512}, "latent attention"),
             ({**QWEN3_4B, "torch_dtype": "int7"}, "dtype"),
             ([1, 2], "JSON object")]
    for i, (cfg, msg) in enumerate(cases):
        d = _write(tmp_path, cfg, f"c{i}")
        with pytest.raises(KvsimError, match=msg):
            catalog.model(str(d))
        code, _, err = run_cli("replay", "--policy", "dense", "--model", d)
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1
    (tmp_path / "bad.json").write_text("{not json")
    code, _, err = run_cli("replay", "--policy", "dense", "--model", tmp_path / "bad.json")
    assert code == 2 and "not JSON" in err
    code, _, err = run_cli("replay", "--policy", "dense", "--model", "Qwen/Qwen3-32B")
    assert code == 2 and "local files only" in err  # an id kvsim has no shape for
    assert catalog.model("Qwen/Qwen3-4B") is catalog.model("qwen3-4b")  # a catalog shape's id
    assert catalog.model("meta-llama/Llama-3.3-70B-Instruct").name == "llama-3.1-70b"
    code, _, err = run_cli("replay", "--policy", "dense", "--model", "qwen9")
    assert code == 2 and "config.json" in err


def test_a_multimodal_config_plans_its_text_model(tmp_path):
    d = _write(tmp_path, {"architectures": ["X"], "text_config": QWEN3_4B,
                          "tie_word_embeddings": True})
    assert catalog.model(str(d)).params == catalog.model("qwen3-4b").params


def test_the_catalog_is_read_from_its_configs():
    """Every catalog shape is a config.json under kvsim/hw/models/, read by the same reader as
    a user's, with its source."""
    assert set(catalog.MODELS) == {p.stem for p in hfconfig.MODELS_DIR.glob("*.json")}
    for name, m in catalog.MODELS.items():
        assert m.name == name and m.source.startswith("config.json of ") and "/" in m.hf_id
    assert catalog.model("qwen3-4b").max_context == 131072  # YaRN x4 on 32,768, as its card
    assert catalog.model("qwen3-4b") == hfconfig.load(hfconfig.MODELS_DIR / "qwen3-4b.json")


def test_a_config_is_named_by_its_model_never_its_folder(tmp_path):
    named = _write(tmp_path, {**QWEN3_4B, "_name_or_path": "Qwen/Qwen3-4B"}, name="h-new")
    assert hfconfig.load(named).name == "Qwen/Qwen3-4B"
    assert hfconfig.load(named / "config.json").name == "Qwen/Qwen3-4B"
    bare = _write(tmp_path, QWEN3_4B, name="h-old")  # no _name_or_path: its architecture
    assert hfconfig.load(bare).name == "Qwen3ForCausalLM"
    typed = _write(tmp_path, {k: v for k, v in QWEN3_4B.items() if k != "architectures"},
                   name="h-typed")
    assert hfconfig.load(typed).name == "qwen3"
    mm = _write(tmp_path, {"architectures": ["LlavaForConditionalGeneration"],
                           "text_config": QWEN3_4B}, name="h-mm")
    assert hfconfig.load(mm).name == "LlavaForConditionalGeneration"


def test_a_plain_mlp_config_gpt_j_has_its_published_parameter_count(tmp_path):
    """GPT-J-6B (GPT-2-style field names, n_inner null, fc_in/fc_out MLP): 6,053,381,344
    parameters on its model card; kvsim counts the matrices and embeddings, not the biases and
    norms (~3.4M), so it is within 0.1% below."""
    m = catalog.model("gpt-j-6b")
    assert (m.layers, m.q_heads, m.kv_heads, m.head_dim, m.intermediate, m.mlp_matrices) == \
        (28, 16, 16, 256, 16384, 2)
    assert 0 < 6_053_381_344 - m.params < 0.001 * 6_053_381_344
    assert m.kv_bytes_per_token == 2 * 28 * 16 * 256 * 2
    assert catalog.model("EleutherAI/gpt-j-6b") is m
    neox = _write(tmp_path, {"model_type": "gpt_neox", "hidden_size": 512, "intermediate_size":
                             2048, "num_attention_heads": 8, "num_hidden_layers": 2,
                             "vocab_size": 1000}, name="neox")
    plain = catalog.model(str(neox))
    assert plain.mlp_matrices == 2 and plain.layer_params == 4 * 512**2 + 2 * 512 * 2048
    gated = catalog.model(str(_write(tmp_path, {**json.loads((neox / "config.json")
                                                            .read_text()), "model_type": "llama"},
                                     name="llama")))
    assert gated.layer_params - plain.layer_params == 512 * 2048
