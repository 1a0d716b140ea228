"""`--logprobs-mode` (vLLM's) end to end on a tiny checkpoint, with a repetition penalty that moves greedy
choices: raw modes report the model's own distribution (the same values as teacher-forced prompt logprobs),
processed modes the one each token was chosen from, so at temperature 0 the chosen token is their top-1.
The mode never changes a token (issue 34)."""
from __future__ import annotations

import pytest

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.sample.sampler import LOGPROBS_MODES
from kvserve.sampling_params import SamplingParams
from tests.helpers.engine import run_to_completion

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
TOL = 1e-4


def _generate(path: str, mode: str | None, params: SamplingParams):
    kwargs = {} if mode is None else {"logprobs_mode": mode}
    engine = Engine(EngineArgs(model=path, num_gpu_blocks_override=64, max_model_len=256, **kwargs))
    engine.add_request("r", PROMPT, params)
    return run_to_completion(engine)["r"], engine


@pytest.fixture(scope="module")
def penalised(tiny_llama):
    """Greedy tokens under a strong repetition penalty, and the raw teacher-forced logprobs along them."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=4.0, logprobs=5)
    out, engine = _generate(tiny_llama[0], "raw_logprobs", params)
    tokens = out.outputs[0].token_ids
    engine.add_request("tf", PROMPT + tokens, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5))
    forced = run_to_completion(engine)["tf"].prompt_logprobs[len(PROMPT):]
    return params, tokens, forced


@pytest.mark.parametrize("mode", [None, *LOGPROBS_MODES])
def test_logprobs_modes_raw_and_processed(tiny_llama, penalised, mode):
    params, tokens, forced = penalised
    out = _generate(tiny_llama[0], mode, params)[0].outputs[0]
    assert out.token_ids == tokens  # the mode changes what is reported, never what is chosen
    mode = mode or "processed_logprobs"  # the default (docs/features/sampling-defaults.md)
    moved = 0
    for token, entry, raw in zip(tokens, out.logprobs, forced):
        raw_top = min(raw.values(), key=lambda lp: lp.rank)
        moved += raw[token].rank != 1
        if mode.startswith("processed"):
            assert entry[token].rank == 1  # greedy: the chosen token is the reported top-1
            assert entry[token].logprob == max(lp.logprob for lp in entry.values())
        elif mode == "raw_logprobs":
            assert entry[token].rank == raw[token].rank
            for t, lp in entry.items():
                assert lp.logprob == pytest.approx(raw[t].logprob, abs=TOL) if t in raw else lp.rank > 5
        else:  # raw logits: differences of logits are differences of raw logprobs
            top = next(t for t, lp in entry.items() if lp.rank == 1)
            assert top == next(t for t, lp in raw.items() if lp is raw_top)
            assert entry[token].logprob - entry[top].logprob == pytest.approx(raw[token].logprob - raw_top.logprob,
                                                                                abs=TOL)
    assert moved > 0, "the penalty never moved a greedy choice: the test shows nothing"


def test_an_unknown_mode_is_refused_naming_the_modes(tiny_llama):
    from kvserve import LLM

    with pytest.raises(ValueError, match="raw_logprobs, raw_logits, processed_logprobs, processed_logits"):
        LLM(tiny_llama[0], logprobs_mode="logits")
