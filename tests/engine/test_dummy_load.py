"""--load-format dummy: random weights of a config's real shapes (model_loader/dummy.py), no checkpoint read."""
from __future__ import annotations

import json

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.model_loader.dummy import IdTokenizer, builtin_config_dir, initialize_dummy_weights
from kvserve.model_loader.loader import ModelSource, load_hf_config


@pytest.mark.parametrize("name, num_params", [
    ("Llama-3-8B", 8_030_261_248), ("Qwen2.5-7B", 7_615_616_512), ("SmolLM2-135M", 134_515_008)])
def test_builtin_configs_have_the_real_models_parameter_counts(name, num_params):
    """Built on the meta device (nothing allocated): the shapes add up to the published parameter counts."""
    from kvserve.layers.linear_methods import DenseMethod
    from kvserve.models.llama import LlamaForCausalLM
    from kvserve.model_loader.architectures import resolve_architecture
    from kvserve.attention.torch_ref import TorchRefBackend

    cfg = load_hf_config(ModelSource("hf", builtin_config_dir(name)))
    _, feats = resolve_architecture(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, feats, TorchRefBackend(), 16, DenseMethod())
    assert sum(p.numel() for p in model.parameters()) == num_params


def test_unknown_builtin_config_names_the_known_ones():
    with pytest.raises(ValueError, match="Llama-3-8B"):
        builtin_config_dir("nope")


def _tiny_config_dir(tmp_path) -> str:
    cfg = json.load(open(f"{builtin_config_dir('SmolLM2-135M')}/config.json"))
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_llm_runs_a_config_only_folder_with_token_id_prompts(tmp_path):
    from kvserve import LLM, SamplingParams

    path = _tiny_config_dir(tmp_path)
    llm = LLM(model=path, load_format="dummy", attention_backend="torch_ref", speculative_config=None,
              kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([[1, 2, 3], list(range(40))], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    assert all(0 <= t < 512 for o in outs for t in o.outputs[0].token_ids)
    assert outs[0].outputs[0].text == "".join(f" {t}" for t in outs[0].outputs[0].token_ids)
    again = LLM(model=path, load_format="dummy", attention_backend="torch_ref", speculative_config=None,
                kv_cache_memory="64MiB")
    assert again.generate([[1, 2, 3]], params)[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="token ids"):
        llm.generate("text needs a tokenizer", params)


def test_dummy_weights_are_seeded_and_shaped_like_a_checkpoint():
    from torch import nn

    a, b = nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4)), nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4))
    initialize_dummy_weights(a, seed=3)
    initialize_dummy_weights(b, seed=3)
    assert torch.equal(a[0].weight, b[0].weight) and 0.005 < a[0].weight.std() < 0.05
    assert torch.equal(a[0].bias, torch.zeros(4)) and torch.equal(a[1].weight, torch.ones(4))


def test_load_format_is_validated():
    with pytest.raises(ValueError, match="load_format"):
        EngineArgs(load_format="safetensors-please")
    with pytest.raises(ValueError, match="gguf"):
        EngineArgs(load_format="dummy", quantization="gguf")
    assert IdTokenizer().decode([5, 7]) == " 5 7"
