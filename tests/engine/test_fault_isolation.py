"""Issue 9, item 2: a failure attributable to one request fails that request alone; a failure of the engine
loop itself fails every in-flight request promptly and marks the engine dead.

Faults are injected by wrapping the real sampler / detokenizer so that they raise for one marked request.
"""
from __future__ import annotations

import asyncio

import pytest

from kvserve.config import EngineArgs
from kvserve.detokenizer import IncrementalDetokenizer
from kvserve.engine.engine import Engine
from kvserve.sample.sampler import Sampler
from kvserve.sampling_params import SamplingParams
from tests.helpers.engine import step_until_idle

POISON_SEED = 424242  # the marked request's seed: the injected sampler fault fires for it only


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(EngineArgs(model=tiny_llama[0], kv_cache_memory="16MiB", max_num_batched_tokens=64))


def _prompts():
    return [[1 + i, 50 + i, 900 + i, 33] for i in range(5)]


def _run(engine, params_list) -> dict:
    for i, (prompt, params) in enumerate(zip(_prompts(), params_list)):
        engine.add_request(str(i), prompt, params)
    return step_until_idle(engine)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw)


def test_sampler_fault_fails_only_its_request(engine, monkeypatch):
    # request 4 is seeded and sampled: its generator must be rewound before the rows are retried alone
    params = [_greedy(), _greedy(), _greedy(), _greedy(),
              SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)]
    clean = _run(engine, params)

    real_call = Sampler.__call__

    def faulty(self, logits, meta):
        if any(g.initial_seed() == POISON_SEED for g in meta.generators.values()):
            raise RuntimeError("injected sampler fault")
        return real_call(self, logits, meta)

    monkeypatch.setattr(Sampler, "__call__", faulty)
    poisoned = list(params)
    poisoned[2] = SamplingParams(temperature=0.7, seed=POISON_SEED, max_tokens=12, ignore_eos=True)
    outs = _run(engine, poisoned)
    bad = outs["2"].outputs[0]
    assert bad.finish_reason == "error" and "injected sampler fault" in bad.error
    for rid in ("0", "1", "3", "4"):
        assert outs[rid].outputs[0].token_ids == clean[rid].outputs[0].token_ids, rid
        assert outs[rid].outputs[0].finish_reason == "length"
    monkeypatch.undo()
    assert _run(engine, params)["3"].outputs[0].token_ids == clean["3"].outputs[0].token_ids


def test_detokenizer_fault_fails_only_its_request(engine, monkeypatch):
    params = [_greedy() for _ in range(5)]
    clean = _run(engine, params)
    real_add = IncrementalDetokenizer.add_tokens

    def faulty(self, token_ids, finished=False):
        if "POISON" in self.stop_strings and len(self._tokens) > 8:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return real_add(self, token_ids, finished)

    monkeypatch.setattr(IncrementalDetokenizer, "add_tokens", faulty)
    poisoned = list(params)
    poisoned[1] = _greedy(stop=["POISON"])
    outs = _run(engine, poisoned)
    bad = outs["1"].outputs[0]
    assert bad.finish_reason == "error" and "injected detokenizer fault" in bad.error
    assert len(bad.token_ids) < 12
    for rid in ("0", "2", "3", "4"):
        assert outs[rid].outputs[0].token_ids == clean[rid].outputs[0].token_ids
        assert outs[rid].outputs[0].text == clean[rid].outputs[0].text


def test_forward_pass_fault_is_not_swallowed(engine, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected forward fault")

    engine.add_request("f", [1, 2, 3], _greedy())
    monkeypatch.setattr(engine.core.executor.worker.model, "forward", broken)
    with pytest.raises(RuntimeError, match="injected forward fault"):
        engine.step()
    monkeypatch.undo()
    engine.abort_request("f")
    engine.step()
    assert not engine.has_unfinished_requests()


def test_bad_request_does_not_poison_an_offline_llm(tiny_llama):
    from kvserve import LLM

    llm = LLM(tiny_llama[0], kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("hi", SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[50_000]), use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[-1_000_000])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="token ids"):
        llm.engine.explain_prefix([-1])
    out = llm.generate("hi", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_engine_loop_death_fails_streams_and_calls_the_dead_listener(tiny_llama, monkeypatch):
    from kvserve.engine.async_engine import AsyncEngine, EngineDeadError

    from kvserve.engine.core import EngineCore

    real_step = EngineCore.step
    calls = {"n": 0}

    def dying_step(self):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected engine loop fault")
        return real_step(self)

    monkeypatch.setattr(EngineCore, "step", dying_step)

    async def main():
        engine = AsyncEngine(EngineArgs(model=tiny_llama[0], kv_cache_memory="16MiB"))
        await engine.start()
        dead = []
        engine.add_dead_listener(dead.append)
        streams = [await engine.add_request(str(i), [1, 2, 3 + i], SamplingParams(max_tokens=500, ignore_eos=True))
                   for i in range(3)]
        for stream in streams:
            with pytest.raises(EngineDeadError):
                async with asyncio.timeout(10):
                    async for _ in stream:
                        pass
        assert dead and not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", [1, 2], SamplingParams(max_tokens=2))
        await engine.shutdown()

    asyncio.run(main())
