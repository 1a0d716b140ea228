"""Tensor parallelism with the follower ranks as Ray actors (`--distributed-executor-backend ray`; skipped
without Ray): the same greedy tokens and logprobs as one rank, clean shutdown (the local Ray instance it
started is gone), and a killed actor ends the engine with a TensorParallelError.

Starting Ray costs 10-20 s here, so one module-scoped engine serves the equivalence and shutdown checks; the
killed-actor test starts its own after it."""
from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

from kvserve.engine.llm import LLM  # noqa: E402
from kvserve.worker.tp_executor import TensorParallelError  # noqa: E402
from tests.helpers.tensor_parallel import TP_ARGS, run_tp, tp_mixed_batch  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def engines(tiny_llama):
    assert not ray.is_initialized()
    path = tiny_llama[0]
    tp1 = LLM(path, **TP_ARGS)
    tp2 = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **TP_ARGS)
    yield tp1, tp2
    tp2.shutdown()


def test_ray_tp2_matches_tp1_on_a_mixed_batch(engines):
    tp1, tp2 = engines
    prompts, params = tp_mixed_batch()
    ref, out = run_tp(tp1, prompts, params), run_tp(tp2, prompts, params)
    assert type(tp2.engine.core.executor).__name__ == "RayExecutor"
    assert tp2.engine.core.executor.group.stats.all_reduce_bytes > 0
    for a, b in zip(ref, out):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)


def test_ray_shutdown_stops_the_actors_and_ray(engines):
    _, tp2 = engines
    executor = tp2.engine.core.executor
    refs = list(executor._follow_refs)
    tp2.shutdown()
    assert not torch.distributed.is_initialized()
    assert not ray.is_initialized()  # the executor started this local instance, so it stopped it
    assert refs and executor.actors == []


def test_a_killed_actor_ends_the_engine_with_an_error(tiny_llama):
    llm = LLM(tiny_llama[0], tensor_parallel_size=2, distributed_executor_backend="ray", kv_cache_memory="8MiB",
              num_threads=1)
    try:
        engine = llm.engine
        from kvserve.sampling_params import SamplingParams

        engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
        engine.step()
        ray.kill(engine.core.executor.actors[0])
        with pytest.raises(TensorParallelError, match=r"rank 1 \(Ray actor\) died; the engine cannot continue"):
            for _ in range(50):
                engine.step()
    finally:
        llm.shutdown()
    assert not torch.distributed.is_initialized() and not ray.is_initialized()


def test_an_actor_that_fails_to_load_is_reported(tiny_llama):
    with pytest.raises(TensorParallelError, match=r"rank 1 \(Ray actor\) failed to load its shard: ValueError: the "
                                                  r"KV-cache budget"):
        LLM(tiny_llama[0], tensor_parallel_size=2, distributed_executor_backend="ray", kv_cache_memory="1KiB",
            num_threads=1)
    assert not torch.distributed.is_initialized() and not ray.is_initialized()
