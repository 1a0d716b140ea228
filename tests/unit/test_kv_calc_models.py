"""`kvserve kv-calc` on the newer layouts: MLA (DeepSeek), sliding windows (Mistral, Gemma 2/3), MoE weights
(Qwen3-MoE, Mixtral, DeepSeek), and the MHA / GQA / MLA comparison. Configs are written by transformers' own
config classes; every figure is checked against a formula written out here, and the parameter counts against the
model transformers builds from the same config (on the meta device: no memory)."""
from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from kvserve.model_loader.param_count import param_count
from tests.helpers.kv_calc import kv_calc_exit as _cli
from tests.helpers.kv_calc import kv_calc_json as _report

# DeepSeek-V3's attention with fewer layers and experts (the latent and head widths are the real ones)
DEEPSEEK = dict(num_hidden_layers=5, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                num_attention_heads=16, num_key_value_heads=16, n_routed_experts=16, num_experts_per_tok=4,
                n_shared_experts=1, first_k_dense_replace=2, kv_lora_rank=512, q_lora_rank=96, qk_rope_head_dim=64,
                qk_nope_head_dim=128, v_head_dim=128, n_group=4, topk_group=2, vocab_size=1000,
                max_position_embeddings=4096, dtype="bfloat16")


def _save(config, folder) -> str:
    config.save_pretrained(folder)
    return str(folder)


def _numel(config) -> int:
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- MLA


def test_mla_caches_one_latent_vector_per_token_and_layer(tmp_path, capsys):
    folder = _save(tf.DeepseekV3Config(**DEEPSEEK), tmp_path / "ds")
    r = _report(capsys, "--model", folder, "--context", "1000", "--memory", "1GiB")
    per_token = 5 * (512 + 64) * 2               # layers x (kv_lora_rank + rope) x bfloat16: no K/V pair, no heads
    assert (r["attention"], r["kv_lora_rank"], r["qk_rope_head_dim"]) == ("MLA", 512, 64)
    assert r["kv_bytes_per_token"] == r["bytes_per_token"] == per_token
    assert r["kv_bytes_per_sequence"] == per_token * 1000
    assert r["max_sequences_in_memory"] == 2**30 // (per_token * 1000)
    # the latent is every head's: each tensor-parallel rank holds all of it
    r2 = _report(capsys, "--model", folder, "--context", "1000", "--tensor-parallel-size", "4")
    assert r2["kv_bytes_per_token"] == per_token and r2["kv_bytes_per_token_all_ranks"] == 4 * per_token
    assert _cli("--model", folder, "--kv-cache-dtype", "int8") == 2
    assert "MLA latent cache is not quantized" in capsys.readouterr().err
    assert _cli("--model", folder, "--context", "1000") == 0
    assert "16 heads, MLA: one latent of 512 + 64 (RoPE) elements a token and layer" in capsys.readouterr().out


def test_the_comparison_table_mha_gqa_mla(tmp_path, capsys):
    folder = _save(tf.DeepseekV3Config(**DEEPSEEK), tmp_path / "ds")
    rows = {row["attention"]: row for row in _report(capsys, "--model", folder, "--context", "100",
                                                     "--memory", "1GB")["comparison"]}
    mla = 5 * 576 * 2
    # MHA: K of 128 + 64, V of 128 per head, 16 heads; GQA: the same with 8 KV heads (hypothetical)
    assert rows["MHA"]["bytes_per_token"] == 5 * 16 * (192 + 128) * 2
    assert rows["GQA"]["bytes_per_token"] == 5 * 8 * (192 + 128) * 2 and rows["GQA"]["hypothetical"]
    assert rows["MLA"]["bytes_per_token"] == mla and rows["MLA"]["configured"] and not rows["MLA"]["hypothetical"]
    assert rows["MHA"]["vs_configured"] == pytest.approx(16 * 320 / 576)
    assert rows["MLA"]["max_sequences_in_memory"] == 10**9 // (mla * 100)
    # a GQA model: MHA and MLA (DeepSeek-V3's 512 + 64) hypothetical, GQA as configured
    llama = _save(tf.LlamaConfig(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
                                 num_key_value_heads=8, max_position_embeddings=8192), tmp_path / "70b")
    rows = {row["attention"]: row for row in _report(capsys, "--model", llama, "--kv-dtype", "float16")["comparison"]}
    assert [rows[k]["bytes_per_token"] for k in ("MHA", "GQA", "MLA")] == [
        2 * 80 * 64 * 128 * 2, 2 * 80 * 8 * 128 * 2, 80 * (512 + 64) * 2]
    assert [rows[k]["hypothetical"] for k in ("MHA", "GQA", "MLA")] == [True, False, True]
    assert rows["GQA"]["vs_configured"] == 1.0 and rows["MHA"]["vs_configured"] == 8.0
    assert _cli("--model", llama, "--kv-dtype", "float16", "--memory", "80GB") == 0
    out = capsys.readouterr().out
    assert "MHA (64 KV heads) *" in out and "GQA (8 KV heads) " in out and "MLA (512+64) *" in out
    assert "hypothetical" in out
    # under tensor parallelism the rows are one rank's: K/V heads split, the latent replicated
    rows = {row["attention"]: row for row in _report(capsys, "--model", llama, "--kv-dtype", "float16",
                                                     "--tensor-parallel-size", "8")["comparison"]}
    assert rows["GQA"]["bytes_per_token"] == 2 * 80 * 1 * 128 * 2 and rows["MLA"]["bytes_per_token"] == 80 * 576 * 2


# --------------------------------------------------------------------------- sliding windows


def test_mistral_window_on_every_layer(tmp_path, capsys):
    folder = _save(tf.MistralConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                                    num_key_value_heads=8, sliding_window=4096, dtype="bfloat16"), tmp_path / "m")
    per_token = 2 * 32 * 8 * 128 * 2
    r = _report(capsys, "--model", folder, "--context", "32768", "--memory", "16GiB")
    assert (r["sliding_window"], r["num_sliding_layers"]) == (4096, 32)
    assert r["kv_bytes_per_token"] == per_token
    assert r["kv_bytes_per_sequence"] == per_token * 4096      # each layer keeps the last 4096 tokens
    assert r["kv_bytes_per_sequence_without_windows"] == per_token * 32768
    assert r["max_sequences_in_memory"] == 16 * 2**30 // (per_token * 4096)
    assert r["max_sequences_in_memory_without_windows"] == 16 * 2**30 // (per_token * 32768)
    # shorter than the window: no saving
    assert _report(capsys, "--model", folder, "--context", "1000")["kv_bytes_per_sequence"] == per_token * 1000


def test_gemma3_alternating_windows(tmp_path, capsys):
    config = tf.Gemma3TextConfig(num_hidden_layers=12, hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                                 head_dim=128, sliding_window=1024, dtype="bfloat16")
    assert config.layer_types.count("full_attention") == 2          # every 6th layer global
    per_layer = 2 * 4 * 128 * 2
    expected = per_layer * (10 * 1024 + 2 * 8192)
    r = _report(capsys, "--model", _save(config, tmp_path / "g3"), "--context", "8192", "--memory", "1GiB")
    assert (r["num_sliding_layers"], r["kv_bytes_per_token"]) == (10, 12 * per_layer)
    assert r["kv_bytes_per_sequence"] == expected and r["max_sequences_in_memory"] == 2**30 // expected
    assert r["kv_bytes_per_sequence_without_windows"] == 12 * per_layer * 8192
    # a config.json of the Gemma 3 release: no layer_types, the pattern instead (and Gemma 2: alternating)
    fields = {k: v for k, v in config.to_dict().items() if k != "layer_types"} | {"sliding_window_pattern": 6}
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(fields))
    assert _report(capsys, "--model", str(tmp_path / "old"), "--context", "8192")["kv_bytes_per_sequence"] == expected
    fields = {k: v for k, v in tf.Gemma2Config(num_hidden_layers=4, sliding_window=16).to_dict().items()
              if k != "layer_types"}
    (tmp_path / "g2").mkdir()
    (tmp_path / "g2" / "config.json").write_text(json.dumps(fields))
    assert _report(capsys, "--model", str(tmp_path / "g2"), "--context", "64")["num_sliding_layers"] == 2
    out = (_cli("--model", str(tmp_path / "old"), "--context", "8192", "--memory", "1GiB"), capsys.readouterr().out)[1]
    assert "10 of 12 layers keep the last 1,024 tokens" in out and "no windows" in out


def test_use_sliding_window_false_means_no_window(tmp_path, capsys):
    config = tf.Qwen2Config(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                            sliding_window=64, use_sliding_window=False)
    r = _report(capsys, "--model", _save(config, tmp_path / "q"), "--context", "512")
    assert r["sliding_window"] is None and "kv_bytes_per_sequence_without_windows" not in r
    assert r["kv_bytes_per_sequence"] == 2 * 4 * 2 * 64 * 2 * 512  # no dtype in the config: float16


# --------------------------------------------------------------------------- MoE weights


@pytest.mark.parametrize("config", [
    tf.Qwen3MoeConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      mlp_only_layers=[1], vocab_size=1000),
    tf.MixtralConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=48, num_local_experts=8, num_experts_per_tok=2, vocab_size=1000),
    tf.Qwen2MoeConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      shared_expert_intermediate_size=48, decoder_sparse_step=2, vocab_size=1000),
    tf.DeepseekV3Config(**DEEPSEEK),
    tf.DeepseekV2Config(**(DEEPSEEK | dict(q_lora_rank=None, n_shared_experts=2))),
    tf.Gemma3TextConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=96, vocab_size=1000),
], ids=["qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "deepseek_v2", "gemma3"])
def test_param_count_equals_the_model_transformers_builds(config):
    assert param_count(config.to_dict()).total == _numel(config)


def test_moe_total_and_active_parameters(tmp_path, capsys):
    h, i, e, k, layers, vocab = 64, 32, 8, 2, 4, 1000
    config = tf.Qwen3MoeConfig(num_hidden_layers=layers, hidden_size=h, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=32, intermediate_size=96, moe_intermediate_size=i, num_experts=e,
                               num_experts_per_tok=k, mlp_only_layers=[1], vocab_size=vocab, dtype="bfloat16")
    r = _report(capsys, "--model", _save(config, tmp_path / "moe"), "--context", "100")
    attention = h * (4 + 2 + 2) * 32 + 4 * 32 * h + 2 * 32 + 2 * h      # q k v o, q/k norms, the two layer norms
    sparse = h * e + e * 3 * h * i                                         # router + experts
    total = layers * attention + 3 * sparse + 3 * h * 96 + 2 * vocab * h + h
    assert (r["params_total"], r["num_experts"], r["experts_per_token"], r["num_moe_layers"]) == (total, e, k, 3)
    assert r["params_active"] == total - 3 * (e - k) * 3 * h * i            # the unpicked experts' weights
    assert (r["weight_dtype"], r["weight_bytes_total"], r["weight_bytes_active"]) == (
        "bfloat16", 2 * total, 2 * r["params_active"])
    # the KV cache does not change with experts: a dense model's formula
    assert r["kv_bytes_per_token"] == 2 * layers * 2 * 32 * 2
    assert _report(capsys, "--model", str(tmp_path / "moe"), "--weight-dtype", "int4")["weight_bytes_total"] == \
        total // 2


def test_device_memory_leaves_the_cache_what_the_weights_do_not_take(tmp_path, capsys):
    folder = _save(tf.MixtralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                                    vocab_size=1000, dtype="float16"), tmp_path / "mix")
    weights = _report(capsys, "--model", folder)["weight_bytes_total"]
    r = _report(capsys, "--model", folder, "--context", "64", "--device-memory", "4MB", "--tensor-parallel-size", "2")
    per_rank = -(-weights // 2)
    assert (r["device_memory_bytes"], r["weight_bytes_per_rank"]) == (4 * 10**6, per_rank)
    assert r["memory_bytes"] == 4 * 10**6 - per_rank
    assert r["max_sequences_in_memory"] == r["memory_bytes"] // r["kv_bytes_per_sequence"]
    assert _cli("--model", folder, "--device-memory", "100KB") == 2
    assert "do not fit in --device-memory 100KB" in capsys.readouterr().err
    assert _cli("--model", folder, "--device-memory", "1GB", "--memory", "1GB") == 2
    assert "not both" in capsys.readouterr().err


# --------------------------------------------------------------------------- presets


def test_presets_size_without_a_download(capsys):
    r = _report(capsys, "--model", "deepseek-v3", "--context", "4096")
    assert r["kv_bytes_per_token"] == 61 * (512 + 64) * 2 and r["attention"] == "MLA"
    assert (r["num_experts"], r["experts_per_token"], r["num_moe_layers"]) == (256, 8, 58)
    assert 660e9 < r["params_total"] < 680e9 and 35e9 < r["params_active"] < 40e9   # "671B, 37B activated"
    r = _report(capsys, "--model", "Qwen3-30B-A3B")
    assert r["kv_bytes_per_token"] == 2 * 48 * 4 * 128 * 2 and r["context"] == 40960
    assert 30e9 < r["params_total"] < 31e9 and 3.2e9 < r["params_active"] < 3.5e9   # "30.5B, 3.3B activated"
    r = _report(capsys, "--model", "gemma-3-27b", "--context", "8192")
    assert (r["sliding_window"], r["num_sliding_layers"]) == (1024, 52)
    r = _report(capsys, "--model", "mixtral-8x7b")
    assert 46e9 < r["params_total"] < 47.5e9 and 12.5e9 < r["params_active"] < 13.5e9  # "46.7B, 12.9B active"
    assert _cli("--model", "no-such-model") == 2
    assert "or a preset: deepseek-v3" in capsys.readouterr().err
