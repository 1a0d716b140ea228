"""GGUF files of the architectures beyond Llama (gguf `qwen3moe`, `qwen2moe`, `llama` with experts (Mixtral),
`olmoe`, `granitemoe`, `phi3`, `granite`; dense `qwen2`, `qwen3`): tiny random transformers models written as
llama.cpp's converter writes them (tests/helpers/gguf_convert.py: stacked experts, permuted Q/K rows, fused
Phi-3 tensors), loaded by the engine from the .gguf file alone and compared with transformers on the same
weights: the config read from the metadata, the stacked experts, the tokenizer, and the logits of a mixed
batch. Quantized files (Q8_0 and the K-quants Q4_K / Q5_K / Q6_K, dequantized at load) against transformers
holding the dequantized weights.
"""
from __future__ import annotations

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.kv_cache.sizing import attention_shape
from kvserve.model_loader.architectures import moe_layer_indices, resolve_architecture
from kvserve.model_loader.gguf_loader import iter_gguf_tensors, load_gguf_config
from tests.helpers.architectures import make_checkpoint
from tests.helpers.gguf_convert import Q, write_gguf
from tests.helpers.oracles import hf_logits, mixed_batch, paged_logits

ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "granitemoe", "phi3", "granite")
_CONFIG_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "rms_norm_eps", "tie_word_embeddings", "num_experts_per_tok", "norm_topk_prob",
                  "moe_intermediate_size", "shared_expert_intermediate_size", "embedding_multiplier",
                  "attention_multiplier", "residual_multiplier", "logits_scaling", "clip_qkv")


@pytest.fixture(scope="module", params=ARCHS)
def gguf_model(request, tmp_path_factory):
    """(arch, .gguf path, transformers model holding the file's weights), written once per module."""
    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    hf = make_checkpoint(str(folder / "hf"), arch)
    path = str(folder / f"{arch}.gguf")
    write_gguf(path, hf, arch)
    return arch, path, hf


def _engine(path: str) -> Engine:
    return Engine(EngineArgs(model=path, num_gpu_blocks_override=64))


def _assert_logits_match(engine: Engine, hf, seed: int, atol: float) -> None:
    batch = mixed_batch(seed=seed)
    for (tokens, ctx, q), got in zip(batch, paged_logits(engine, batch)):
        ref = hf_logits(hf, tokens[:ctx + q])[ctx:ctx + q]
        torch.testing.assert_close(got, ref, atol=atol, rtol=atol)
    engine.scheduler.check_invariants()


def test_config_from_the_metadata_matches_transformers(gguf_model):
    _, path, hf = gguf_model
    config, want = load_gguf_config(path), hf.config
    assert resolve_architecture(config)[0] == resolve_architecture(want)[0]
    assert attention_shape(config) == attention_shape(want)
    for name in _CONFIG_FIELDS:
        if hasattr(want, name):
            value, expected = getattr(config, name), getattr(want, name)
            assert value == (pytest.approx(expected, rel=1e-6) if isinstance(expected, float) else expected), name
    assert config.rope_parameters["rope_theta"] == want.rope_parameters["rope_theta"]
    assert config.intermediate_size == want.intermediate_size
    feats = resolve_architecture(want)[1]
    assert moe_layer_indices(config, feats) == moe_layer_indices(want, feats)   # Qwen: dense where no router


def test_logits_match_transformers(gguf_model):
    arch, path, hf = gguf_model
    _assert_logits_match(_engine(path), hf, seed=sum(map(ord, arch)), atol=1e-4)


def test_stacked_experts_come_back_as_transformers_holds_them(gguf_model):
    arch, path, hf = gguf_model
    if arch not in ("qwen3_moe", "olmoe", "mixtral"):
        pytest.skip("names differ from transformers' in-memory ones only where checked elsewhere")
    ours = dict(iter_gguf_tensors(path))
    prefix = "block_sparse_moe" if arch == "mixtral" else "mlp"
    for name, param in hf.named_parameters():
        if ".experts." in name or name.endswith("mlp.gate.weight"):
            got = ours[name.replace(".mlp.", f".{prefix}.")]
            assert torch.equal(got, param.detach()), name


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_dense_qwen_files(tmp_path, model_type):
    """gguf `qwen2` (QKV biases) and `qwen3` (per-head q/k norms): no Q/K permutation in their converter."""
    import transformers as tf

    torch.manual_seed(2)
    cls = tf.Qwen2Config if model_type == "qwen2" else tf.Qwen3Config
    cfg = cls(vocab_size=49152, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              intermediate_size=96, num_hidden_layers=2, max_position_embeddings=1024, tie_word_embeddings=True,
              bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "eager"
    hf = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.08) if p.dim() >= 2 else p.uniform_(0.6, 1.4)
    path = str(tmp_path / f"{model_type}.gguf")
    write_gguf(path, hf, model_type)
    assert load_gguf_config(path).architectures == [type(hf).__name__]
    _assert_logits_match(_engine(path), hf, seed=2, atol=1e-4)


# --------------------------------------------------------------------------- quantized files


def _wide_qwen3_moe(seed: int):
    """A Qwen3-MoE whose rows split into 256-wide K-quant blocks (hidden and expert widths 256)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.Qwen3MoeConfig(vocab_size=49152, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=1024,
                            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = cfg._experts_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.05) if p.dim() >= 2 else p.uniform_(0.6, 1.4)
    return model


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0])
def test_quantized_qwen3_moe_matches_transformers_on_the_dequantized_weights(tmp_path, qtype):
    hf = _wide_qwen3_moe(seed=int(qtype))
    path = str(tmp_path / f"qwen3moe-{qtype.name}.gguf")
    write_gguf(path, hf, "qwen3_moe", qtype)
    import gguf

    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == qtype and types["blk.1.attn_q.weight"] == qtype
    _assert_logits_match(_engine(path), hf, seed=int(qtype), atol=2e-4)


@pytest.mark.parametrize("arch", ["mixtral", "granite", "phi3"])
def test_q8_0_files_with_permuted_and_fused_rows(tmp_path, arch):
    """Q8_0 blocks: Llama-style permuted Q/K rows (Mixtral, Granite), fused QKV / gate-up (Phi-3)."""
    hf = make_checkpoint(str(tmp_path / "hf"), arch, seed=3)
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf(path, hf, arch, Q.Q8_0)
    _assert_logits_match(_engine(path), hf, seed=3, atol=2e-4)


def test_tokenizer_from_the_file(gguf_model):
    """transformers reads no config from olmoe / granite / granitemoe files: their tokenizer comes through the
    generic fast class, the same vocabulary as every other (here SmolLM2's)."""
    from kvserve.model_loader.gguf_loader import load_gguf_tokenizer
    from tests.helpers.checkpoints import builtin_tokenizer

    _, path, _ = gguf_model
    text = "Hello, world! How are you today?"
    assert load_gguf_tokenizer(path)(text).input_ids == builtin_tokenizer()(text).input_ids


def test_the_first_mixtral_files_one_tensor_per_expert(tmp_path):
    hf = make_checkpoint(str(tmp_path / "hf"), "mixtral", seed=5)
    path = str(tmp_path / "mixtral-per-expert.gguf")
    write_gguf(path, hf, "mixtral", per_expert=True)
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in dict(iter_gguf_tensors(path))
    _assert_logits_match(_engine(path), hf, seed=5, atol=1e-4)


def test_kv_calc_sizes_the_file(gguf_model, capsys):
    """kv-calc reads the GGUF metadata: the parameter count is the transformers model's."""
    from tests.helpers.kv_calc import kv_calc_json

    _, path, hf = gguf_model
    report = kv_calc_json(capsys, "--model", path, "--kv-dtype", "float32", "--context", "64")
    assert report["params_total"] == sum(p.numel() for p in hf.parameters())
    assert report["kv_bytes_per_token"] == 4 * 2 * hf.config.num_hidden_layers * attention_shape(hf.config)[1] * \
        attention_shape(hf.config)[2]


def test_phi3_window_from_the_metadata(tmp_path):
    """Phi-3-mini's converter writes its sliding window (0 for none, Phi-4's)."""
    import transformers as tf

    cfg = tf.Phi3Config(vocab_size=49152, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                        intermediate_size=128, num_hidden_layers=1, sliding_window=16, pad_token_id=0)
    path = str(tmp_path / "phi3-window.gguf")
    write_gguf(path, tf.AutoModelForCausalLM.from_config(cfg), "phi3")
    assert load_gguf_config(path).sliding_window == 16
