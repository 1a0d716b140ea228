"""The paged attention kernel built for AVX2 + FMA (KVSERVE_CPU_ISA=avx2: -march=haswell, 8 lanes) against
torch_ref, in a fresh process so that the variable reaches the build (tests/helpers/attention_isa.py: decodes,
draft verification, prefill tiles, shared prefixes, windows, soft caps, every cache dtype, the KV writes and the
Hadamard rotation). The default build (AVX-512 here) is what the unit tests run. Skipped where this CPU cannot
run the variant."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.utils.cpu_isa import supported_isas

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("isa", ["avx2"])
def test_isa_build_matches_torch_ref(isa):
    if isa not in supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} build")
    env = dict(os.environ, KVSERVE_CPU_ISA=isa,
               PYTHONPATH=os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH")))))
    run = subprocess.run([sys.executable, "-m", "tests.helpers.attention_isa"], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert f"kvserve_paged_attention_{isa}_" in run.stdout and "match torch_ref" in run.stdout, run.stdout
