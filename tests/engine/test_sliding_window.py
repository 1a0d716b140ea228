"""Sliding-window models through the engine against transformers (eager attention, its sliding-window masks),
on every CPU attention backend: a tiny Mistral windowing every layer (W 12) and a tiny Qwen2 with
use_sliding_window and max_window_layers (layer 0 full attention, layers 1-2 windowed, W 10), every weight
randomised. Sequences run 3-8 windows long. Compared: logits of a mixed batch through the paged cache, greedy
tokens through chunked prefill with preemption, a prefix-cache hit and n-gram drafts (decode rows verifying
drafts), and an int8/fp8 cache; block invariants after every step.
"""
from __future__ import annotations

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.sampling_params import SamplingParams
from tests.helpers.architectures import make_checkpoint
from tests.helpers.engine import ATTENTION_BACKENDS, run_last_after_prefix, run_to_completion
from tests.helpers.oracles import assert_logits_match_hf, assert_matches_hf, hf_greedy, mixed_batch

WINDOWS = {"mistral_sliding": [12, 12], "qwen2_sliding": [None, 10, 10]}


@pytest.fixture(scope="module", params=sorted(WINDOWS))
def checkpoint(request, tmp_path_factory):
    """(arch, path, transformers model), written once per module."""
    path = str(tmp_path_factory.mktemp(request.param))
    return request.param, path, make_checkpoint(path, request.param, seed=2)


def _engine(path: str, backend: str, **kwargs) -> Engine:
    kwargs = {"num_gpu_blocks_override": 64, "block_size": 8, **kwargs}
    return Engine(EngineArgs(model=path, attention_backend=backend, **kwargs))


def test_layers_take_the_configured_windows(checkpoint):
    arch, path, _ = checkpoint
    model = _engine(path, "torch_ref").core.executor.worker.runner.model
    assert [layer.self_attn.sliding_window for layer in model.layers] == WINDOWS[arch]


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("block_size", [8, 16])
def test_logits_of_a_mixed_batch_match_transformers(checkpoint, backend, block_size):
    """Fresh prompts, chunks after up to 40 cached tokens, decodes after 20 and 89: windows start inside a block,
    on a block boundary and many blocks in."""
    arch, path, hf = checkpoint
    engine = _engine(path, backend, block_size=block_size)
    assert_logits_match_hf(engine, hf, mixed_batch(seed=len(arch)), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_greedy_tokens_with_chunked_prefill_and_preemption(checkpoint, backend):
    """Prompts of 3-4 windows in chunks of 16 tokens, decoding several windows further, in a cache too small for
    all of them at once (requests are preempted and recomputed)."""
    _, path, hf = checkpoint
    g = torch.Generator().manual_seed(3)
    reqs = [(torch.randint(0, 49152, (n,), generator=g).tolist(), m) for n, m in [(36, 24), (45, 16), (30, 30),
                                                                                   (5, 20)]]
    engine = _engine(path, backend, num_gpu_blocks_override=8, max_num_batched_tokens=16, max_num_seqs=4)
    engine, _ = assert_matches_hf(None, reqs, hf, engine=engine)
    assert engine.scheduler.stats.num_preemptions > 0


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_greedy_tokens_after_a_prefix_cache_hit(checkpoint, backend):
    """Three prompts behind a 40-token prefix (over three windows), the last after the others finish: its cached
    prefix is read through the window like any context."""
    _, path, hf = checkpoint
    engine = _engine(path, backend, max_num_batched_tokens=16)
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, 49152, (40,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 49152, (n,), generator=g).tolist() for n in (3, 11, 7)]
    done = run_last_after_prefix(engine, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert done[str(len(prompts) - 1)].num_cached_tokens >= 32
    for i, prompt in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == hf_greedy(hf, prompt, 12)[0], f"request {i}"


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_ngram_drafts_verified_through_windows(checkpoint, backend):
    """Several decode rows of one request in a pass (draft verification): each row sees its own window."""
    _, path, hf = checkpoint
    engine = _engine(path, backend, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_min": 1, "prompt_lookup_max": 2,
                                                        "adaptive": False})
    prompt = [5, 6, 7, 8] * 8
    engine.add_request("0", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    done = run_to_completion(engine)
    assert engine.scheduler.stats.num_spec_drafts > 0
    assert done["0"].outputs[0].token_ids == hf_greedy(hf, prompt, 30)[0]


# About twice the largest logit difference seen on these checkpoints (their randomised norms widen activations
# beyond tests/engine/test_kv_quant.py's tiny Llama); the kernel's windowed reads of a quantized cache are
# checked exactly against dense attention in tests/unit/test_attention_window.py.
@pytest.mark.parametrize("kv_cache_dtype, atol", [("int8", 0.1), ("fp8_e4m3", 0.4)])
@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_quantized_cache_logits_close_to_transformers(checkpoint, kv_cache_dtype, atol, backend):
    """An int8/fp8 cache (rotated K/V, block scales) read through windows."""
    arch, path, hf = checkpoint
    engine = _engine(path, backend, kv_cache_dtype=kv_cache_dtype)
    assert_logits_match_hf(engine, hf, mixed_batch(seed=len(arch) + 1), atol=atol, rtol=0)
