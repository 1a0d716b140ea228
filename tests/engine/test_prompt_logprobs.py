"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's): each prompt token's logprob, rank and top-k
alternatives equal `transformers`' log_softmax over the same prompt, whatever the batch (decodes, speculative
verification), the prefill chunking, the prefix cache and preemption; one entry per prompt token, None
first. Block invariants are checked after every step."""
from __future__ import annotations

import random

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.request import RequestStatus
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from tests.helpers.engine import ATTENTION_BACKENDS, step_until_idle

TOL = 1e-4  # fp32 on both sides


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def _greedy(max_tokens: int = 6, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@torch.inference_mode()
def _hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """[P, vocab]: row j is the distribution of token j + 1 given prompt[:j + 1]."""
    return hf(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)


def _check(prompt_logprobs, prompt: list[int], ref: torch.Tensor, k: int, tokenizer=None) -> None:
    """Each entry against the reference: the prompt token's logprob and rank, and the k alternatives (their
    ranks 1..k, their logprobs the reference's k largest; near-ties may swap which token holds a rank)."""
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry, row, token = prompt_logprobs[i], ref[i - 1], prompt[i]
        want = row[token].item()
        got = entry[token]
        assert abs(got.logprob - want) < TOL, (i, got.logprob, want)
        # the rank rule: tokens at least as likely as the prompt token, itself included
        lo, hi = int((row > want + TOL).sum()) + 1, int((row >= want - TOL).sum())
        assert lo <= got.rank <= hi, (i, got.rank, lo, hi)
        top_values = row.topk(k).values.tolist() if k else []
        by_rank = {lp.rank: (tid, lp) for tid, lp in entry.items() if tid != token or lp.rank <= k}
        assert set(by_rank) >= set(range(1, k + 1)), (i, sorted(by_rank))
        for r in range(1, k + 1):
            tid, lp = by_rank[r]
            assert abs(lp.logprob - top_values[r - 1]) < TOL and abs(row[tid].item() - lp.logprob) < TOL, (i, r)
        assert len(entry) <= k + 1
        if tokenizer is not None:
            assert all(lp.decoded_token == tokenizer.decode([tid]) for tid, lp in entry.items())


def _engine(path: str, backend: str = "cpu_paged", **kw) -> Engine:
    args = dict(model=path, num_gpu_blocks_override=128, max_model_len=512, max_num_batched_tokens=64,
                attention_backend=backend)
    return Engine(EngineArgs(**{**args, **kw}))


# ---- the batch ----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_mixed_batch_with_decodes_and_verification_matches_transformers(tiny_llama, backend):
    """Ordinary requests decode (verifying ngram drafts: speculation is on by default) while a request with
    prompt logprobs prefills in chunks beside them; a k=0 one asks for the prompt tokens' logprobs alone.
    The ordinary requests' tokens are those of the same run without prompt logprobs."""
    path, hf = tiny_llama
    loop = [11, 12, 13, 14] * 6  # repetitive: the ngram proposer finds drafts in the outputs it continues
    plain = {f"plain{i}": (loop[i:] + _prompt(i, 4), 40) for i in range(3)}
    wanted = {"plp3": (_prompt(10, 150), 3, 5), "plp0": (_prompt(11, 37), 0, 4)}

    def run(with_prompt_logprobs: bool) -> tuple[dict, Engine]:
        engine = _engine(path, backend)
        for rid, (prompt, max_tokens) in plain.items():
            engine.add_request(rid, prompt, _greedy(max_tokens))
        for _ in range(3):  # the plain requests are decoding by now
            engine.step()
        for rid, (prompt, k, max_tokens) in wanted.items():
            engine.add_request(rid, prompt, _greedy(max_tokens, prompt_logprobs=k if with_prompt_logprobs else None))
        return step_until_idle(engine), engine

    done, engine = run(True)
    assert engine.scheduler.stats.num_spec_drafts > 0  # some decodes verified drafts in these batches
    for rid, (prompt, k, _) in wanted.items():
        _check(done[rid].prompt_logprobs, prompt, _hf_logprobs(hf, prompt), k, engine.tokenizer)
    assert all(done[rid].prompt_logprobs is None for rid in plain)
    baseline, _ = run(False)
    assert {r: o.outputs[0].token_ids for r, o in done.items()} == {
        r: o.outputs[0].token_ids for r, o in baseline.items()}


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("budget", [1, 3, 16, 4096])
def test_chunked_prefill_at_any_chunk_size(tiny_llama, backend, budget):
    """Two prompts share each step's token budget, so chunks end anywhere (a block, the budget, the other
    request's share); the entries are the same at every chunk size."""
    path, hf = tiny_llama
    prompts = {"a": _prompt(20, 45), "b": _prompt(21, 18)}
    engine = _engine(path, backend, max_num_batched_tokens=budget, max_num_seqs=4)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, _greedy(3, prompt_logprobs=2))
    done = step_until_idle(engine)
    for rid, prompt in prompts.items():
        _check(done[rid].prompt_logprobs, prompt, _hf_logprobs(hf, prompt), 2)


def test_one_token_prompt_has_only_the_none_entry(tiny_llama):
    engine = _engine(tiny_llama[0])
    engine.add_request("one", [42], _greedy(2, prompt_logprobs=3))
    assert step_until_idle(engine)["one"].prompt_logprobs == [None]


# ---- prefix cache and preemption ----------------------------------------------------------------
def test_prefix_cache_hit_recomputes_them(tiny_llama):
    """Recompute (vLLM v1's choice): a request that needs prompt logprobs reads no cached blocks, so an
    identical prompt already in the cache still gets identical entries; its blocks still serve others."""
    path, hf = tiny_llama
    prompt = _prompt(30, 70)  # 4 full blocks of 16
    engine = _engine(path)
    engine.add_request("warm", prompt, _greedy(2))
    step_until_idle(engine)
    engine.add_request("first", prompt, _greedy(4, prompt_logprobs=2))
    first = step_until_idle(engine)["first"]
    engine.add_request("again", prompt, _greedy(4, prompt_logprobs=2))
    again = step_until_idle(engine)["again"]
    assert first.num_cached_tokens == again.num_cached_tokens == 0
    _check(first.prompt_logprobs, prompt, _hf_logprobs(hf, prompt), 2)
    assert again.prompt_logprobs == first.prompt_logprobs
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    engine.add_request("plain", prompt, _greedy(2))
    assert step_until_idle(engine)["plain"].num_cached_tokens == 64


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_preemption_neither_duplicates_nor_loses_entries(tiny_llama, backend):
    """An 8-block pool: the older request's decode preempts the one computing its prompt logprobs, in the
    middle of its prompt (several times: it restarts, and the recompute must not send a position twice),
    and a second one while it decodes (its prompt logprobs are all sent; it may then read the cache)."""
    path, hf = tiny_llama
    engine = _engine(path, backend, num_gpu_blocks_override=8, max_num_batched_tokens=32,
                     long_prefill_token_threshold=4)
    runner = engine.core.executor.worker.runner
    mid_prompt, after_prompt = set(), set()

    def watch(e: Engine) -> None:
        for req in e.scheduler.waiting:
            if req.status == RequestStatus.PREEMPTED and req.request_id in runner.requests:
                described = runner.requests[req.request_id].num_prompt_logprobs
                (mid_prompt if described < req.num_prompt_tokens - 1 else after_prompt).add(req.request_id)

    prompts = {"in_prompt": _prompt(40, 70), "decoding": _prompt(41, 20)}
    engine.add_request("old", _prompt(42, 60), _greedy(40))
    engine.add_request("in_prompt", prompts["in_prompt"], _greedy(5, prompt_logprobs=2))
    # (the front end also asserts that each chunk starts where the previous one ended)
    done = step_until_idle(engine, after_step=watch)
    engine.add_request("old2", _prompt(43, 60), _greedy(40))
    engine.add_request("decoding", prompts["decoding"], _greedy(60, prompt_logprobs=2))
    done.update(step_until_idle(engine, after_step=watch))
    assert "in_prompt" in mid_prompt and "decoding" in after_prompt
    for rid, prompt in prompts.items():
        _check(done[rid].prompt_logprobs, prompt, _hf_logprobs(hf, prompt), 2)


def test_n_samples_compute_the_prompt_once(tiny_llama):
    """The group's prompt logprobs come from its first sample; the others wait for its prompt KV."""
    path, hf = tiny_llama
    prompt = _prompt(50, 40)
    engine = _engine(path)
    engine.add_request("g", prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=1))
    done = step_until_idle(engine)["g"]
    _check(done.prompt_logprobs, prompt, _hf_logprobs(hf, prompt), 1)
    assert len(done.outputs) == 3
    assert engine.scheduler.stats.num_prefix_hit_tokens == 2 * 32  # samples 1, 2: the prompt's 2 full blocks


# ---- what outputs carry --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kinds(tiny_llama, kind):
    """DELTA: in the first output only; CUMULATIVE: in every output; FINAL_ONLY: in the one output. Never
    in an output before the first token (a prompt chunk's logprobs wait for it)."""
    path, hf = tiny_llama
    prompt = _prompt(60, 50)
    engine = _engine(path, max_num_batched_tokens=16)
    engine.add_request("r", prompt, _greedy(5, prompt_logprobs=2, output_kind=kind))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        engine.scheduler.check_invariants()
    assert all(o.new_token_ids[0] or o.finished for o in outs)
    carried = [o.prompt_logprobs is not None for o in outs]
    if kind == RequestOutputKind.DELTA:
        assert carried == [True] + [False] * (len(outs) - 1)
    else:
        assert all(carried) and (kind != RequestOutputKind.FINAL_ONLY or len(outs) == 1)
    _check(outs[0].prompt_logprobs, prompt, _hf_logprobs(hf, prompt), 2)


def test_above_max_logprobs_is_refused_at_admission(tiny_llama):
    engine = _engine(tiny_llama[0], max_logprobs=5)
    with pytest.raises(ValueError, match=r"prompt_logprobs 6 exceeds max_logprobs \(5\)"):
        engine.add_request("big", [1, 2, 3], _greedy(prompt_logprobs=6))
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer >= 0"):
        SamplingParams(prompt_logprobs=-1)
    engine.add_request("ok", [1, 2, 3], _greedy(prompt_logprobs=5))
    assert len(step_until_idle(engine)["ok"].prompt_logprobs) == 3


def test_requests_without_them_pay_nothing(tiny_llama, monkeypatch):
    """No extra LM-head rows and no per-request look: the runner's prompt-logprobs pass never runs."""
    engine = _engine(tiny_llama[0], max_num_batched_tokens=16)
    runner = engine.core.executor.worker.runner

    def never(*args, **kwargs):
        raise AssertionError("prompt logprobs computed for a batch that asked for none")

    monkeypatch.setattr(runner, "prompt_logprobs", never)
    for i in range(3):
        engine.add_request(str(i), _prompt(70 + i, 40), _greedy(4, logprobs=2))
    done = step_until_idle(engine)
    assert all(o.prompt_logprobs is None for o in done.values())
