"""Tensor parallelism (gloo, 2 ranks on CPU): output identical to one rank, shards read from the
checkpoint, clean shutdown, and a dead worker ends the engine with an error.

Spawning a rank costs seconds on a small machine, so one module-scoped pair of engines (TP=1, TP=2)
serves every equivalence check; the failure tests start their own.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.llm import LLM
from kvserve.layers.parallel import ShardContext
from kvserve.sampling_params import SamplingParams
from tests.helpers.tensor_parallel import TP_ARGS, assert_same_outputs, run_tp, tp_mixed_batch

def _pids_alive(pids):
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes only once reaped
            if f.read().split()[2] != "Z":
                alive.append(pid)
    return alive


@pytest.fixture(scope="module")
def engines(tiny_llama):
    path = tiny_llama[0]
    tp1 = LLM(path, **TP_ARGS)
    tp2 = LLM(path, tensor_parallel_size=2, **TP_ARGS)
    yield tp1, tp2
    tp2.shutdown()


def test_tp2_matches_tp1_on_a_mixed_batch(engines):
    tp1, tp2 = engines
    prompts, params = tp_mixed_batch()
    ref, out = run_tp(tp1, prompts, params), run_tp(tp2, prompts, params)
    assert tp2.engine.scheduler.stats.num_preemptions > 0  # the small pool preempted (same in both)
    assert tp2.engine.scheduler.stats.num_prefix_hit_tokens > 0
    assert tp2.engine.scheduler.stats.num_spec_drafts > 0
    assert_same_outputs(ref, out)
    pa, pb = ref[2].prompt_logprobs, out[2].prompt_logprobs
    assert len(pa) == len(pb) and all((x is None) == (y is None) for x, y in zip(pa, pb))
    for x, y in zip(pa[1:], pb[1:]):
        assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def test_each_rank_holds_its_share(engines):
    tp1, tp2 = engines
    spec1, spec2 = tp1.engine.core.kv_spec, tp2.engine.core.kv_spec
    assert spec2.num_kv_heads * 2 == spec1.num_kv_heads and spec2.num_bytes * 2 == spec1.num_bytes
    w1 = sum(p.numel() for p in tp1.engine.core.executor.worker.model.parameters())
    w2 = sum(p.numel() for p in tp2.engine.core.executor.worker.model.parameters())
    norms = sum(p.numel() for n, p in tp1.engine.core.executor.worker.model.named_parameters() if "norm" in n)
    assert w2 == (w1 - norms) // 2 + norms  # everything but the norms is split
    stats = tp2.engine.core.executor.group.stats
    assert stats.steps > 0 and stats.all_reduce_bytes > 0 and stats.broadcast_bytes > 0


def test_shutdown_ends_every_worker(engines):
    _, tp2 = engines
    executor = tp2.engine.core.executor
    pids = executor.worker_pids
    assert _pids_alive(pids)
    tp2.shutdown()
    assert [p.returncode for p in executor._procs] == [0]  # they left on the stop message, not killed
    assert not _pids_alive(pids)
    assert not torch.distributed.is_initialized()


def test_heads_the_rank_count_does_not_divide_are_refused(smollm2_path):
    with pytest.raises(ValueError, match=r"does not divide the model's 9 attention heads .*sizes that work: 1, 3, 9"):
        EngineArgs(model=smollm2_path, tensor_parallel_size=2).create_engine_config()

def test_ray_without_ray_installed_is_refused(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"needs Ray.*kvserve\[ray\]"):
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="ray")


def test_a_worker_that_fails_to_start_is_reported(tiny_llama):
    # a budget that holds no block fails on the worker too; the driver reports the worker's error
    with pytest.raises(RuntimeError, match="rank 1 failed to load its shard: ValueError: the KV-cache budget"):
        LLM(tiny_llama[0], tensor_parallel_size=2, kv_cache_memory="1KiB", num_threads=1)
    assert not _child_workers() and not torch.distributed.is_initialized()


def test_a_killed_worker_fails_in_flight_requests(tiny_llama):
    async def main():
        from kvserve.engine.async_engine import AsyncEngine

        engine = AsyncEngine(EngineArgs(model=tiny_llama[0], tensor_parallel_size=2, num_threads=1,
                                        kv_cache_memory="8MiB"), use_process=False)
        await engine.start()
        workers = _child_workers()
        assert len(workers) == 1
        stream = await engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=1000,
                                                                         ignore_eos=True))
        await stream.__anext__()
        os.kill(workers[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(Exception, match="engine"):
            async for _ in stream:
                pass
        assert time.monotonic() - start < 30
        assert not engine.is_running and "internal error" in engine.dead_reason
        await engine.shutdown()
        assert not _pids_alive(workers) and not torch.distributed.is_initialized()

    asyncio.run(main())


def _child_workers() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == os.getpid() and b"kvserve.worker.tp_worker" in cmd:
            pids.append(int(entry))
    return pids


# ---- shards read from the checkpoint (no processes) -------------------------------------------------
@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_a_rank_reads_only_its_slices(tiny_llama, tmp_path, num_kv_heads):
    """Rank 1 of 2 built from lazily read slices holds exactly the eager checkpoint's rows and columns;
    with one KV head, both ranks hold it (replicated)."""
    from kvserve.attention.registry import make_backend
    from kvserve.layers.linear_methods import DenseMethod
    from kvserve.model_loader.loader import ModelSource, iter_checkpoint_tensors, load_hf_config
    from kvserve.model_loader.weight_loader import load_weights
    from kvserve.models.build import build_model

    path, hf = tiny_llama
    if num_kv_heads == 1:  # the same weights as MQA: keep the first KV head
        import copy

        import transformers as tf
        cfg = copy.deepcopy(hf.config)
        cfg.num_key_value_heads = 1
        mqa = tf.LlamaForCausalLM(cfg).eval()
        d = cfg.hidden_size // cfg.num_attention_heads
        mqa.load_state_dict({k: (v[:d] if ("k_proj" in k or "v_proj" in k) else v) for k, v in hf.state_dict().items()})
        mqa.save_pretrained(str(tmp_path))
        path, hf = str(tmp_path), mqa
    source = ModelSource("hf", path)
    cfg = load_hf_config(source)
    backend = make_backend("torch_ref", "cpu")
    model = build_model(cfg, backend, 64, torch.float32, torch.device("cpu"), DenseMethod(),
                        ShardContext(1, 2, lambda x: x, lambda x: x))
    load_weights(model, iter_checkpoint_tensors(source, torch.float32, lazy=True))
    ref = hf.state_dict()
    d, q = cfg.head_dim, cfg.num_attention_heads // 2
    attn = model.layers[0].self_attn
    qkv = attn.qkv_proj.weight
    kv_rows = slice(d, 2 * d) if num_kv_heads == 2 else slice(0, d)
    assert torch.equal(qkv[:q * d], ref["model.layers.0.self_attn.q_proj.weight"][q * d:])
    assert torch.equal(qkv[q * d:(q + 1) * d], ref["model.layers.0.self_attn.k_proj.weight"][kv_rows])
    assert torch.equal(qkv[(q + 1) * d:], ref["model.layers.0.self_attn.v_proj.weight"][kv_rows])
    half = attn.o_proj.weight.shape[1]
    assert torch.equal(attn.o_proj.weight, ref["model.layers.0.self_attn.o_proj.weight"][:, half:])
    vocab = cfg.vocab_size // 2
    assert torch.equal(model.embed_tokens.weight, ref["model.embed_tokens.weight"][vocab:])
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"][vocab:])
    inter = cfg.intermediate_size // 2
    assert torch.equal(model.layers[1].mlp.down_proj.weight, ref["model.layers.1.mlp.down_proj.weight"][:, inter:])
    assert torch.equal(model.layers[1].mlp.gate_up_proj.weight[inter:],
                       ref["model.layers.1.mlp.up_proj.weight"][inter:])


def test_gguf_slices_equal_the_whole_tensor(smollm2_path):
    import itertools

    from kvserve.model_loader.gguf_loader import iter_gguf_tensors

    eager = dict(itertools.islice(iter_gguf_tensors(smollm2_path), 12))
    checked = 0
    for name, lazy in itertools.islice(iter_gguf_tensors(smollm2_path, lazy=True), 12):
        if not hasattr(lazy, "materialize"):
            continue
        full = eager[name]
        rows, cols = full.shape
        assert torch.equal(lazy.narrow(0, rows // 3, rows // 3).narrow(1, 32, cols - 64).materialize(),
                           full[rows // 3:2 * (rows // 3), 32:cols - 32]), name
        assert torch.equal(lazy.narrow(1, 5, 7).materialize(), full[:, 5:12]), name  # not block-aligned
        checked += 1
    assert checked >= 8  # q and k (un-permuted rows), v, o, gate, up, down, the embedding


def test_sigterm_to_the_driver_ends_its_workers(tiny_llama, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    script.write_text(
        "import sys, time\n"
        "from kvserve.engine.llm import LLM\n"
        f"llm = LLM({tiny_llama[0]!r}, tensor_parallel_size=2, kv_cache_memory='8MiB', num_threads=1)\n"
        "print(*llm.engine.core.executor.worker_pids, flush=True)\n"
        "time.sleep(600)\n")
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": root})
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 1 and _pids_alive(pids)
        driver.send_signal(signal.SIGTERM)
        driver.wait(30)
        deadline = time.monotonic() + 10
        while _pids_alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _pids_alive(pids), "a worker outlived its driver"
    finally:
        driver.kill()


@pytest.mark.slow
def test_smollm2_over_three_ranks_matches_one(smollm2_path):
    """SmolLM2's 9 heads / 3 KV heads split over 3 ranks (one KV head each): the same greedy tokens."""
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(2000, 2040)), [28, 29, 30]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLM(smollm2_path, kv_cache_memory="64MiB", num_threads=1).generate(prompts, params, use_tqdm=False)
    tp3 = LLM(smollm2_path, tensor_parallel_size=3, kv_cache_memory="64MiB", num_threads=1)
    try:
        out = tp3.generate(prompts, params, use_tqdm=False)
    finally:
        tp3.shutdown()
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
