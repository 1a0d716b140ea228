"""The landed architectures on checkpoints of other shapes and seeds than tests/engine/test_new_architectures.py's,
against transformers: head_dim other than hidden / heads, one KV head and as many KV heads as query heads, tied
embeddings, an odd vocabulary, 4 and 16 experts with 1 and 4 per token, top-k renormalised or not, Mixtral and
Phi-3 with a sliding window shorter than the sequences, Qwen2-MoE's shared expert at another width, Phi-3 with
RoPE over part of each head (Phi-4-mini) and with longrope scaling (Phi-3 128k), Granite with other multipliers,
biased projections (attention_bias, mlp_bias), activations other than SiLU.

Each variant, on each CPU attention backend (the reference one with --all-backends): every checkpoint tensor
consumed, the experts each token picks equal transformers' (before the logits: a near-tie could flip one), the
logits of a mixed batch through the paged cache, and greedy tokens with chunked prefill and a prefix-cache hit,
block invariants after every step.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.sampling_params import SamplingParams
from tests.helpers.architectures import assert_every_tensor_consumed, chosen_experts, make_checkpoint
from tests.helpers.engine import ATTENTION_BACKENDS, run_last_after_prefix, run_to_completion
from tests.helpers.oracles import assert_logits_match_hf, hf_greedy, mixed_batch


def _longrope(rotary_dim: int, original: int = 32) -> dict:
    """Phi-3 128k-style longrope over `rotary_dim` dims, switching at `original` tokens (factor sets far apart,
    so that a request rotated with the wrong set fails)."""
    n = rotary_dim // 2
    return dict(original_max_position_embeddings=original,
                rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(n)],
                              "long_factor": [2.0 + 0.7 * i for i in range(n)]})


# (id, architecture, seed, config overrides)
VARIANTS = [
    ("qwen3_moe-head_dim24-kv1-E4-k1", "qwen3_moe", 11,
     dict(head_dim=24, num_key_value_heads=1, num_experts=4, num_experts_per_tok=1, norm_topk_prob=False)),
    ("qwen3_moe-kv4-E16-k4-tied-vocab50021", "qwen3_moe", 12,
     dict(num_key_value_heads=4, num_experts=16, num_experts_per_tok=4, tie_word_embeddings=True,
          vocab_size=50021, mlp_only_layers=[], decoder_sparse_step=2)),
    ("mixtral-window8-E4-k1", "mixtral", 13,
     dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=1)),
    ("mixtral-head_dim24-E16-k4-kv4-tied", "mixtral", 14,
     dict(head_dim=24, num_local_experts=16, num_experts_per_tok=4, num_key_value_heads=4,
          tie_word_embeddings=True)),
    ("qwen2_moe-shared80-renorm-E16-k4-kv1", "qwen2_moe", 15,
     dict(shared_expert_intermediate_size=80, norm_topk_prob=True, num_experts=16, num_experts_per_tok=4,
          num_key_value_heads=1, decoder_sparse_step=1, mlp_only_layers=[0])),
    ("qwen3_moe-window8", "qwen3_moe", 27, dict(use_sliding_window=True, sliding_window=8)),
    # layers 0 and 2 windowed (transformers' layer_types from max_window_layers), 1 and 3 not
    ("qwen2_moe-window8-layer_types", "qwen2_moe", 28,
     dict(use_sliding_window=True, sliding_window=8, max_window_layers=3)),
    ("olmoe-E4-k1-renorm-noclip-kv4", "olmoe", 16,
     dict(num_experts=4, num_experts_per_tok=1, norm_topk_prob=True, clip_qkv=None, num_key_value_heads=4)),
    ("olmoe-E4-k4", "olmoe", 26, dict(num_experts=4, num_experts_per_tok=4)),  # every expert, every token
    ("olmoe-E16-k4-kv1-vocab50021", "olmoe", 17,
     dict(num_experts=16, num_experts_per_tok=4, num_key_value_heads=1, vocab_size=50021)),
    ("granitemoe-E16-k4-kv1-tied-multipliers", "granitemoe", 18,
     dict(num_local_experts=16, num_experts_per_tok=4, num_key_value_heads=1, tie_word_embeddings=True,
          embedding_multiplier=12.0, attention_multiplier=0.05, residual_multiplier=0.22, logits_scaling=8.0)),
    ("granitemoe-E4-k1-kv4", "granitemoe", 19,
     dict(num_local_experts=4, num_experts_per_tok=1, num_key_value_heads=4)),
    ("phi3-partial0.75-kv1-tied", "phi3", 20,
     dict(partial_rotary_factor=0.75, num_key_value_heads=1, tie_word_embeddings=True)),
    ("phi3-longrope", "phi3", 21, _longrope(16)),
    # transformers' Qwen3-MoE default RoPE rotates whole heads whatever partial_rotary_factor says
    ("qwen3_moe-partial_rotary_factor", "qwen3_moe", 36, dict(partial_rotary_factor=0.5)),
    ("phi3-longrope-partial0.5-kv4", "phi3", 22,
     dict(partial_rotary_factor=0.5, num_key_value_heads=4, **_longrope(8))),
    ("phi3-window8", "phi3", 23, dict(sliding_window=8)),
    ("granite-kv1-tied-multipliers", "granite", 24,
     dict(num_key_value_heads=1, tie_word_embeddings=True, embedding_multiplier=3.0, attention_multiplier=0.4,
          residual_multiplier=0.8, logits_scaling=0.5)),
    ("granite-kv4-vocab50021", "granite", 25, dict(num_key_value_heads=4, vocab_size=50021)),
    # biased projections (attention_bias: q, k, v, o; mlp_bias: the dense MLP's)
    ("granite-attention_bias-mlp_bias", "granite", 31, dict(attention_bias=True, mlp_bias=True)),
    ("qwen3_moe-attention_bias", "qwen3_moe", 32, dict(attention_bias=True)),
    ("olmoe-attention_bias", "olmoe", 33, dict(attention_bias=True)),
    ("granitemoe-attention_bias", "granitemoe", 34, dict(attention_bias=True)),
    ("qwen2_moe-no_qkv_bias", "qwen2_moe", 35, dict(qkv_bias=False)),
    # activations other than SiLU (transformers' ACT2FN)
    ("qwen2_moe-gelu", "qwen2_moe", 29, dict(hidden_act="gelu")),
    ("phi3-gelu_pytorch_tanh", "phi3", 30, dict(hidden_act="gelu_pytorch_tanh")),
]


@pytest.fixture(scope="module", params=VARIANTS, ids=[v[0] for v in VARIANTS])
def variant(request, tmp_path_factory):
    """(architecture, path, transformers model) of one variant, written once per module."""
    name, arch, seed, overrides = request.param
    path = str(tmp_path_factory.mktemp(name.replace(".", "_")))
    return arch, path, make_checkpoint(path, arch, seed=seed, **overrides)


def _engine(path: str, backend: str = "auto", **kwargs) -> Engine:
    return Engine(EngineArgs(model=path, num_gpu_blocks_override=64, attention_backend=backend, **kwargs))


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_tensors_experts_and_logits_match_transformers(variant, backend):
    arch, path, hf = variant
    engine = _engine(path, backend)
    assert_every_tensor_consumed(engine, path, stacked=arch == "granitemoe")
    batch = mixed_batch(seed=len(path))
    ours, theirs = chosen_experts(engine, hf, batch[0][0])
    assert len(ours) == len(theirs) and bool(ours) == (arch not in ("phi3", "granite"))
    for got, want in zip(ours, theirs):
        assert torch.equal(got, want)
    assert_logits_match_hf(engine, hf, batch, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_greedy_tokens_match_transformers_with_chunked_prefill_and_prefix_hit(variant, backend):
    """Two prompts sharing a 40-token prefix and a short one, in 16-token chunks; the last after the others
    finish (a prefix-cache hit)."""
    _, path, hf = variant
    engine = _engine(path, backend, max_num_batched_tokens=16, enable_chunked_prefill=True)
    g = torch.Generator().manual_seed(len(path))
    prefix = torch.randint(0, 49152, (40,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 49152, (5,), generator=g).tolist(),
               torch.randint(0, 49152, (12,), generator=g).tolist(),
               prefix + torch.randint(0, 49152, (9,), generator=g).tolist()]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    done = run_last_after_prefix(engine, prompts, params)
    assert done["2"].num_cached_tokens >= 32
    for i, prompt in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == hf_greedy(hf, prompt, 8)[0], f"request {i}"


def test_rope_tables_are_whole_head_and_single_without_the_variants():
    """The common case keeps its cost: one [P, head_dim] table, no longrope switch (no position offsets)."""
    from kvserve.model_loader.loader import normalize_config
    from kvserve.models.llama import RotaryEmbedding
    from tests.helpers.architectures import tiny_config

    rope = RotaryEmbedding(normalize_config(tiny_config("phi3")), 64)
    assert rope.cos.shape == (64, 16) and rope.long_switch is None


def test_longrope_tables_and_which_requests_read_the_long_one():
    """Short factors up to M = original_max_position_embeddings positions (the only table when max_model_len
    <= M), long ones stacked below; a request whose prompt is longer than M reads the long table."""
    from kvserve.model_loader.loader import normalize_config
    from kvserve.models.llama import RotaryEmbedding
    from kvserve.worker.input_batch import CachedRequestState
    from kvserve.worker.step_inputs import rope_positions
    from tests.helpers.architectures import tiny_config

    cfg = normalize_config(tiny_config("phi3", **_longrope(16)))
    assert RotaryEmbedding(cfg, 32).long_switch is None
    rope = RotaryEmbedding(cfg, 100)
    assert rope.long_switch == (32, 100) and rope.cos.shape == (200, 16)
    assert not torch.equal(rope.cos[:100], rope.cos[100:])

    class Batch:  # the one InputBatch field rope_positions reads
        def __init__(self):
            self.states = [CachedRequestState(str(n), [0] * n, SamplingParams(), (), None, 0) for n in (33, 32)]

    # request 0: a 33-token prompt's first chunk; 1: a 32-token prompt's decode at 40 (past M: still short)
    got = rope_positions(Batch(), np.arange(2), np.array([0, 0, 0, 1]), np.array([0, 1, 2, 40]), rope.long_switch)
    assert got.tolist() == [100, 101, 102, 40]


@pytest.fixture(scope="module")
def longrope_phi3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("phi3_longrope"))
    return path, make_checkpoint(path, "phi3", seed=31, **_longrope(16))


@pytest.mark.parametrize("long_first", [True, False])
def test_longrope_prompts_either_side_of_the_switch_share_no_blocks(longrope_phi3, long_first):
    """A 44-token prompt (long factors) and a 28-token one (short; 4 tokens more stay within M = 32) share a
    24-token prefix, one after the other: the second hits no block of the first (their keys are rotated with
    other factors), and both equal transformers'."""
    path, hf = longrope_phi3
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, 49152, (24,), generator=g).tolist()
    long, short = prefix + torch.randint(0, 49152, (20,), generator=g).tolist(), prefix + [11, 12, 13, 14]
    prompts = [long, short] if long_first else [short, long]
    engine = _engine(path)
    done = run_last_after_prefix(engine, prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert done["1"].num_cached_tokens == 0
    for i, prompt in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == hf_greedy(hf, prompt, 4)[0], f"request {i}"


def test_longrope_output_crossing_the_switch_equals_transformers_until_it(longrope_phi3):
    """The documented caveat (models/llama.py RotaryEmbedding): a 28-token prompt keeps the short factors past
    M = 32, where transformers recomputes the whole sequence with the long ones; its tokens up to the crossing
    are transformers'."""
    path, hf = longrope_phi3
    prompt = torch.randint(0, 49152, (28,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = _engine(path)
    engine.add_request("0", prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    got = run_to_completion(engine)
    assert got["0"].outputs[0].token_ids[:5] == hf_greedy(hf, prompt, 10)[0][:5]
