"""The C++ kernel cache (utils/cpp_extension.py, build_extension): one build per source/flags/environment/CPU,
shared by every checkout, and a logged PyTorch fallback when nothing can be built.

A tiny extension stands in for the real kernels; the whole file compiles it once (test_two_checkouts_build_once).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvserve import envs
from kvserve.utils import cpp_extension
from kvserve.utils.cpp_extension import build_extension, kernel_key
from kvserve.utils.cpu_isa import selected_isa

TINY_SOURCE = """\
#include <torch/extension.h>

int64_t add(int64_t a, int64_t b) { return a + b; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""
REPO_ROOT = Path(__file__).resolve().parents[2]


def _checkout(root: Path, name: str) -> Path:
    """A stand-in checkout holding the tiny source at its own path."""
    source = root / name / "csrc" / "tiny.cpp"
    source.parent.mkdir(parents=True)
    source.write_text(TINY_SOURCE)
    return source


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(path))
    return path


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert envs.cache_dir() == str(tmp_path / "explicit")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", "")  # empty counts as unset
    assert envs.cache_dir() == str(tmp_path / "xdg" / "kvserve")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert envs.cache_dir() == str(tmp_path / "home" / ".cache" / "kvserve")


def test_key_follows_source_flags_and_environment(tmp_path, monkeypatch):
    code = _checkout(tmp_path, "one").read_bytes()
    cflags, ldflags = ["-O3", "-march=native"], ["-fopenmp"]
    base = kernel_key(code, cflags, ldflags)

    assert kernel_key(_checkout(tmp_path, "two").read_bytes(), cflags, ldflags) == base  # same text, other path
    assert kernel_key(code + b"// edited\n", cflags, ldflags) != base
    assert kernel_key(code, ["-O2", "-march=native"], ldflags) != base
    assert kernel_key(code, cflags, []) != base
    for target, attr, value in [(sys, "prefix", "/another/venv"), (sys, "version", "3.99.0"),
                                (torch, "__version__", "9.9.9"), (cpp_extension, "_cpu_tag", lambda: "othercpu")]:
        with monkeypatch.context() as m:
            m.setattr(target, attr, value)
            assert kernel_key(code, cflags, ldflags) != base, attr
    assert kernel_key(code, cflags, ldflags) == base


_LOAD_SCRIPT = textwrap.dedent("""
    import json, logging, sys, time
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from kvserve.utils.cpp_extension import build_extension
    start = time.perf_counter()
    module = build_extension("kvserve_test_tiny", sys.argv[1], "tiny test")
    print(json.dumps({"seconds": time.perf_counter() - start, "sum": module.add(2, 3) if module else None}))
""")


def _start_load(source: Path, cache_dir: Path, **env: str) -> subprocess.Popen:
    """A fresh process (as a server start would be) loading the tiny kernel from `source`."""
    return subprocess.Popen([sys.executable, "-c", _LOAD_SCRIPT, str(source)], cwd=REPO_ROOT,
                            env={**os.environ, "KVSERVE_CACHE_DIR": str(cache_dir), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def test_two_checkouts_build_once(tmp_path, cache_dir):
    sources = [_checkout(tmp_path, name) for name in ("checkout1", "checkout2", "checkout3")]
    name = cpp_extension.kernel_module_name("kvserve_test_tiny", TINY_SOURCE.encode(), selected_isa())
    build_dir = cache_dir / "kernels" / name
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()  # torch's baton, as left by a build that was killed

    # Two checkouts start at once on an empty cache: one compiles, the other waits for it.
    results = [_finish(p) for p in [_start_load(s, cache_dir) for s in sources[:2]]]
    assert [r["sum"] for r, _ in results] == [5, 5]
    logs = "".join(err for _, err in results)
    assert logs.count("building kernels: tiny test") == 1 and logs.count("built kernels: tiny test") == 1

    # A third checkout loads the cached build without compiling: a missing compiler proves no build was tried.
    result, err = _finish(_start_load(sources[2], cache_dir, CXX="/nonexistent/c++"))
    assert result["sum"] == 5
    assert "building kernels" not in err and "unavailable" not in err
    assert result["seconds"] < 5.0
    assert [p.name for p in (cache_dir / "kernels").iterdir()] == [build_dir.name]
    build_files = (build_dir / "build.ninja").read_text()
    assert not any(str(s.parents[1]) in build_files for s in sources)  # the build never names a checkout


def test_no_compiler_falls_back_with_warning(tmp_path, cache_dir, monkeypatch, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    caplog.set_level(logging.INFO, logger=cpp_extension.__name__)
    assert build_extension("kvserve_test_tiny", str(_checkout(tmp_path, "checkout")), "tiny test") is None
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and r.name == cpp_extension.__name__]
    assert len(warnings) == 1
    assert "tiny test" in warnings[0] and "PyTorch path" in warnings[0] and "no-such-compiler" in warnings[0]


def test_kernel_sources_build_without_avx512():
    """Every C++ kernel compiles for a CPU without AVX-512 (x86-64-v2), where its vector paths are left out:
    built with -march=native on such a machine, a compile error would silently drop to the PyTorch fallback.
    Syntax and types only (-fsyntax-only), against torch's headers."""
    import glob
    import shutil
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    root = os.path.join(os.path.dirname(__file__), "..", "..", "kvserve")
    sources = sorted(glob.glob(os.path.join(root, "**", "csrc", "*.cpp"), recursive=True))
    assert len(sources) >= 3
    includes = [f"-I{p}" for p in include_paths() + [sysconfig.get_paths()["include"]]]
    procs = [(src, subprocess.Popen([compiler, "-std=c++17", "-fsyntax-only", "-march=x86-64-v2", "-fopenmp",
                                     "-DTORCH_EXTENSION_NAME=kvserve_check", *includes, src],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
             for src in sources]
    failed = {os.path.relpath(src, root): p.communicate()[0][-2000:] for src, p in procs if p.wait() != 0}
    assert not failed, failed
