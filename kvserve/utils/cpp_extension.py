"""The cache every C++ kernel (attention/csrc, layers/quant/csrc, models/csrc) is built into: `build_extension`.
Kernels are built with torch's cpp_extension (ninja + the system C++ compiler).

Why our own cache rather than torch's extension dir: torch names a build by the extension name only and its
build files hold the source's absolute path, so two checkouts (or two venvs) rebuild each other's kernels on
every start. Here each build has its own directory under `<envs.cache_dir()>/kernels`, named by `kernel_key`,
and compiles a copy of the source placed in that directory: the build never mentions a checkout, and every
checkout with the same source, flags and environment loads the one build.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import time
from collections.abc import Iterator, Sequence

import kvserve.envs as envs
from kvserve.utils.cpu_isa import isa_cflags, selected_isa

logger = logging.getLogger(__name__)

_CFLAGS = ("-O3", "-fopenmp", "-ffast-math")
_LDFLAGS = ("-fopenmp",)


def _cpu_tag() -> str:
    """A short digest of this CPU's instruction-set flags. The build uses -march=native, and the kernel cache
    outlives the machine it was built on (a shared home directory): a new CPU must not load an old build."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def kernel_key(code: bytes, cflags: Sequence[str], ldflags: Sequence[str]) -> str:
    """Digest of everything that makes two builds differ: the source text (not its path), the compiler flags,
    the Python environment the module links against (venv, Python, torch) and this CPU's instruction set."""
    import torch

    parts = (hashlib.sha256(code).hexdigest(), " ".join(cflags), " ".join(ldflags),
             sys.prefix, sys.version, torch.__version__, _cpu_tag())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def build_cflags(isa: str) -> tuple[str, ...]:
    return (*_CFLAGS, *isa_cflags(isa))


def kernel_module_name(name: str, code: bytes, isa: str) -> str:
    """The build's name (and its directory's) in the cache: the kernel, its instruction set, its key."""
    return f"{name}_{isa}_{kernel_key(code, build_cflags(isa), _LDFLAGS)}"


@contextlib.contextmanager
def _exclusive(build_dir: str, what: str) -> Iterator[None]:
    # Held across the check-build-load, so no process loads a library another one is still linking. Unlike
    # torch's baton file, an flock is dropped when its holder dies: a killed build blocks nobody afterwards.
    with open(os.path.join(build_dir, "kvserve.lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to build kernels: %s", what)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _import(module_name: str, library: str):
    spec = importlib.util.spec_from_file_location(module_name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reason(e: Exception) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    # A failed build's message opens with the whole compiler command; the compiler's own complaint comes later.
    complaint = next((line for line in lines[1:] if "error" in line.lower() or "not found" in line.lower()), None)
    return complaint or (lines[0][:200] if lines else type(e).__name__)


def build_extension(name: str, source: str, what: str):
    """Load `source` (one C++ file with its own PYBIND11_MODULE) built for this CPU's instruction set (or
    KVSERVE_CPU_ISA's: utils/cpu_isa.py) and environment, compiling it
    on the first use of this key (logged), or return None (logged) when it cannot be built here, so the caller
    falls back to PyTorch. Safe to call from several processes at once: one builds, the others wait for it."""
    build_dir = None
    try:
        with open(source, "rb") as f:
            code = f.read()
        isa = selected_isa()
        module_name = kernel_module_name(name, code, isa)
        build_dir = os.path.join(envs.cache_dir(), "kernels", module_name)
        os.makedirs(build_dir, exist_ok=True)
        library = os.path.join(build_dir, module_name + ".so")
        # The linker writes the library in place: one killed mid-link is truncated and crashes dlopen. Only a
        # library marked complete after it loaded is trusted; anything else goes back through ninja.
        complete = library + ".complete"
        with _exclusive(build_dir, what):
            if os.path.exists(complete):  # built before: no compiler or ninja needed to load it
                return _import(module_name, library)
            # NOTE: imported only to build: it imports setuptools, a fifth of a second of every start otherwise
            from torch.utils.cpp_extension import load

            logger.info("building kernels: %s for %s (first use with this source/compiler/environment; "
                        "takes about a minute)", what, isa)
            start = time.perf_counter()
            copy = os.path.join(build_dir, os.path.basename(source))
            with open(copy, "wb") as f:
                f.write(code)
            # NOTE: we hold the build lock, so a torch baton here was left by a killed build, and torch
            # would wait on it forever.
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(build_dir, "lock"))
            module = load(name=module_name, sources=[copy], extra_cflags=list(build_cflags(isa)),
                          extra_ldflags=list(_LDFLAGS), build_directory=build_dir, verbose=False)
            open(complete, "w").close()
            logger.info("built kernels: %s in %.0f s", what, time.perf_counter() - start)
            return module
    except Exception as e:  # no compiler / ninja, a compile error, unsupported platform
        logger.warning("C++ %s kernel unavailable, using the PyTorch path instead: %s (build dir: %s)",
                       what, _reason(e), build_dir)
        logger.debug("C++ %s build failure", what, exc_info=True)
        return None
