"""Test tiers, markers and the session fixtures.

tests/unit    no model: data structures, scheduler, kernels vs PyTorch, parsers, arithmetic
tests/engine  tiny checkpoints in process (golden vs transformers, prefix cache, spec decode, LoRA, ...)
tests/server  the HTTP app in process
tests/e2e     subprocess servers, README blocks, TP/Ray, kernel builds, Triton interpreter, SmolLM2, GPU

Each test is marked with its tier's name (`pytest -m engine`). Engine-tier tests parametrised over the CPU
attention backends run the first of them only, unless pytest is given --all-backends (`make test` does).
Helpers live in tests/helpers/ (imported as `tests.helpers.X`; pyproject puts the repository on sys.path).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.engine import ATTENTION_BACKENDS

# NOTE: without CUDA, Triton kernels can only run through Triton's interpreter, which triton reads when it is
# first imported (its own library functions are decorated then): set here, before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "engine", "server", "e2e")

# Fixtures defined beside their helpers: OpenAI's schemas (`check_schema`, tests/helpers/openai_schemas.py)
# and the tiny-model `kvserve serve` of the bench tests (tests/helpers/bench.py).
pytest_plugins = ["tests.helpers.openai_schemas", "tests.helpers.bench"]


def pytest_addoption(parser):
    parser.addoption("--fuzz-examples", type=int, default=15,
                     help="hypothesis examples per fuzzed endpoint (tests/server/test_fuzz.py); more finds more")
    parser.addoption("--all-backends", action="store_true",
                     help="run the engine tier on every CPU attention backend (default: cpu_paged only)")


def _tier(item) -> str | None:
    path = Path(str(item.path)).resolve()
    for tier in TIERS:
        if path.is_relative_to(TESTS / tier):
            return tier
    return None


def pytest_collection_modifyitems(config, items):
    keep, dropped = [], []
    for item in items:
        tier = _tier(item)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
        backend = getattr(item, "callspec", None) and item.callspec.params.get("backend")
        if (tier == "engine" and backend in ATTENTION_BACKENDS[1:] and not config.getoption("--all-backends")):
            dropped.append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(arch="llama", tie=False, seed=0) -> (path, HF model), written once a session for each
    (arch, tie, seed). Shared: a test copies the HF model before changing it and writes nothing into the path."""
    made = {}

    def get(arch: str = "llama", tie: bool = False, seed: int = 0):
        if (arch, tie, seed) not in made:
            path = str(tmp_path_factory.mktemp(f"tiny_{arch}{'_tied' if tie else ''}_{seed}"))
            made[arch, tie, seed] = path, make_tiny_checkpoint(path, arch, tie, seed)
        return made[arch, tie, seed]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoint):
    """(path, HF model) of a tiny Llama with untied embeddings."""
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def smollm2_path():
    from kvserve.model_loader.gguf_loader import builtin_model_path

    return builtin_model_path()
