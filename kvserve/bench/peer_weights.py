"""The built-in model's weights in each peer's format, all from the one GGUF kvserve serves.

- `hf_folder`: a Hugging Face folder (safetensors + config + tokenizer, fp32), for vLLM and transformers;
- `f32_gguf`: the same GGUF with every tensor dequantized to F32, for llama.cpp;
- `q8_0_gguf`: the same GGUF with every quantized tensor requantized to Q8_0 (llama.cpp's int8 format);
- the OpenVINO IRs are exported from the HF folder by `optimum-cli` inside the OpenVINO venv (compare.py).

Every path is made once and reused: a file is written under a temporary name and renamed when complete,
so an interrupted run never leaves a half-written model that a later run would take for a good one.
"""
from __future__ import annotations

import os
import shutil

import gguf
import numpy as np


def hf_folder(gguf_path: str, out_dir: str) -> str:
    """Write a HF checkpoint of `gguf_path`: the config and fp32 tensors kvserve's loader reads from it."""
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    import torch
    from transformers import LlamaForCausalLM

    from kvserve.model_loader.gguf_loader import iter_gguf_tensors, load_gguf_config, load_gguf_tokenizer

    tmp = out_dir + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    config = load_gguf_config(gguf_path)
    config.torch_dtype = torch.float32
    model = LlamaForCausalLM(config)
    # strict: every weight the HF model has must come from the file (a tied LM head is not a separate key)
    missing, unexpected = model.load_state_dict(dict(iter_gguf_tensors(gguf_path)), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"{gguf_path}: weights do not match the HF model: missing {missing}, extra {unexpected}")
    model.save_pretrained(tmp)
    load_gguf_tokenizer(gguf_path).save_pretrained(tmp)
    os.replace(tmp, out_dir)
    return out_dir


def f32_gguf(gguf_path: str, out_path: str) -> str:
    """Copy `gguf_path` with its metadata unchanged and every tensor dequantized to F32 (file type ALL_F32)."""
    return requantized_gguf(gguf_path, out_path, gguf.GGMLQuantizationType.F32)


def q8_0_gguf(gguf_path: str, out_path: str) -> str:
    """Copy `gguf_path` with every quantized tensor (the 2-D weights) dequantized and requantized to Q8_0 by
    the `gguf` package (file type MOSTLY_Q8_0); the F32 tensors (norms) stay F32, as llama-quantize leaves them."""
    return requantized_gguf(gguf_path, out_path, gguf.GGMLQuantizationType.Q8_0)


_FILE_TYPES = {gguf.GGMLQuantizationType.F32: gguf.LlamaFileType.ALL_F32,
               gguf.GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}


def requantized_gguf(gguf_path: str, out_path: str, qtype: gguf.GGMLQuantizationType) -> str:
    if os.path.isfile(out_path):
        return out_path
    reader = gguf.GGUFReader(gguf_path, "r")
    arch = reader.fields["general.architecture"].contents()
    tmp = out_path + ".partial"
    writer = gguf.GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        # NOTE: the writer emits the GGUF.* header fields and general.architecture itself.
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.name == "general.file_type":
            value = int(_FILE_TYPES[qtype])
        main_type = field.types[0]
        sub_type = field.types[-1] if main_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, main_type, sub_type=sub_type)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        # GGML lists dimensions innermost first; numpy wants them outermost first.
        data = data.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if qtype == gguf.GGMLQuantizationType.F32 or tensor.tensor_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, data)
        else:
            writer.add_tensor(tensor.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out_path)
    return out_path
