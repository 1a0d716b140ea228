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


def test_half_precision(kernels):
    from kvserve.attention.triton_paged import TritonPagedBackend

    step = windowed_step(3, DECODES, PREFILLS, block_size=16, hq=8, hkv=2, d=32, window=11, dtype=torch.float16)
    out = _forward(TritonPagedBackend(kernels), step, 32, 11, 2.0)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), dense_windowed(step, 32 ** -0.5, 11, 2.0), atol=2e-2, rtol=2e-2)
