"""KVSERVE_CPU_ISA in an engine: the instruction sets it runs are logged once at start-up, and a forced avx2
makes the choices an AVX2 CPU would (no native bfloat16, so `--dtype auto` stays fp32 for a bf16 checkpoint),
whatever this CPU has."""
from __future__ import annotations

import logging

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.config.model import resolve_dtype
from kvserve.engine.engine import Engine
from kvserve.layers.linear_methods import default_method
from kvserve.layers.quant.bf16 import Bf16WidenMethod
from kvserve.utils import cpu_features
from kvserve.utils.cpu_isa import supported_isas

CPU = torch.device("cpu")


def test_engine_logs_the_instruction_sets_it_runs(tiny_llama, caplog):
    path, _ = tiny_llama
    with caplog.at_level(logging.INFO, logger="kvserve"):
        Engine(EngineArgs(model=path, num_gpu_blocks_override=16))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU instruction sets:")]
    assert lines == [f"CPU instruction sets: {cpu_features.describe_isa()}"]


def test_forced_avx2_chooses_as_an_avx2_cpu(monkeypatch):
    if "avx2" not in supported_isas():
        pytest.skip("this CPU cannot run AVX2")
    monkeypatch.setattr(cpu_features, "_cpu_bf16", lambda: True)   # as on a CPU with AVX512_BF16
    assert resolve_dtype("auto", CPU, torch.bfloat16) == (torch.bfloat16 if cpu_features.native_bf16()
                                                          else torch.float32)
    monkeypatch.setenv("KVSERVE_CPU_ISA", "avx2")
    assert not cpu_features.native_bf16()
    assert resolve_dtype("auto", CPU, torch.bfloat16) == torch.float32
    # bf16 weights kept, products in fp32: no emulated bf16 matmul (layers/quant/bf16.py)
    assert isinstance(default_method(CPU, torch.bfloat16), Bf16WidenMethod)
