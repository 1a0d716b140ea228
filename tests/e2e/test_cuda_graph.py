"""CUDA graphs for decode-only steps (worker/cuda_graph.py) and CUDA memory planning (worker/memory_plan.py):
the ladder, the bucket choice, the padding and the pool arithmetic on CPU; capture and replay in the tests
marked `gpu`."""
from __future__ import annotations

import json

import pytest
import torch

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.model_loader.dummy import builtin_config_dir
from kvserve.worker.cuda_graph import DecodeGraphBuffers, bucket_for, capture_sizes, graphable
from kvserve.worker.memory_plan import CudaMemoryPlan

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_ladder_is_vllms_and_covers_max_num_seqs():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(10_000)[-1] == 512
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_bucket_is_the_smallest_size_that_holds_the_batch():
    sizes = capture_sizes(64)
    assert [bucket_for(sizes, n) for n in (1, 2, 3, 5, 8, 9, 63, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert bucket_for(sizes, 65) is None  # eager


def _decode_meta(seq_lens, width, block_size=16):
    n = len(seq_lens)
    table = torch.arange(n * width).view(n, width) + 1
    slots = torch.tensor([int(table[i, (s - 1) // block_size]) * block_size + (s - 1) % block_size
                          for i, s in enumerate(seq_lens)])
    return CommonAttentionMetadata(query_start_loc=torch.arange(n + 1), seq_lens=torch.tensor(seq_lens),
                                   block_table=table, slot_mapping=slots, num_decodes=n, num_decode_tokens=n,
                                   block_size=block_size, query_lens_cpu=[1] * n, seq_lens_cpu=list(seq_lens))


def test_padding_writes_nowhere_and_reads_nothing():
    buffers = DecodeGraphBuffers.allocate(8, 4, torch.device("cpu"))
    big = _decode_meta([40, 3, 17, 9, 64, 1], 4)
    buffers.fill(8, torch.arange(6) + 100, torch.tensor(big.seq_lens_cpu) - 1, big)  # a bigger batch first
    small = _decode_meta([5, 33, 20], 3)
    buffers.fill(4, torch.tensor([7, 8, 9]), torch.tensor([4, 32, 19]), small)
    meta = buffers.metadata(4, 16)
    assert buffers.input_ids[:4].tolist() == [7, 8, 9, 0]
    assert buffers.positions[:4].tolist() == [4, 32, 19, 0]
    assert meta.slot_mapping.tolist() == small.slot_mapping.tolist() + [-1]   # the padded row writes nowhere
    assert meta.seq_lens.tolist() == [5, 33, 20, 0]                          # ... and attends to nothing
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(meta.block_table[:3, :3], small.block_table)
    assert meta.num_decodes == 4 and meta.block_table.shape == (4, 4)


def test_only_plain_decode_steps_replay():
    meta = _decode_meta([5, 9], 2)
    assert graphable(meta, 2, max_blocks=4)
    assert not graphable(meta, 2, max_blocks=1)                               # tables wider than the buffers
    mixed = CommonAttentionMetadata(**{**meta.__dict__, "num_decodes": 1, "num_decode_tokens": 1,
                                       "query_lens_cpu": [1, 4]})
    assert not graphable(mixed, 5, max_blocks=4)
    drafts = CommonAttentionMetadata(**{**meta.__dict__, "decode_groups": torch.tensor([0, 2])})
    assert not graphable(drafts, 2, max_blocks=4)


def test_memory_plan_takes_the_utilization_minus_what_is_in_use():
    gib = 2 ** 30
    plan = CudaMemoryPlan(total_bytes=140 * gib, utilization=0.9, in_use_bytes=17 * gib,
                          activation_peak_bytes=2 * gib)
    assert plan.kv_cache_bytes == int(0.9 * 140 * gib) - 19 * gib
    assert plan.num_blocks(2 * 2 ** 20) == plan.kv_cache_bytes // (2 * 2 ** 20)
    assert CudaMemoryPlan(100, 0.5, 60, 0).num_blocks(1) == 0
    assert "GiB for the KV cache" in plan.describe()


def test_enforce_eager_flag():
    from kvserve.config import EngineArgs

    assert EngineArgs().enforce_eager is False
    assert EngineArgs(enforce_eager=True).create_engine_config().device.enforce_eager


def _dummy_smollm2(folder, **changes) -> None:
    """A config.json in `folder`: SmolLM2-135M's shape with `changes` (load_format="dummy" gives it weights)."""
    cfg = json.load(open(f"{builtin_config_dir('SmolLM2-135M')}/config.json"))
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_warm_up_forward_runs_at_the_largest_batch_on_cpu(tmp_path):
    """The warm-up the CUDA plan measures is device-independent code: run it on CPU on a tiny model."""
    from kvserve.config import EngineArgs
    from kvserve.worker.worker import Worker

    _dummy_smollm2(tmp_path, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    args = EngineArgs(model=str(tmp_path), load_format="dummy", max_num_batched_tokens=100, max_num_seqs=8,
                      attention_backend="torch_ref", speculative_config=None)
    worker = Worker(args.create_engine_config())
    worker.load_model()
    worker._warm_up()  # 100 tokens > max_model_len 64: positions wrap, blocks cover all 100


@pytest.mark.gpu
@cuda
def test_cuda_graphs_match_eager_greedy(tmp_path):
    """A tiny dummy model served with and without graphs: the same greedy tokens, and graphs replayed."""
    from kvserve import LLM, SamplingParams

    _dummy_smollm2(tmp_path, num_hidden_layers=4, max_position_embeddings=512)
    prompts = [list(range(1 + i, 30 + 7 * i)) for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        # NOTE: a fixed pool, not a share of what is free: the other run's pool may not be collected yet
        llm = LLM(model=str(tmp_path), load_format="dummy", device="cuda", enforce_eager=eager,
                  max_num_seqs=8, speculative_config=None, num_gpu_blocks_override=256)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        runner = llm.engine.core.executor.worker.runner
        assert (runner.cuda_graphs is None) == eager
        if not eager:
            assert runner.cuda_graphs.num_replays > 0
        del llm, runner
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]


@pytest.mark.gpu
@cuda
def test_seeded_device_sampling_is_batch_invariant(tmp_path):
    """Seeded requests draw from their own CUDA generators: same tokens alone or in a batch."""
    from kvserve import LLM, SamplingParams

    _dummy_smollm2(tmp_path, num_hidden_layers=2, max_position_embeddings=512)
    llm = LLM(model=str(tmp_path), load_format="dummy", device="cuda", max_num_seqs=8, speculative_config=None,
              num_gpu_blocks_override=256)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], seeded)[0].outputs[0].token_ids
    batch = llm.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4]], [other, seeded, other])
    assert batch[1].outputs[0].token_ids == alone


class _EagerReplay:
    """Stands in for a captured CUDA graph on the CPU: replay re-runs the captured forward into its output."""

    def __init__(self, forward, out):
        self.forward, self.out = forward, out

    def replay(self):
        self.out.copy_(self.forward())


def test_replay_path_pads_and_matches_transformers_on_cpu(tiny_llama):
    """The graph path minus the graph: steps go through the static buffers, padded up to the ladder's sizes
    (slot -1, seq_len 0 rows included), on triton_paged under the interpreter, and still give transformers'
    greedy tokens."""
    import os
    import random

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (no CUDA here) or a GPU (the gpu tests)")
    from kvserve.config import EngineArgs
    from kvserve.engine.engine import Engine
    from kvserve.worker.cuda_graph import CudaGraphRunner
    from tests.helpers.oracles import assert_matches_hf

    path, hf = tiny_llama
    engine = Engine(EngineArgs(model=path, attention_backend="triton_paged", num_gpu_blocks_override=40,
                               max_num_batched_tokens=64, max_num_seqs=5, speculative_config=None))
    worker = engine.core.executor.worker
    runner = worker.runner
    graphs = CudaGraphRunner(worker.model, worker.backend, runner.kv_caches, 5, 8, 16, torch.device("cpu"))
    assert graphs.sizes == [1, 2, 4, 8]
    with torch.inference_mode():
        for size in graphs.sizes:
            forward = (lambda s: lambda: graphs._forward(s))(size)
            out = forward()
            graphs.graphs[size] = (_EagerReplay(forward, out), out)
    runner.cuda_graphs = graphs
    rng = random.Random(2)
    reqs = [([rng.randrange(3, 49152) for _ in range(n)], m) for n, m in [(3, 9), (20, 6), (9, 12)]]
    assert_matches_hf(None, reqs, hf, engine=engine)  # 3 decodes pad to 4, 2 to 2, 1 to 1
    assert graphs.num_replays > 0
