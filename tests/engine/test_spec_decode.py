"""Speculative decoding: exact (greedy tokens equal the oracle's and those without speculation, through chunked
prefill, preemption and prefix hits; sampled tokens follow the target's distribution, with a power check),
block accounting after every rollback, and a draft-length policy that turns itself off and back on."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from kvserve.config import EngineArgs, SpeculativeConfig
from kvserve.engine.engine import Engine
from kvserve.sample.rejection_sampler import rejection_sample
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.ngram import NgramProposer
from kvserve.spec_decode.policy import DraftLengthPolicy
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.engine import (ATTENTION_BACKENDS, check_engine_invariants, check_tables_cover_only_computed,
                                  run_requests)
from tests.helpers.oracles import assert_matches_hf, hf_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def _repetitive_requests(seed: int, num: int, max_prompt: int, max_out: int):
    """Prompts made of a few repeated segments (what prompt lookup feeds on), of many lengths."""
    rng = random.Random(seed)
    reqs = []
    for i in range(num):
        segments = [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 12))] for _ in range(3)]
        prompt = []
        target = rng.randint(1, max_prompt)
        while len(prompt) < target:
            prompt += rng.choice(segments)
        reqs.append((prompt[:target], rng.randint(1, max_out)))
    return reqs


def _run(engine: Engine, reqs, params_for, check_blocks: bool = True) -> dict:
    return run_requests(engine, reqs, params_for, check_tables_cover_only_computed if check_blocks else None)


# ---- proposer, config, rule ---------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_most_recent_longest_match():
    p = NgramProposer(min_n=1, max_n=3)
    toks = np.array([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    # suffix [6, 7]: matches at 1-2 (then 8) and 5-6 (then 9); [x, 6, 7] for n=3 matches neither fully
    assert p.propose_one(toks, 2) == [9, 2]
    toks = np.array([1, 2, 3, 4, 9, 9, 2, 3, 4, 8, 3, 4])
    # n=3 suffix [8, 3, 4] no match; n=2 [3, 4] matches at 2-3 (-> 9, 9) and 7-8 (-> 8, 3): most recent wins
    assert p.propose_one(toks, 3) == [8, 3, 4]
    assert p.propose_one(np.array([1, 2, 3]), 4) == []                      # the last token never occurred
    assert NgramProposer(2, 3).propose_one(np.array([4, 5, 1, 5]), 2) == []  # only a 1-token match
    assert p.propose_one(np.array([7, 7, 7, 7]), 5) == [7]                   # the match may overlap the suffix
    assert p.propose_one(np.array([1, 2, 1]), 0) == []


def test_speculative_config_parsing():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert cfg.num_speculative_tokens == 3 and cfg.prompt_lookup_max == 5 and cfg.adaptive
    assert SpeculativeConfig.parse("none") is None and SpeculativeConfig.parse(None) is None
    for bad, match in [('{"method": "medusa"}', "method"), ('{"num_speculative_tokens": 2}', "method"),
                       ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                       ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup"),
                       ('{"method": "ngram", "foo": 1}', "unknown"), ("[1]", "JSON object"), ("{", "JSON"),
                       ('{"method": "draft_model"}', "model")]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="speculative"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": -1})


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square goodness of fit; p = Q(df/2, stat/2), the chi-square survival function."""
    keep = probs * counts.sum() >= 5  # pool the rare cells, as the test's approximation needs
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
    if exp[-1] == 0:
        if obs[-1] > 0:
            return 0.0  # tokens the target cannot produce were emitted
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_rejection_rule_keeps_the_target_distribution_and_a_biased_rule_fails():
    """The standard rule with a non-trivial q: the first emitted token is distributed as p[0]. Power check:
    resampling from p instead of max(p - q, 0) after a rejection is detected at the same sample size."""
    gen = torch.Generator().manual_seed(0)
    vocab, n = 6, 6000
    p = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(1, vocab, generator=gen) * 1.5, dim=-1)
    counts, biased = np.zeros(vocab), np.zeros(vocab)
    for _ in range(n):
        draft = torch.multinomial(q[0], 1, generator=gen)
        counts[rejection_sample(p, q, draft, gen)[0]] += 1
        # the biased rule: on rejection, sample p itself
        if torch.rand((), generator=gen) * q[0, draft] <= p[0, draft]:
            biased[int(draft)] += 1
        else:
            biased[int(torch.multinomial(p[0], 1, generator=gen))] += 1
    assert _chi_square_p(counts, p[0].numpy()) > 1e-3
    assert _chi_square_p(biased, p[0].numpy()) < 1e-3


# ---- greedy exactness ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_greedy_with_ngram_equals_transformers_through_chunking_and_preemption(tiny_llama, backend):
    path, hf = tiny_llama
    reqs = _repetitive_requests(seed=4, num=16, max_prompt=300, max_out=40)
    engine, _ = assert_matches_hf(dict(model=path, num_gpu_blocks_override=64, max_num_batched_tokens=96,
                                       max_num_seqs=16, block_size=8, attention_backend=backend,
                                       speculative_config=NGRAM), reqs, hf, after_step=check_tables_cover_only_computed)
    stats = engine.scheduler.stats
    assert stats.num_preemptions > 0
    assert stats.num_spec_accepted_tokens > 0, "no draft was ever accepted: the test exercises nothing"
    assert stats.num_spec_draft_tokens > stats.num_spec_accepted_tokens, "no draft was ever rejected"


@pytest.mark.slow  # NOTE: ~15 s: in `make test`, not `make test-fast`
def test_speculation_changes_no_output_with_logprobs_stops_penalties_seeds_and_n(tiny_llama):
    """Greedy and seeded-sampled requests (penalties, min_tokens, logit_bias, stop strings and tokens, n=2,
    logprobs) give the same tokens with and without speculation; a seeded sample draws the same noise per
    token either way, so even sampled outputs match token for token."""
    path, _ = tiny_llama
    reqs = _repetitive_requests(seed=5, num=12, max_prompt=120, max_out=30)

    def params(i, max_tokens):
        kind = i % 6
        if kind == 0:
            return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
        if kind == 1:
            return SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=max_tokens, ignore_eos=True)
        if kind == 2:
            return SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.2, max_tokens=30,
                                  min_tokens=10, ignore_eos=True)
        if kind == 3:
            return SamplingParams(temperature=1.0, top_k=20, seed=i, n=2, max_tokens=max_tokens, logprobs=2,
                                  ignore_eos=True)
        if kind == 4:
            return SamplingParams(temperature=0, max_tokens=30, stop=["a", "e"], ignore_eos=True)
        return SamplingParams(temperature=0.7, min_p=0.05, seed=i, max_tokens=30, logit_bias={100: 3.0},
                              stop_token_ids=[reqs[i][0][0]], ignore_eos=True)

    results = []
    for spec in (None, NGRAM):
        engine = Engine(EngineArgs(model=path, num_gpu_blocks_override=256, max_num_batched_tokens=64,
                                   speculative_config=spec))
        results.append(_run(engine, reqs, params))
        if spec:
            assert engine.scheduler.stats.num_spec_accepted_tokens > 0
    plain, spec = results
    for rid in plain:
        for a, b in zip(plain[rid].outputs, spec[rid].outputs):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason,
                                                                            b.stop_reason), rid
            if a.logprobs is not None:
                for la, lb in zip(a.logprobs, b.logprobs):
                    assert la.keys() == lb.keys()
                    assert all(math.isclose(la[t].logprob, lb[t].logprob, abs_tol=1e-4) for t in la)
    assert any(o.metrics.num_accepted_tokens for o in spec.values())


# ---- the sampled distribution ------------------------------------------------------------------------
class _GuessProposer:
    """Drafts the target's most likely next tokens for some requests and a fixed token for others, so the
    rule sees drafts that are often right and drafts that are mostly wrong."""

    name = "guess"

    def __init__(self, guesses: dict[tuple[int, ...], list[int]]):
        self.guesses = guesses

    def propose(self, batch, rows, num_drafts):
        out = []
        for row, k in zip(rows, num_drafts):
            last = int(batch.token_ids[row, batch.num_tokens[row] - 1])
            out.append(self.guesses.get((last,), [7, 7, 7])[:k])
        return out


@torch.inference_mode()
def _processed_probs(hf, ids: list[int], temperature: float, top_k: int) -> torch.Tensor:
    logits = hf(torch.tensor([ids])).logits[0, -1].float() / temperature
    threshold = logits.topk(top_k).values[-1]
    return torch.softmax(logits.masked_fill(logits < threshold, float("-inf")), dim=-1)


@pytest.mark.slow  # NOTE: ~15 s: in `make test`, not `make test-fast`
def test_sampled_tokens_follow_the_target_distribution_and_a_biased_rule_fails(tiny_llama, monkeypatch):
    """Chi-square on the joint histogram of tokens 2-3 (both from one verification: a draft and the bonus
    or the resample) over many seeded requests, against the exact target distribution (temperature, top-k).
    Power check: accepting every draft, at the same sample size, is rejected."""
    path, hf = tiny_llama
    prompt = [11, 12, 13, 14, 15, 16]
    temp, top_k, n = 1.0, 3, 1500
    p1 = _processed_probs(hf, prompt, temp, top_k)
    first = p1.topk(top_k).indices.tolist()
    # Drafts: for each likely first token, its own likely next token (often right) and one unlikely token.
    guesses = {(t,): [_processed_probs(hf, prompt + [t], temp, top_k).argmax().item(), 5] for t in first}
    cells, probs = {}, []
    for t1 in first:
        p2 = _processed_probs(hf, prompt + [t1], temp, top_k)
        for t2 in p2.topk(top_k).indices.tolist():
            p3 = _processed_probs(hf, prompt + [t1, t2], temp, top_k)
            for t3 in p3.topk(top_k).indices.tolist():
                cells[(t1, t2, t3)] = len(probs)
                probs.append(float(p1[t1] * p2[t2] * p3[t3]))
    probs = np.array(probs + [0.0])

    def histogram(rule=None):
        if rule is not None:
            monkeypatch.setattr("kvserve.worker.sampling.accept_prefix", rule)
        engine = Engine(EngineArgs(model=path, num_gpu_blocks_override=512, max_num_seqs=256,
                                   max_num_batched_tokens=2048, enable_prefix_caching=False,
                                   speculative_config=dict(NGRAM, num_speculative_tokens=2)))
        engine.core.executor.worker.runner.proposer = _GuessProposer(guesses)
        finished = _run(engine, [(prompt, 3)] * n, lambda i, m: SamplingParams(
            temperature=temp, top_k=top_k, seed=1000 + i, max_tokens=3, ignore_eos=True), check_blocks=False)
        stats = engine.scheduler.stats
        counts = np.zeros(len(probs))  # the last cell: sequences outside the target's support
        for out in finished.values():
            counts[cells.get(tuple(out.outputs[0].token_ids), len(probs) - 1)] += 1
        return counts, stats

    counts, stats = histogram()
    assert stats.num_spec_drafts >= n * 0.9  # token 2 (and 3) came from a verification nearly always
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens
    assert _chi_square_p(counts, probs) > 1e-3
    biased, _ = histogram(rule=lambda sampled, drafts: len(drafts))
    assert _chi_square_p(biased, probs) < 1e-3


# ---- block accounting and the adaptive policy ---------------------------------------------------------
class _WrongProposer:
    name = "wrong"

    def propose(self, batch, rows, num_drafts):
        return [[1] * int(k) for k in num_drafts]  # token 1 (BOS) never follows in these requests


def test_rollback_returns_whole_blocks_and_keeps_accounting(tiny_llama):
    """4 wrong drafts per step with 4-token blocks: every verification spills into a new block, which the
    rollback gives back; tables never cover more than verified tokens, and the prefix cache only ever holds
    verified tokens (a second run of the same prompts hits it and gives the same tokens)."""
    path, _ = tiny_llama
    engine = Engine(EngineArgs(model=path, num_gpu_blocks_override=40, block_size=4, max_num_batched_tokens=64,
                               speculative_config=NGRAM))
    engine.core.executor.worker.runner.proposer = _WrongProposer()
    reqs = _repetitive_requests(seed=6, num=6, max_prompt=30, max_out=24)
    greedy = lambda i, m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)  # noqa: E731
    first = _run(engine, reqs, greedy)
    stats = engine.scheduler.stats
    assert stats.num_spec_draft_tokens > 0 and stats.num_spec_accepted_tokens == 0
    hits = stats.num_prefix_hit_tokens
    again = _run(engine, [(p + first[str(i)].outputs[0].token_ids[:8], 8) for i, (p, _) in enumerate(reqs)],
                 greedy)
    assert stats.num_prefix_hit_tokens > hits
    plain = Engine(EngineArgs(model=path, num_gpu_blocks_override=40, block_size=4, max_num_batched_tokens=64))
    ref = _run(plain, [(p + first[str(i)].outputs[0].token_ids[:8], 8) for i, (p, _) in enumerate(reqs)], greedy)
    for rid in ref:
        assert again[rid].outputs[0].token_ids == ref[rid].outputs[0].token_ids


def test_policy_turns_off_for_a_wrong_proposer_and_back_on_when_it_is_right():
    policy = DraftLengthPolicy(max_k=4)
    for n in range(1, 200):  # a step of n tokens costs 10 ms + 0.2 ms per token
        policy.observe_step(n % 40 + 1, 0.010 + 0.0002 * (n % 40 + 1))
    ids = [f"r{i}" for i in range(8)]
    chosen = []
    for _ in range(40):
        ks = policy.choose(ids, [10] * 8, base_tokens=8)
        chosen.append(sum(ks))
        for r, k in zip(ids, ks):
            if k:
                policy.observe_verification(r, k, 0)
    assert chosen[0] > 0 and sum(chosen[-16:]) <= 8 * 16 // 8 + 8, chosen  # only the periodic probes remain
    for _ in range(60):
        ks = policy.choose(ids, [10] * 8, base_tokens=8)
        for r, k in zip(ids, ks):
            if k:
                policy.observe_verification(r, k, k)
    assert policy.choose(ids, [10] * 8, base_tokens=8) == [4] * 8
    assert policy.choose(ids, [2, 0, 10, 10, 10, 10, 10, 10], base_tokens=8)[:2] == [2, 0]  # caps hold
    # When scoring a token costs as much as a step, nothing pays even at 90% acceptance.
    expensive = DraftLengthPolicy(max_k=4)
    for n in range(1, 100):
        expensive.observe_step(n, 0.010 * n)
    for r in ids:
        expensive.observe_verification(r, 4, 3)
    assert expensive.choose(ids, [10] * 8, base_tokens=8) == [0] * 8


def test_engine_turns_speculation_off_for_a_wrong_proposer_and_on_again(tiny_llama):
    path, hf = tiny_llama
    prompts = [[20 + i, 30 + i, 40 + i] for i in range(4)]
    want = {i: hf_greedy(hf, p, 120)[0] for i, p in enumerate(prompts)}

    class Switch:
        name = "switch"
        right = False

        def propose(self, batch, rows, num_drafts):
            out = []
            for row, k in zip(rows, num_drafts):
                toks = batch.token_ids[row, :batch.num_tokens[row]].tolist()
                i = prompts.index(toks[:3])
                made = len(toks) - 3
                out.append(want[i][made:made + int(k)] if self.right else [1] * int(k))
            return out

    engine = Engine(EngineArgs(model=path, num_gpu_blocks_override=128,
                               speculative_config=dict(NGRAM, adaptive=True)))
    proposer = Switch()
    engine.core.executor.worker.runner.proposer = proposer
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    drafted = []
    finished = {}
    for step in range(200):
        if step == 40:
            proposer.right = True
        before = engine.scheduler.stats.num_spec_draft_tokens
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        check_engine_invariants(engine)
        drafted.append(engine.scheduler.stats.num_spec_draft_tokens - before)
        if not engine.has_unfinished_requests():
            break
    assert sum(drafted[25:40]) <= 12, drafted[:40]   # wrong: only probes
    assert sum(drafted[40:100]) >= 30, drafted[40:100]  # right again: drafting resumed
    for i in range(4):
        assert finished[str(i)].outputs[0].token_ids == want[i]


def test_spec_metrics_json_roundtrip_of_the_cli_flag():
    args = EngineArgs(speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 2}))
    assert SpeculativeConfig.parse(args.speculative_config).num_speculative_tokens == 2


# ---- draft model --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """Another tiny random model (Qwen2 shape, other weights) with the target's vocabulary."""
    path = str(tmp_path_factory.mktemp("tiny_draft"))
    make_tiny_checkpoint(path, "qwen2", seed=7)
    return path


@pytest.mark.parametrize("draft", ["same", "other"])
def test_greedy_with_a_draft_model_equals_transformers_through_preemption(tiny_llama, tiny_draft, draft):
    """The target as its own draft (nearly every draft accepted: the draft's paged KV must track the target's
    through chunks, rollbacks and preemptions) and an unrelated draft (nearly all rejected)."""
    path, hf = tiny_llama
    spec = {"method": "draft_model", "model": path if draft == "same" else tiny_draft,
            "num_speculative_tokens": 3, "adaptive": False}
    reqs = _repetitive_requests(seed=8, num=12, max_prompt=200, max_out=30)
    engine, _ = assert_matches_hf(dict(model=path, num_gpu_blocks_override=36, max_num_batched_tokens=64,
                                       max_num_seqs=12, block_size=8, speculative_config=spec), reqs, hf)
    stats = engine.scheduler.stats
    assert stats.num_preemptions > 0 and stats.num_spec_drafts > 0
    rate = stats.num_spec_accepted_tokens / stats.num_spec_draft_tokens
    assert rate > 0.9 if draft == "same" else rate < 0.5


def test_seeded_sampling_is_the_same_with_a_draft_model(tiny_llama):
    path, _ = tiny_llama
    reqs = _repetitive_requests(seed=9, num=8, max_prompt=60, max_out=24)
    params = lambda i, m: SamplingParams(temperature=0.5, top_k=5, seed=i, max_tokens=m,  # noqa: E731
                                         ignore_eos=True, logprobs=1)
    outs = []
    for spec in (None, {"method": "draft_model", "model": path, "num_speculative_tokens": 4, "adaptive": False}):
        engine = Engine(EngineArgs(model=path, num_gpu_blocks_override=128, speculative_config=spec))
        outs.append(_run(engine, reqs, params, check_blocks=False))
    assert engine.scheduler.stats.num_spec_accepted_tokens > 0
    for rid in outs[0]:
        assert outs[0][rid].outputs[0].token_ids == outs[1][rid].outputs[0].token_ids


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    import transformers as tf

    tf.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2,
                   architectures=["LlamaForCausalLM"]).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(EngineArgs(model=tiny_llama[0], speculative_config={"method": "draft_model", "model": str(tmp_path)}))
