"""triton_paged with sliding windows and logit soft caps, through Triton's interpreter on CPU tensors, against
dense masked attention and torch_ref: mixed steps (decodes, draft-verifying rows, prefill chunks after context)
whose blocks before each window are poisoned (a kernel that loads a freed block returns NaN), windows below the
block size, not a multiple of it and beyond every sequence, GQA, soft cap on and off, split-KV decodes.
Skipped when triton is not installed (as tests/e2e/test_triton_attention.py)."""
from __future__ import annotations

import importlib
import os

import pytest
import torch

from kvserve.attention.torch_ref import TorchRefBackend
from tests.helpers.windowed_attention import dense_windowed, windowed_step

pytest.importorskip("triton")

DECODES = [(40, 1), (3, 1), (70, 3)]
PREFILLS = [(0, 37), (50, 20), (20, 70)]


@pytest.fixture(scope="module")
def kernels():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET=1 was not set before triton was imported")
    return importlib.import_module("kvserve.attention.triton_kernels")


def _forward(backend, step, d, window, soft_cap):
    return backend.forward(step.q, step.k, step.v, step.cache.clone(), backend.build_metadata(step.common),
                           d ** -0.5, sliding_window=window, logits_soft_cap=soft_cap)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("soft_cap", [None, 2.0])
@pytest.mark.parametrize("window", [1, 5, 16, 23, 1000])
@pytest.mark.parametrize("block_size, hq, hkv", [(16, 4, 2), (32, 6, 1)])
def test_mixed_step_matches_dense_and_reference(kernels, window, soft_cap, splits, block_size, hq, hkv):
    from kvserve.attention.triton_paged import TritonPagedBackend

    d = 32
    step = windowed_step(window + block_size + hq, DECODES, PREFILLS, block_size=block_size, hq=hq, hkv=hkv, d=d,
                         window=window)
    assert window > 30 or step.poisoned > 0
    out = _forward(TritonPagedBackend(kernels, decode_splits=splits), step, d, window, soft_cap)
    torch.testing.assert_close(out, dense_windowed(step, d ** -0.5, window, soft_cap), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, _forward(TorchRefBackend(), step, d, window, soft_cap), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_table_entries_before_the_window_are_not_read(kernels, splits):
    """Freed blocks' table entries holding -1 (no block at all): no program loads them."""
    from kvserve.attention.triton_paged import TritonPagedBackend

    step = windowed_step(9, DECODES, PREFILLS, block_size=16, hq=4, hkv=2, d=32, window=9, stale_id=-1)
    assert (step.common.block_table == -1).any()
    out = _forward(TritonPagedBackend(kernels, decode_splits=splits), step, 32, 9, None)
    torch.testing.assert_close(out, dense_windowed(step, 32 ** -0.5, 9, None), atol=1e-5, rtol=1e-5)


def test_half_precision(kernels):
    from kvserve.attention.triton_paged import TritonPagedBackend

    step = windowed_step(3, DECODES, PREFILLS, block_size=16, hq=8, hkv=2, d=32, window=11, dtype=torch.float16)
    out = _forward(TritonPagedBackend(kernels), step, 32, 11, 2.0)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), dense_windowed(step, 32 ** -0.5, 11, 2.0), atol=2e-2, rtol=2e-2)


def test_engine_on_triton_paged_matches_transformers(kernels, tmp_path):
    """A tiny Mistral windowing every layer (W 12) through the whole engine on the Triton backend (interpreted):
    chunked prefill, preemption and n-gram drafts give transformers' greedy tokens."""
    import random

    from kvserve.config import EngineArgs
    from kvserve.engine.engine import Engine
    from tests.helpers.architectures import make_checkpoint
    from tests.helpers.oracles import assert_matches_hf

    hf = make_checkpoint(str(tmp_path), "mistral_sliding", seed=2)
    rng = random.Random(5)
    reqs = [([rng.randrange(3, 49152) for _ in range(n)], m) for n, m in [(1, 20), (37, 10), (45, 8)]]
    reqs.append(([7, 8, 9] * 12, 12))  # repetitive: n-gram drafts get proposed and verified
    engine = Engine(EngineArgs(model=str(tmp_path), attention_backend="triton_paged", num_gpu_blocks_override=5,
                               max_num_batched_tokens=16, max_num_seqs=4,
                               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                   "prompt_lookup_min": 1, "prompt_lookup_max": 2,
                                                   "adaptive": False}))
    assert engine.core.executor.worker.backend.name == "triton_paged"
    assert_matches_hf(None, reqs, hf, engine=engine)
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.scheduler.stats.num_spec_drafts > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window, soft_cap, splits", [(7, None, None), (100, 30.0, None), (333, 30.0, 1)])
def test_gpu_kernels_match_dense(dtype, block_size, window, soft_cap, splits):
    """The compiled kernels on the GPU, head_dim 128 and Llama-3's GQA ratio, long contexts (the SM-count split
    heuristic over the window's pages), against dense attention in float64."""
    from kvserve.attention.backend import CommonAttentionMetadata
    from kvserve.attention.triton_paged import TritonPagedBackend

    step = windowed_step(block_size, [(100, 1), (31, 1), (500, 4), (17, 1)], [(0, 70), (64, 3), (250, 130)],
                         block_size=block_size, hq=32, hkv=8, d=128, window=window, dtype=dtype)
    fields = {f: getattr(step.common, f) for f in step.common.__dataclass_fields__}
    on_gpu = CommonAttentionMetadata(**{f: x.cuda() if isinstance(x, torch.Tensor) else x for f, x in fields.items()})
    tri = TritonPagedBackend(decode_splits=splits)
    out = tri.forward(step.q.cuda(), step.k.cuda(), step.v.cuda(), step.cache.cuda(), tri.build_metadata(on_gpu),
                      128 ** -0.5, sliding_window=window, logits_soft_cap=soft_cap)
    torch.testing.assert_close(out.float().cpu(), dense_windowed(step, 128 ** -0.5, window, soft_cap), atol=2e-2,
                               rtol=2e-2)
