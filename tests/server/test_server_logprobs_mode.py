"""`kvserve serve --logprobs-mode` through the `openai` client (issue 34): with a repetition penalty at
temperature 0, the default (processed_logprobs) reports each chosen token as the top-1, whole and streamed,
on chat and completions; raw_logprobs reports the model's own distribution, where the penalty shows as
chosen tokens that are not the top-1. The built-in SmolLM2 under `kvserve serve` defaults (whose own default
repetition penalty applies to a request that leaves it unset) is the slow check of the report."""
from __future__ import annotations

import pytest

from tests.helpers.server import in_process

MESSAGES = [{"role": "user", "content": "Name three colors."}]
# NOTE: ignore_eos and a strong penalty: the random model repeats itself, so the penalty moves its choices
PENALISED = {"ignore_eos": True, "repetition_penalty": 4.0}


@pytest.fixture(scope="module")
def default_client(tiny_llama):
    for srv in in_process(tiny_llama[0], "--stats-interval", "0"):
        yield srv.openai(timeout=120)


@pytest.fixture(scope="module")
def raw_client(tiny_llama):
    for srv in in_process(tiny_llama[0], "--stats-interval", "0", "--logprobs-mode", "raw_logprobs"):
        yield srv.openai(timeout=120)


def _chat(client, **extra):
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, logprobs=True,
                                          top_logprobs=3, max_completion_tokens=16, **extra)


def _chat_mismatches(content) -> int:
    """Chosen tokens that are not the reported top-1 (a tie counts as the top-1)."""
    return sum(t.logprob < t.top_logprobs[0].logprob for t in content)


def test_default_mode_reports_the_chosen_token_as_the_top_one(default_client, raw_client, check_schema):
    whole = _chat(default_client, extra_body=PENALISED)
    check_schema("CreateChatCompletionResponse", whole.to_dict())
    content = whole.choices[0].logprobs.content
    assert len(content) == 16 and _chat_mismatches(content) == 0
    assert all(t.token == t.top_logprobs[0].token for t in content)
    chunks = list(_chat(default_client, extra_body=PENALISED, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    assert _chat_mismatches(streamed) == 0
    model = default_client.models.list().data[0].id
    completion = default_client.completions.create(model=model, prompt="Name three colors.", max_tokens=16,
                                                   temperature=0, logprobs=3, extra_body=PENALISED)
    lp = completion.choices[0].logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob == max(top.values())
    raw = _chat(raw_client, extra_body=PENALISED)
    assert raw.choices[0].message.content == whole.choices[0].message.content  # the mode never picks tokens
    assert _chat_mismatches(raw.choices[0].logprobs.content) > 0  # raw: the penalty shows


def test_without_a_penalty_raw_and_processed_agree_at_temperature_0(default_client, raw_client):
    a = _chat(default_client, extra_body={"ignore_eos": True}).choices[0].logprobs.content
    b = _chat(raw_client, extra_body={"ignore_eos": True}).choices[0].logprobs.content
    assert [t.token for t in a] == [t.token for t in b]
    assert [t.logprob for t in a] == pytest.approx([t.logprob for t in b], abs=1e-4)


@pytest.mark.slow  # NOTE: the real SmolLM2 behind the server, ~15 s: in `make test`, not `make test-fast`
def test_builtin_model_defaults_report_the_greedy_token_as_the_top_logprob():
    """Issue 34's report: `kvserve serve` defaults, temperature 0, logprobs: every chosen token is the top-1."""
    for srv in in_process(None, "--stats-interval", "0"):
        client = srv.openai(timeout=300)
        content = _chat(client, max_tokens=None).choices[0].logprobs.content
        assert content and _chat_mismatches(content) == 0, [(t.token, t.top_logprobs[0].token) for t in content]
        assert all(t.token == t.top_logprobs[0].token for t in content)
