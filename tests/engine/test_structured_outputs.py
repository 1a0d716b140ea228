"""Structured outputs (xgrammar) through the engine, on a tiny random checkpoint: constrained outputs always fit
their grammar, greedy equals transformers + xgrammar's own logits processor, and nothing else changes (mixed
batches, speculation, chunking, preemption, prefix-cache hits, n > 1). Block invariants after every step."""
from __future__ import annotations

import re
import threading

import pytest
import torch

from kvserve import SamplingParams, StructuredOutputsParams
from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.structured_output.grammar import choice_ebnf
from kvserve.structured_output.manager import StructuredOutputManager
from tests.helpers.engine import ATTENTION_BACKENDS, run_to_completion, step_until_idle

xgr = pytest.importorskip("xgrammar")

CHOICES = ["yes", "no", "maybe later"]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["a", "b", "c"]}},
          "required": ["n", "tag"]}
PROMPTS = ["hello there", "The capital of France is", "1, 2, 3, 4,", "Once upon a time in a land far away"]


def _engine(path, **kwargs) -> Engine:
    args = dict(model=path, num_gpu_blocks_override=96, max_model_len=512, max_num_batched_tokens=64)
    args.update(kwargs)
    return Engine(EngineArgs(**args))


def _params(so: StructuredOutputsParams | None, temperature=0.0, seed=None, max_tokens=24, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, structured_outputs=so, **kw)


def _run(engine: Engine, requests: list[tuple[str, SamplingParams]]) -> dict[str, object]:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    return run_to_completion(engine)


def test_choice_and_regex_always_match_in_a_mixed_batch(tiny_llama):
    """Greedy and sampled (temperature 1, seeded), with unconstrained requests in the same batch and
    speculation on (the default): every constrained output is complete and matches."""
    engine = _engine(tiny_llama[0])
    requests = []
    for seed in range(6):
        for temperature in (0.0, 1.0):
            prompt = PROMPTS[seed % len(PROMPTS)]
            requests.append((prompt, _params(StructuredOutputsParams(choice=CHOICES), temperature, seed)))
            requests.append((prompt, _params(StructuredOutputsParams(regex=REGEX), temperature, seed)))
            requests.append((prompt, _params(None, temperature, seed, ignore_eos=True)))
    outs = _run(engine, requests)
    for i, (_, params) in enumerate(requests):
        o = outs[f"r{i}"].outputs[0]
        so = params.structured_outputs
        if so is None:
            assert o.finish_reason == "length" and len(o.token_ids) == 24
        elif so.choice:
            assert o.text in CHOICES and o.finish_reason == "stop", (o.text, o.finish_reason)
        else:
            assert re.fullmatch(REGEX, o.text) and o.finish_reason == "stop", (o.text, o.finish_reason)


def test_n_samples_each_follow_the_grammar(tiny_llama):
    engine = _engine(tiny_llama[0])
    engine.add_request("r", PROMPTS[0], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=24,
                                                       structured_outputs=StructuredOutputsParams(choice=CHOICES)))
    out = run_to_completion(engine)["r"]
    assert len(out.outputs) == 4
    assert all(o.text in CHOICES for o in out.outputs), [o.text for o in out.outputs]


def _oracle_tokens(hf_model, tokenizer, prompt_ids: list[int], compiled, max_new_tokens: int) -> list[int]:
    from xgrammar.contrib.hf import LogitsProcessor

    out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                            logits_processor=[LogitsProcessor(compiled)], eos_token_id=2, pad_token_id=0)
    tokens = out[0, len(prompt_ids):].tolist()
    return tokens


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_greedy_equals_transformers_with_xgrammar_logits_processor(tiny_llama, backend):
    """The oracle: transformers' greedy generate with xgrammar's HF logits processor on the same weights,
    one request at a time; kvserve runs them all in one batch (with unconstrained requests beside them)."""
    path, hf_model = tiny_llama
    engine = _engine(path, attention_backend=backend)
    tokenizer = engine.tokenizer
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=hf_model.config.vocab_size,
                                              stop_token_ids=list(engine.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    specs = [(StructuredOutputsParams(json=SCHEMA), compiler.compile_json_schema(SCHEMA)),
             (StructuredOutputsParams(regex=REGEX), compiler.compile_regex(REGEX)),
             (StructuredOutputsParams(choice=CHOICES), None)]
    requests, expected = [], []
    for i, prompt in enumerate(PROMPTS[:3]):
        so, compiled = specs[i % len(specs)]
        ids = tokenizer.encode(prompt)
        requests.append((ids, _params(so, max_tokens=30)))
        requests.append((ids, _params(None, max_tokens=8, ignore_eos=True)))
        if compiled is None:
            compiled = compiler.compile_grammar(choice_ebnf(CHOICES))
        expected.append(_oracle_tokens(hf_model, tokenizer, ids, compiled, 30))
    outs = _run(engine, requests)
    for i, want in enumerate(expected):
        got = outs[f"r{2 * i}"].outputs[0].token_ids
        assert got == want, (i, got, want)


@pytest.mark.slow  # NOTE: ~15 s: in `make test`, not `make test-fast`
def test_speculation_chunking_and_preemption_change_nothing(tiny_llama):
    """Greedy constrained outputs are the same with speculation off, with tiny prefill chunks, and in a KV
    pool so small that requests are preempted and recomputed (their matchers are not rewound: the tokens
    they were advanced over stay the request's)."""
    path = tiny_llama[0]
    requests = []
    for i, prompt in enumerate(PROMPTS * 2):
        so = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
              StructuredOutputsParams(choice=CHOICES)][i % 3]
        requests.append((prompt * 3, _params(so, max_tokens=40)))
    reference = _run(_engine(path, speculative_config=None), requests)
    variants = [dict(), dict(max_num_batched_tokens=8), dict(num_gpu_blocks_override=24, block_size=4)]
    for kwargs in variants:
        engine = _engine(path, **kwargs)
        outs = _run(engine, requests)
        for req_id, ref in reference.items():
            assert outs[req_id].outputs[0].token_ids == ref.outputs[0].token_ids, (kwargs, req_id)
        if "num_gpu_blocks_override" in kwargs:
            assert engine.scheduler.stats.num_preemptions > 0


def test_prefix_cache_hit_gives_the_same_constrained_output(tiny_llama):
    engine = _engine(tiny_llama[0])
    prompt = PROMPTS[3] * 4
    params = _params(StructuredOutputsParams(json=SCHEMA), max_tokens=40)
    engine.add_request("first", prompt, params)
    first = step_until_idle(engine)["first"]  # (run_to_completion would empty the prefix cache)
    engine.add_request("again", prompt, params)
    second = run_to_completion(engine)["again"]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_a_complete_grammar_stops_the_request_even_with_ignore_eos(tiny_llama):
    engine = _engine(tiny_llama[0])
    outs = _run(engine, [(PROMPTS[0], _params(StructuredOutputsParams(choice=["ok"]), ignore_eos=True))])
    o = outs["r0"].outputs[0]
    assert o.text == "ok" and o.finish_reason == "stop"


def test_compiling_never_blocks_the_other_requests(tiny_llama, monkeypatch):
    """A grammar still compiling holds back its request only: the others are admitted and finish."""
    release = threading.Event()
    original = StructuredOutputManager._compile

    def slow_compile(self, params):
        assert release.wait(60)
        return original(self, params)

    monkeypatch.setattr(StructuredOutputManager, "_compile", slow_compile)
    engine = _engine(tiny_llama[0])
    engine.add_request("constrained", PROMPTS[0], _params(StructuredOutputsParams(regex=REGEX)))
    engine.add_request("plain", PROMPTS[1], _params(None, max_tokens=6, ignore_eos=True))
    finished = {}
    for _ in range(200):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        engine.scheduler.check_invariants()
        if "plain" in finished:
            break
    assert "plain" in finished and "constrained" not in finished
    assert [r.request_id for r in engine.scheduler.waiting] == ["constrained"]
    release.set()
    finished.update(step_until_idle(engine))
    assert re.fullmatch(REGEX, finished["constrained"].outputs[0].text)


@pytest.mark.parametrize("so, message", [
    (dict(regex="[a-"), "invalid structured_outputs.regex: Regex parsing error"),
    (dict(json={"type": "object", "properties": {"a": {"type": "frobnicate"}}}),
     'invalid structured_outputs.json: Unsupported type "frobnicate"'),
    (dict(grammar="root ::= missing_rule"), "invalid structured_outputs.grammar: .*missing_rule"),
    (dict(json={"type": "string"}, whitespace_pattern=" *"), "whitespace_pattern is not supported"),
])
def test_invalid_specs_are_refused_at_admission_naming_the_problem(tiny_llama, so, message):
    engine = _engine(tiny_llama[0])
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", PROMPTS[0], _params(StructuredOutputsParams(**so)))
    assert engine.scheduler.num_unfinished == 0


@pytest.mark.parametrize("so, message", [
    (dict(), "exactly one of"),
    (dict(regex="a", choice=["a"]), "exactly one of"),
    (dict(choice=[]), "choice must be a non-empty list"),
    (dict(json="{not json"), "not valid JSON"),
])
def test_malformed_params_raise_at_construction(so, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**so)


def test_bitmask_rows_of_draft_positions_and_draft_cut(tiny_llama):
    """fill_bitmask's row j is the bitmask after the first j drafts; drafts are cut at the grammar's first
    refusal; matchers end where they started."""
    engine = _engine(tiny_llama[0])
    tokenizer = engine.tokenizer
    manager = StructuredOutputManager(lambda: tokenizer, 49152, engine.eos_token_ids)
    so = manager.add(StructuredOutputsParams(regex="[0-9]+-x"), engine.eos_token_ids)
    so.compiled.result(timeout=60)
    assert manager.is_ready(so, engine.eos_token_ids)
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "123"]
    letter = tokenizer.convert_tokens_to_ids("q")
    assert manager.valid_draft_prefix(so, digits + [letter] + digits) == 3
    bitmask, first = manager.fill_bitmask([("a", so, digits[:2])])
    assert first == {"a": 0} and bitmask.shape == (3, 1536)
    fresh = StructuredOutputManager(lambda: tokenizer, 49152, engine.eos_token_ids)
    ref = fresh.add(StructuredOutputsParams(regex="[0-9]+-x"), engine.eos_token_ids)
    ref.compiled.result(timeout=60)
    fresh.is_ready(ref, engine.eos_token_ids)
    for j in range(3):
        row = torch.full((1, 1536), -1, dtype=torch.int32)
        ref.matcher.fill_next_token_bitmask(row, 0)
        assert torch.equal(bitmask[j], row[0]), j
        if j < 2:
            assert ref.matcher.accept_token(digits[j])
    allowed = lambda mask, t: bool((int(mask[t // 32]) >> (t % 32)) & 1)  # noqa: E731
    assert not allowed(bitmask[0], tokenizer.convert_tokens_to_ids("-")) and allowed(bitmask[1], digits[0])
    # the matcher is back at the start: a '-' is still refused first
    assert manager.valid_draft_prefix(so, [tokenizer.convert_tokens_to_ids("-")]) == 0
