"""LoRA under tensor parallelism (gloo, 2 ranks on CPU): adapter weights sharded like the layers they modify
give the same greedy tokens and log-probabilities as one rank, in one batch mixing the base model and two
adapters that between them adapt every module (q, k, v, o, gate, up, down; one with rsLoRA), with two slots
and with one (adapters swapped), on the mp and (when installed) Ray backends."""
from __future__ import annotations

import pytest
import torch

from kvserve import LoRARequest
from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.sampling_params import SamplingParams
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.engine import check_engine_invariants
from tests.helpers.lora import ADAPTERS, make_adapter

_ARGS = dict(enable_lora=True, max_loras=2, num_gpu_blocks_override=64, block_size=4, max_num_batched_tokens=32,
             max_num_seqs=8, num_threads=1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_lora")
    base = make_tiny_checkpoint(str(root / "base"), "llama")
    requests = {}
    for i, name in enumerate(("mlp_rs", "all")):
        targets, rslora = ADAPTERS[name]
        make_adapter(base, str(root / name), targets, rslora, seed=20 + i)
        requests[name] = LoRARequest(name, i + 1, str(root / name))
    return str(root / "base"), requests


def _run(engine: Engine, requests: dict) -> dict:
    prompts = [list(range(100, 123)), [5, 6, 5, 6, 5, 6], list(range(2000, 2037))]
    for j, prompt in enumerate(prompts):
        for name in [None, *requests]:
            engine.add_request(f"{name}-{j}", prompt,
                               SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2),
                               lora_request=requests[name] if name else None)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        check_engine_invariants(engine)
    return done


@pytest.mark.parametrize("max_loras, backend", [(2, "mp"), (1, "mp"), pytest.param(2, "ray", marks=pytest.mark.ray)])
def test_tp2_lora_matches_tp1_on_a_mixed_batch(setup, max_loras, backend):
    if backend == "ray":
        pytest.importorskip("ray")
    path, requests = setup
    args = {**_ARGS, "max_loras": max_loras}  # 1 slot: the two adapters take turns (followers swap too)
    ref = _run(Engine(EngineArgs(model=path, **args)), requests)
    engine = Engine(EngineArgs(model=path, tensor_parallel_size=2, distributed_executor_backend=backend, **args))
    try:
        out = _run(engine, requests)
        driver = engine.core.executor.worker
        qkv = driver.model.layers[0].self_attn.qkv_proj
        assert qkv.tp_size == 2 and qkv.lora_b.shape[-1] == qkv.output_size  # B holds this rank's outputs only
        if max_loras == 1:
            assert driver.lora.num_slot_loads > 2  # swapped back and forth
    finally:
        engine.core.executor.shutdown()
    assert out.keys() == ref.keys()
    # the adapters change the model (so equal tokens say something about the sharded deltas)
    assert len({tuple(ref[f"{n}-0"].token_ids) for n in [None, *requests]}) == 3
    for rid, a in ref.items():
        b = out[rid]
        assert b.token_ids == a.token_ids, rid
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la), rid
    assert not torch.distributed.is_initialized()
