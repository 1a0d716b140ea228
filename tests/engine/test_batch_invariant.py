"""--batch-invariant on a tiny checkpoint wide enough that the default kernels are not row-invariant
(tests/helpers/invariance.make_wide_checkpoint): one request's logits are bit-identical (torch.equal) alone and among
1..63 other requests, under chunk budgets 16..512, after a prefix-cache hit, through a preemption and with ngram
speculative decoding; seeded sampling gives the same tokens; the mode still gives transformers' tokens, and what
it cannot keep invariant is refused at start-up. Block invariants after every step, every block free at the end
(tests/helpers/invariance.py)."""
from __future__ import annotations

import random

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.sampling_params import SamplingParams
from tests.helpers.architectures import make_checkpoint
from tests.helpers.invariance import assert_same_logits, make_wide_checkpoint, request_logits, run_recorded
from tests.helpers.oracles import assert_matches_hf

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# NOTE: a prompt that repeats itself, so that ngram speculation proposes drafts and some are accepted
TARGET = [5, 9, 14, 3, 22, 7, 5, 9, 14, 3, 22, 7, 5, 9, 14, 3, 22, 7, 31, 40, 41, 42, 43, 44, 45, 46, 47, 48,
          49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61]


def _others(n: int, seed: int) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(seed)
    return [(f"o{i}", [rng.randrange(1, 1000) for _ in range(rng.randrange(2, 70))],
             SamplingParams(temperature=0.0, max_tokens=rng.choice([1, 4, 9]), ignore_eos=True)) for i in range(n)]


def _kwargs(path: str, **overrides) -> dict:
    return dict(model=path, batch_invariant=True, num_gpu_blocks_override=256, max_model_len=256,
                speculative_config="none") | dict(max_num_batched_tokens=512) | overrides


def _logits(path: str, *, others: int = 0, seed: int = 0, params: SamplingParams = GREEDY, first=(),
            first_batch=(), known_drafts=None, **overrides):
    """The target's logits by position, its tokens and its final output, run with `others` other requests
    (arriving first)."""
    reqs = list(first_batch) + _others(others, seed) + [("t", TARGET, params)]
    engine, rec, done = run_recorded(_kwargs(path, **overrides), reqs, first=list(first), known_drafts=known_drafts)
    return request_logits(rec, done, "t", TARGET), list(done["t"].outputs[0].token_ids), engine, done["t"]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("wide_qwen2"))
    return path, make_wide_checkpoint(path)


@pytest.fixture(scope="module")
def wide(wide_model):
    return wide_model[0]


@pytest.fixture(scope="module")
def alone(wide):
    """The target alone, whole prompt in one step, no speculation: what every other run must equal."""
    logits, tokens, *_ = _logits(wide)
    assert len(tokens) == MAX_TOKENS
    return logits, tokens


@pytest.mark.parametrize("others,budget", [(1, 512), (3, 16), (16, 48), (63, 512)])
def test_logits_do_not_depend_on_batch_mates_or_chunk_budget(wide, alone, others, budget):
    logits, tokens, *_ = _logits(wide, others=others, seed=others, max_num_batched_tokens=budget)
    assert tokens == alone[1]
    assert_same_logits(logits, alone[0], MAX_TOKENS)


def test_logits_same_after_a_prefix_cache_hit(wide, alone):
    # a request sharing the target's first 32 tokens (two blocks) leaves them in the prefix cache
    sharer = ("s", TARGET[:32] + [900, 901], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    logits, tokens, _, out = _logits(wide, others=5, first=[sharer], max_num_batched_tokens=48)
    assert out.num_cached_tokens == 32
    assert tokens == alone[1]
    assert_same_logits(logits, alone[0], MAX_TOKENS)


def test_logits_same_through_a_preemption(wide, alone):
    # 12 blocks of 16 tokens; five requests growing to 80 tokens (5 blocks each) beside the target: some are
    # preempted and recomputed
    rng = random.Random(3)
    growing = [(f"g{i}", [rng.randrange(1, 1000) for _ in range(20)],
                SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)) for i in range(5)]
    logits, tokens, engine, _ = _logits(wide, first_batch=growing, num_gpu_blocks_override=12,
                                        max_num_batched_tokens=64)
    assert engine.scheduler.stats.num_preemptions > 0
    assert tokens == alone[1]
    assert_same_logits(logits, alone[0], MAX_TOKENS)


def test_verification_rows_give_decode_logits(wide, alone):
    # the target's drafts are its own greedy continuation (all accepted: every verification row scores a real
    # position); its batch mates get ngram drafts
    ngram = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3, '
             '"adaptive": false}')
    logits, tokens, _, out = _logits(wide, others=3, seed=5, speculative_config=ngram,
                                     known_drafts={"t": TARGET + alone[1]})
    assert out.metrics.num_accepted_tokens >= MAX_TOKENS // 2
    assert tokens == alone[1]
    assert_same_logits(logits, alone[0], MAX_TOKENS)


def test_seeded_sampling_same_alone_and_in_a_batch(wide):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone_logits, alone_tokens, *_ = _logits(wide, params=seeded)
    logits, tokens, *_ = _logits(wide, others=16, seed=9, params=seeded, max_num_batched_tokens=48)
    assert tokens == alone_tokens
    assert_same_logits(logits, alone_logits, MAX_TOKENS)


def test_bfloat16_logits_do_not_depend_on_the_batch(wide):
    base, base_tokens, *_ = _logits(wide, dtype="bfloat16")
    logits, tokens, *_ = _logits(wide, others=16, seed=4, dtype="bfloat16", max_num_batched_tokens=16)
    assert tokens == base_tokens
    assert_same_logits(logits, base, MAX_TOKENS)


def test_invariant_mode_gives_transformers_tokens(wide_model):
    path, hf = wide_model
    rng = random.Random(1)
    reqs = [([rng.randrange(1, 1000) for _ in range(rng.randrange(3, 40))], rng.choice([2, 5, 17])) for _ in range(6)]
    engine, _ = assert_matches_hf(dict(model=path, batch_invariant=True, num_gpu_blocks_override=64, max_model_len=128,
                                       max_num_batched_tokens=32), reqs, hf)
    runner = engine.core.executor.worker.runner
    assert runner.model.lm_head.method.name == "batch-invariant" and runner.backend.fixed_order


def test_default_mode_keeps_its_kernels(wide):
    engine = Engine(EngineArgs(model=wide, num_gpu_blocks_override=16, max_model_len=64))
    runner = engine.core.executor.worker.runner
    assert runner.model.lm_head.method.name != "batch-invariant"
    assert not runner.backend.fixed_order and runner.backend.cascade


def test_vllm_environment_spelling_turns_it_on(wide, monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    engine = Engine(EngineArgs(model=wide, num_gpu_blocks_override=16, max_model_len=64))
    assert engine.core.executor.worker.runner.backend.fixed_order
    assert engine.config.device.batch_invariant


@pytest.mark.parametrize("flags,match", [
    (dict(quantization="int8"), "--quantization int8"),
    (dict(kv_cache_dtype="int8"), "--kv-cache-dtype int8"),
    (dict(tensor_parallel_size=2), "--tensor-parallel-size"),
    (dict(enable_lora=True), "--enable-lora"),
    (dict(attention_backend="torch_ref"), "--attention-backend torch_ref"),
])
def test_what_it_cannot_keep_invariant_is_refused(flags, match):
    with pytest.raises(ValueError, match=f"--batch-invariant cannot be kept with {match}"):
        EngineArgs(batch_invariant=True, **flags)


def test_moe_model_is_refused(tmp_path):
    path = str(tmp_path)
    make_checkpoint(path, "mixtral")
    with pytest.raises(ValueError, match="--batch-invariant cannot be kept with MixtralForCausalLM: the MoE"):
        Engine(EngineArgs(model=path, batch_invariant=True, num_gpu_blocks_override=16, max_model_len=64))


def test_logits_rows_are_float32_bits_not_just_close(wide, alone):
    """The comparison is of bits: a run whose steps differ (budget 16) still equals the lone run exactly."""
    logits, *_ = _logits(wide, max_num_batched_tokens=16)
    pos = max(logits)
    assert logits[pos].dtype == torch.float32 and torch.equal(logits[pos], alone[0][pos])
