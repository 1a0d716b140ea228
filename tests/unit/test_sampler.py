"""Sampler tests: exact greedy, chi-square goodness of fit, reference penalties, seeds, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve.sample import Sampler, SamplingMetadata, SamplingRow
from kvserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
ALPHA = 1e-3
NUM_SAMPLES = 20_000
# Distinct logits in a scrambled order, so a sort/scatter index mix-up changes which tokens survive.
LOGITS_12 = torch.tensor([0.3, 2.0, -0.8, 1.2, -3.0, 0.0, 1.5, -0.4, 0.9, -2.0, 0.5, -1.2])


@pytest.fixture(autouse=True)
def _fixed_default_rng():
    # Deterministic runs (no flakes) without leaking the seed into other test modules.
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        yield


def _rows(params: SamplingParams, n: int, **kw) -> list[SamplingRow]:
    return [SamplingRow(params, kw.get("prompt", [0]), kw.get("output", []), None,
                        kw.get("eos", ())) for _ in range(n)]


def _sample(logits: torch.Tensor, rows: list[SamplingRow], logprobs_mode: str = "raw_logprobs"):
    meta = SamplingMetadata.build(rows, logits.shape[-1], CPU)
    return Sampler(logprobs_mode)(logits, meta)


def _draw_counts(params: SamplingParams, logits: torch.Tensor, num_calls: int = 4) -> torch.Tensor:
    """Histogram of NUM_SAMPLES tokens drawn as num_calls batches of identical rows."""
    per_call = NUM_SAMPLES // num_calls
    rows = _rows(params, per_call)
    meta = SamplingMetadata.build(rows, logits.shape[0], CPU)
    batch = logits.expand(per_call, -1).contiguous()  # [per_call, vocab]
    counts = torch.zeros(logits.shape[0], dtype=torch.float64)
    for _ in range(num_calls):
        ids = torch.tensor(Sampler()(batch, meta).sampled_token_ids)
        counts += torch.bincount(ids, minlength=logits.shape[0]).double()
    return counts


def _reference_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                     top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The exact filtered distribution in float64, written independently of the sampler."""
    probs = torch.softmax(logits.double() / temperature, dim=0)
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    keep = set(order[:top_k] if top_k > 0 else order)
    probs = torch.tensor([probs[i].item() if i in keep else 0.0 for i in range(len(probs))],
                         dtype=torch.float64)
    probs /= probs.sum()
    if top_p < 1.0:
        kept, mass = set(), 0.0
        for i in order:
            # Guard against a top_p that sits on a cumulative-sum boundary (float32 could go either way).
            assert abs(mass - top_p) > 1e-4, "choose a top_p away from cumulative boundaries"
            if mass >= top_p:
                break
            kept.add(i)
            mass += probs[i].item()
        probs = torch.tensor([probs[i].item() if i in kept else 0.0 for i in range(len(probs))],
                             dtype=torch.float64)
        probs /= probs.sum()
    if min_p > 0.0:
        probs = torch.where(probs < min_p * probs.max(), 0.0, probs)
        probs /= probs.sum()
    return probs


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value over the tokens with non-zero expected probability."""
    support = probs > 0
    expected = probs[support] * counts.sum()
    assert expected.min() >= 5, "chi-square needs >= 5 expected counts per cell"
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


def _assert_fits(counts: torch.Tensor, probs: torch.Tensor) -> None:
    assert counts[probs == 0].sum() == 0, f"filtered-out tokens sampled: {counts.tolist()}"
    p_value = _chi_square_p_value(counts, probs)
    assert p_value > ALPHA, f"p={p_value:.2e}, counts={counts.tolist()}, probs={probs.tolist()}"


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_fast_path_does_not_copy():
    logits = torch.randn(7, 50)
    rows = _rows(SamplingParams(temperature=0.0), 7)
    meta = SamplingMetadata.build(rows, 50, CPU)
    assert meta.all_greedy and not meta.needs_processing and meta.max_num_logprobs is None
    assert Sampler.apply_processors(logits, meta) is logits
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 7


def test_mixed_greedy_and_random_rows_keep_greedy_exact():
    logits = torch.randn(6, 40)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=0.0, top_k=3, logit_bias={5: 30.0}),
              SamplingParams(temperature=2.0, top_k=4), SamplingParams(temperature=0.0, min_p=0.5),
              SamplingParams(temperature=0.8, seed=1)]
    rows = [SamplingRow(p, [1, 2], [3], torch.Generator().manual_seed(p.seed) if p.seed else None)
            for p in params]
    out = _sample(logits, rows)
    ids = out.sampled_token_ids
    assert torch.equal(logits, before), "the sampler must not modify its input"
    assert ids[0] == logits[0].argmax().item()
    assert ids[2] == 5
    assert ids[4] == logits[4].argmax().item()
    assert logits[3, ids[3]] >= logits[3].topk(4).values[-1]


# ---------------------------------------------------------------- distributions (chi-square)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.7),
    dict(temperature=1.5),
    dict(temperature=1.0, top_k=4),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.9, min_p=0.15),
    # Each filter bites here: 12 -> 8 (top_k) -> 6 (top_p) -> 5 (min_p) tokens; min_p before top_p would give 4.
    dict(temperature=1.3, top_k=8, top_p=0.85, min_p=0.3),
], ids=["t0.7", "t1.5", "top_k", "top_p", "min_p", "combined"])
def test_sampled_distribution_matches_filtered_reference(kwargs):
    params = SamplingParams(**kwargs)
    probs = _reference_probs(LOGITS_12, kwargs["temperature"], params.effective_top_k, params.top_p,
                             params.min_p)
    _assert_fits(_draw_counts(params, LOGITS_12), probs)


@pytest.mark.parametrize("kwargs, wrong", [
    (dict(temperature=0.7), dict(temperature=1.0)),
    (dict(temperature=1.0, top_p=0.8), dict(temperature=1.0, top_p=0.9)),
    (dict(temperature=1.3, top_k=8, top_p=0.85, min_p=0.3), dict(temperature=1.3, top_k=8, top_p=0.85)),
], ids=["temperature", "top_p", "combined"])
def test_chi_square_rejects_a_wrong_distribution(kwargs, wrong):
    """Power check: the same statistic must reject a (here: less filtered) neighbour distribution."""
    counts = _draw_counts(SamplingParams(**kwargs), LOGITS_12)
    wrong_probs = _reference_probs(LOGITS_12, **{"temperature": 1.0, **wrong})
    assert _chi_square_p_value(counts, wrong_probs) < ALPHA


def test_top_k_alone_and_with_top_p_sort_path_agree():
    """A row's top_k keeps the same tokens whether a batch mate forces the sort (top_p) path."""
    logits = torch.randn(2, 30)
    alone = _sample(logits[:1].expand(3000, -1).contiguous(), _rows(SamplingParams(top_k=5), 3000))
    mixed_rows = _rows(SamplingParams(top_k=5), 3000) + _rows(SamplingParams(top_p=0.3), 1)
    mixed = _sample(torch.cat([logits[:1].expand(3000, -1), logits[1:]]), mixed_rows)
    top5 = set(logits[0].topk(5).indices.tolist())
    assert set(alone.sampled_token_ids) == top5
    assert set(mixed.sampled_token_ids[:3000]) == top5


def test_seeded_rows_follow_the_filtered_distribution():
    n = 4000
    params = SamplingParams(temperature=1.3, top_k=8, top_p=0.9, seed=0)
    rows = [SamplingRow(params, [0], [], torch.Generator().manual_seed(seed)) for seed in range(n)]
    out = _sample(LOGITS_12.expand(n, -1).contiguous(), rows)
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=12).double()
    _assert_fits(counts, _reference_probs(LOGITS_12, 1.3, 8, 0.9))


# ---------------------------------------------------------------- processors vs a plain reference


def _reference_processed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    out = logits.clone().double()
    for i, row in enumerate(rows):
        p = row.params
        for token, bias in (p.logit_bias or {}).items():
            out[i, token] += bias
        if len(row.output_token_ids) < p.min_tokens:
            for token in list(row.eos_token_ids) + p.stop_token_ids:
                out[i, token] = -math.inf
        for token in range(out.shape[1]):
            if token in row.prompt_token_ids or token in row.output_token_ids:
                value = out[i, token].item()
                out[i, token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            count = row.output_token_ids.count(token)
            out[i, token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def test_penalties_and_logit_bias_match_reference():
    gen = torch.Generator().manual_seed(7)
    vocab, batch = 24, 9

    def rand(lo, hi):
        return lo + (hi - lo) * torch.rand((), generator=gen).item()

    def tokens(max_len):
        return torch.randint(0, vocab, (int(torch.randint(0, max_len, (), generator=gen)),),
                             generator=gen).tolist()

    rows = []
    for i in range(batch):
        penalised = i % 3 != 0  # every third row has no processor at all
        params = SamplingParams(
            temperature=0.0,
            repetition_penalty=rand(0.5, 2.0) if penalised else 1.0,
            frequency_penalty=rand(-2, 2) if penalised else 0.0,
            presence_penalty=rand(-2, 2) if i % 3 == 1 else 0.0,
            logit_bias={int(t): rand(-5, 5) for t in torch.randint(0, vocab, (3,), generator=gen)}
            if i % 2 else None,
            min_tokens=4 if i == 4 else 0, stop_token_ids=[2, 3] if i == 4 else None)
        rows.append(SamplingRow(params, tokens(12), tokens(10), None, eos_token_ids=(1,)))
    logits = 3 * torch.randn(batch, vocab, generator=gen)
    meta = SamplingMetadata.build(rows, vocab, CPU)
    processed = Sampler.apply_processors(logits, meta)
    expected = _reference_processed(logits, rows)
    assert processed is not logits
    torch.testing.assert_close(processed.double(), expected, rtol=1e-5, atol=1e-5)
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids == expected.argmax(dim=-1).tolist()


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    vocab, eos, stop = 16, 3, 7
    logits = torch.zeros(1, vocab)
    logits[0, eos], logits[0, stop], logits[0, 11] = 10.0, 9.0, 1.0
    for ignore_eos in (False, True):
        params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop], ignore_eos=ignore_eos)
        for num_output in range(5):
            row = SamplingRow(params, [0], [5] * num_output, None, eos_token_ids=(eos,))
            meta = SamplingMetadata.build([row], vocab, CPU)
            processed = Sampler.apply_processors(logits, meta)
            masked = num_output < 3
            assert (processed[0, [eos, stop]] == -math.inf).all().item() == masked
            assert Sampler()(logits, meta).sampled_token_ids == [11 if masked else eos]
    # Random rows too: a masked token is never drawn.
    counts = torch.bincount(torch.tensor(_sample(
        torch.zeros(2000, vocab), _rows(SamplingParams(min_tokens=1, stop_token_ids=[stop]), 2000,
                                        eos=(eos,))).sampled_token_ids), minlength=vocab)
    assert counts[eos] == 0 and counts[stop] == 0 and (counts > 0).sum() == vocab - 2


def test_out_of_vocab_bias_is_rejected():
    """Token ids are checked once, at admission (Processor.validate); past it the sampler trusts them."""
    from kvserve.engine.core import EngineInfo
    from kvserve.engine.processor import Processor

    info = EngineInfo("m", max_model_len=64, vocab_size=16, max_num_seqs=4, num_kv_blocks=16, block_size=16,
                      max_logprobs=5, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="logit_bias"):
        Processor(None, info, ()).validate([1, 2], SamplingParams(logit_bias={99: 1.0}))


# ---------------------------------------------------------------- seeds


def _run_seeded(seed: int, mates: list[SamplingParams], position: int, step_logits: list[torch.Tensor]):
    """Decode len(step_logits) steps for one seeded row placed at `position` among `mates`."""
    params = SamplingParams(temperature=1.2, top_p=0.95, frequency_penalty=0.5, seed=seed)
    target = SamplingRow(params, [1, 2, 3], [], torch.Generator().manual_seed(seed))
    others = [SamplingRow(p, [4], [], torch.Generator().manual_seed(p.seed) if p.seed is not None else None)
              for p in mates]
    rows = others[:position] + [target] + others[position:]
    for logits in step_logits:
        batch = torch.randn(len(rows), logits.shape[0])  # [B, vocab]; fresh noise for the mates
        batch[position] = logits
        out = _sample(batch, rows)
        for row, token in zip(rows, out.sampled_token_ids):
            row.output_token_ids.append(token)
    return target.output_token_ids


def test_seeded_row_is_reproducible_whatever_its_batch_mates():
    step_logits = [0.3 * torch.randn(64) for _ in range(6)]  # near-uniform: many plausible tokens
    alone = _run_seeded(42, [], 0, step_logits)
    scenarios = [
        ([SamplingParams(temperature=1.0)], 1),
        ([SamplingParams(seed=7), SamplingParams(temperature=0.0), SamplingParams(top_k=3)], 2),
        ([SamplingParams(temperature=0.0)] * 3 + [SamplingParams(seed=42, min_p=0.2),
                                                  SamplingParams(logprobs=2, repetition_penalty=1.3)], 5),
        ([SamplingParams(seed=i, top_k=5) for i in range(6)], 0),
    ]
    for mates, position in scenarios:
        assert _run_seeded(42, mates, position, step_logits) == alone, (mates, position)
    assert _run_seeded(43, [], 0, step_logits) != alone


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_sorted_and_ranked():
    vocab = 32
    logits = torch.randn(4, vocab)
    params = [SamplingParams(logprobs=None), SamplingParams(logprobs=0, temperature=0.5),
              SamplingParams(logprobs=3, temperature=0.0, logit_bias={0: 50.0}),
              SamplingParams(logprobs=5, temperature=2.0, top_k=6, presence_penalty=1.0)]
    rows = [SamplingRow(p, [1], [2, 2], None) for p in params]
    out = _sample(logits, rows)
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs[0] is None
    for i in (1, 2, 3):
        lp = out.logprobs[i]
        k = params[i].logprobs
        sampled = out.sampled_token_ids[i]
        assert len(lp.token_ids) == len(lp.logprobs) == len(lp.ranks) == k + 1
        assert lp.token_ids[0] == sampled
        expected_rank = int((raw[i] >= raw[i, sampled]).sum())
        assert lp.ranks[0] == expected_rank
        order = raw[i].argsort(descending=True)
        assert lp.token_ids[1:] == order[:k].tolist()
        assert lp.ranks[1:] == list(range(1, k + 1))
        torch.testing.assert_close(torch.tensor(lp.logprobs, dtype=torch.float64),
                                   raw[i, lp.token_ids], rtol=0, atol=1e-5)
    assert out.sampled_token_ids[2] == 0  # the bias steers sampling, but not the reported logprobs
    assert out.logprobs[2].logprobs[0] == pytest.approx(raw[2, 0].item(), abs=1e-5)


def _chosen_from(logits: torch.Tensor, params: SamplingParams, seen: list[int]) -> torch.Tensor:
    """One row's processed logits by hand: repetition penalty (CTRL), temperature, top_k (greedy: neither)."""
    out = logits.clone().double()
    for t in set(seen):
        out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
    if params.temperature == 0:
        return out
    out = out / params.temperature
    if params.top_k > 0:
        out[out < out.topk(params.top_k).values[-1]] = float("-inf")
    return out


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes_report_raw_or_processed_values(mode):
    """vLLM's --logprobs-mode. Issue 34: at temperature 0 with a repetition penalty the raw top-1 need not be the
    chosen token; the processed modes report the values the token was chosen from, so there it always is."""
    vocab = 32
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3)) * 3
    prompt, output = [1, 2, 3], [4, 5]
    # the penalised tokens lead the raw distribution, so the penalty moves the greedy choice
    logits[:, prompt + output] += 10.0
    params = [SamplingParams(logprobs=4, temperature=0.0, repetition_penalty=8.0),
              SamplingParams(logprobs=4, temperature=0.7, top_k=5, repetition_penalty=8.0),
              SamplingParams(logprobs=2, temperature=0.0)]
    rows = [SamplingRow(p, prompt, output, None) for p in params]
    out = _sample(logits, rows, mode)
    for i, p in enumerate(params):
        expected = logits[i].double() if mode.startswith("raw") else _chosen_from(logits[i], p, prompt + output)
        if mode.endswith("_logprobs"):
            expected = expected.log_softmax(dim=-1)
        lp = out.logprobs[i]
        got = torch.tensor(lp.logprobs, dtype=torch.float64)
        want = expected[lp.token_ids]
        finite = want.isfinite()
        torch.testing.assert_close(got[finite], want[finite], rtol=0, atol=1e-4)
        assert (got[~finite] == float("-inf")).all()
        assert lp.token_ids[1:] == expected.argsort(descending=True)[:p.logprobs].tolist()
        assert lp.ranks[0] == int((expected >= expected[out.sampled_token_ids[i]]).sum())
    greedy = [0, 2]
    for i in greedy:
        lp = out.logprobs[i]
        assert (lp.token_ids[0] == lp.token_ids[1]) == (mode.startswith("processed") or i == 2), mode
    assert out.logprobs[0].token_ids[0] not in prompt + output  # the penalty moved the greedy choice
    if mode.startswith("processed"):  # the sampled row drew from its top_k: its other tokens are -inf
        assert out.logprobs[1].ranks[0] <= 5 and out.logprobs[1].logprobs[-1] > float("-inf")


def test_logprobs_mode_does_not_change_tokens():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=t, seed=7 + i, top_p=0.8, min_p=0.05, repetition_penalty=1.3, logprobs=3)
              for i, t in enumerate([0.0, 0.5, 1.0, 0.0, 1.5, 0.9])]
    tokens = set()
    for mode in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"):
        rows = [SamplingRow(p, [1, 2], [3], torch.Generator().manual_seed(p.seed)) for p in params]
        out = _sample(logits, rows, mode)
        tokens.add(tuple(out.sampled_token_ids))
        assert all(lp.logprobs[0] > float("-inf") for lp in out.logprobs)  # a token is drawn from what is left
    assert len(tokens) == 1
    with pytest.raises(ValueError, match="raw_logprobs, raw_logits, processed_logprobs, processed_logits"):
        Sampler("logits")
