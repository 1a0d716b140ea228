"""`kvserve bench compare`: kvserve and its CPU peers on the same machine, the same weights, one at a time.

For each workload (the built-in mixed, prefix and interference by default) each engine is started
fresh (a cold prefix cache for every workload), warmed up with one short request, sent the workload's token
ids with its arrival times (greedy, ignore_eos as the workload says), and stopped. One table per workload:
output and total tok/s, TTFT and inter-token latency p50/p99, kvserve's throughput ratio to each peer, and how
many outputs are the same text as kvserve's (greedy fp32 on the same weights should agree except at
near-ties). Then a roofline line and the issue's targets, each marked met or missed. Never asserts; a peer
that fails to install or run is reported with its error and the rest still run.

Set-up (once, reused): each peer's venv under --peers-dir (git-ignored) and its weights under
--peers-dir/weights, all from the built-in GGUF: see peers.py and peer_weights.py.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

import httpx

from kvserve.bench import peer_weights, serve
from kvserve.bench.peers import PEERS, PRESETS, Peer, PeerEnv, PeerError, RunSettings, driver_command, \
    ensure_venv, expand_peers, log_tail, run_logged, server_command, thread_env
from kvserve.bench import compare_targets
from kvserve.bench.compare_targets import decode_tok_s, targets as _targets
from kvserve.bench.streaming import StreamingFigure
from kvserve.bench.workload import WORKLOAD_DIR, WorkloadRequest, load_workload
from kvserve.utils.cpu_features import describe_isa
from kvserve.utils.cpu_isa import ISAS, supported_isas

_WORKLOADS = ("mixed", "prefix", "interference")
DECODE1 = compare_targets.DECODE1  # built in: single-stream decode, one request of 256 output tokens
_DECODE1_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", default="fp32",
                        help=f"comma-separated engines or presets to run (kvserve always runs first); engines: "
                             f"{', '.join(PEERS)}; presets: "
                             + "; ".join(f"{k} = {','.join(v)}" for k, v in PRESETS.items() if k != "all")
                             + "; all")
    parser.add_argument("--workloads", default=",".join(_WORKLOADS),
                        help="comma-separated workload names (files NAME.jsonl in --workload-dir) or .jsonl paths")
    parser.add_argument("--workload-dir", default=WORKLOAD_DIR,
                        help="folder of the NAME.jsonl files (default: the built-in workloads)")
    parser.add_argument("--peers-dir", default=".peers", help="venvs, weights, logs and results (git-ignored)")
    parser.add_argument("--threads", type=int, default=2, help="compute threads of every engine")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="tokens per step for every engine that has the setting")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="KV-cache size of every engine")
    parser.add_argument("--kvserve-args", default="", help="extra `kvserve serve` flags, e.g. "
                                                           "'--long-prefill-token-threshold 64'")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every engine this many times per workload, interleaved (A, B, A, B, ...), and "
                             "report each engine's median run: on a machine whose speed drifts between minutes, "
                             "ratios of engines measured side by side (the runs' figures are listed too)")
    parser.add_argument("--baseline-checkout", default="",
                        help="another kvserve checkout (e.g. a git worktree of the old main) that the "
                             "kvserve-baseline peer serves with the same flags: before vs after a change")
    parser.add_argument("--cpu-isa", choices=ISAS, default=None,
                        help="run every engine (peers too) as a CPU of this class: caps kvserve's kernels "
                             "(KVSERVE_CPU_ISA), PyTorch's (ATEN_CPU_CAPABILITY) and oneDNN's (ONEDNN_MAX_CPU_ISA); "
                             "default: the CPU as it is")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server may take to start")
    parser.add_argument("--setup-only", action="store_true", help="install peers and prepare weights, then stop")
    parser.add_argument("--json", dest="json_path", default=None,
                        help="also write every result here (default: PEERS_DIR/results/compare-TIME.json)")


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the report
    names = expand_peers(args.peers)
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    if args.cpu_isa and args.cpu_isa not in supported_isas():
        raise ValueError(f"--cpu-isa {args.cpu_isa}: this CPU cannot run it (it runs {', '.join(supported_isas())})")
    peers_dir = os.path.abspath(args.peers_dir)
    workloads = {name: _workload_path(name, args.workload_dir, peers_dir) for name in
                 (w.strip() for w in args.workloads.split(",") if w.strip())}
    requests = {name: load_workload(path) for name, path in workloads.items()}
    settings = RunSettings(threads=args.threads, max_num_batched_tokens=args.max_num_batched_tokens,
                           kv_cache_gib=args.kv_cache_gib, kvserve_args=tuple(shlex.split(args.kvserve_args)),
                           baseline_checkout=args.baseline_checkout, cpu_isa=args.cpu_isa or "")
    log_dir = os.path.join(peers_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)

    ready: dict[str, tuple[PeerEnv, str]] = {}
    failed: dict[str, str] = {}
    for name in names:
        try:
            ready[name] = _set_up(PEERS[name], peers_dir, log_dir)
        except (PeerError, OSError, ValueError) as e:
            failed[name] = f"set-up: {e}"
        print(f"[compare] {name}: {'ready' if name in ready else failed[name]}", file=sys.stderr, flush=True)
    if args.setup_only:
        return 0 if not failed else 1

    report = {"machine": _machine(), "settings": asdict(settings), "isa": _engine_isa(settings), "engines": {},
              "workloads": {}}
    for name in names:
        report["engines"][name] = {"notes": PEERS[name].notes, "version": _version(PEERS[name], ready.get(name))}
    for wname, reqs in requests.items():
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for rep in range(args.repeat):
            for name in names:
                if name in failed:
                    runs[name].append({"error": failed[name]})
                    continue
                tag = f"{name} (run {rep + 1}/{args.repeat})" if args.repeat > 1 else name
                print(f"[compare] {wname}: {tag} ...", file=sys.stderr, flush=True)
                env, weights = ready[name]
                try:
                    row = _run_one(PEERS[name], env, weights, workloads[wname], reqs, settings, log_dir,
                                   args.startup_timeout)
                except (PeerError, OSError, httpx.HTTPError) as e:
                    row = {"error": f"run: {e}"}
                runs[name].append(row)
                print(f"[compare] {wname}: {tag}: {_brief(row)}", file=sys.stderr, flush=True)
        rows = report["workloads"][wname] = {name: median_run(r, single_stream=len(reqs) == 1)
                                             for name, r in runs.items()}
        _mark_agreement(rows)
    report["roofline"] = _roofline(report, requests)
    report["streaming"] = _streaming(report, ready)
    report["targets"] = _targets(report)
    path = args.json_path or os.path.join(peers_dir, "results", time.strftime("compare-%Y%m%d-%H%M%S.json"))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(format_report(report, requests))
    print(f"\n(all results: {path})")
    return 0


def _workload_path(name: str, directory: str, peers_dir: str) -> str:
    if name == DECODE1:
        return decode1_workload(os.path.join(peers_dir, "workloads"))
    path = name if name.endswith(".jsonl") else os.path.join(directory, f"{name}.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"workload {name!r}: no file {path}")
    return path


def decode1_workload(directory: str) -> str:
    """One chat-formatted prompt and 256 output tokens (ignore_eos), written once: single-stream decode."""
    path = os.path.join(directory, f"{DECODE1}.jsonl")
    if not os.path.isfile(path):
        os.makedirs(directory, exist_ok=True)
        tok = _tokenizer()
        text = tok.apply_chat_template([{"role": "user", "content": _DECODE1_PROMPT}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        with open(path + ".partial", "w", encoding="utf-8") as f:
            json.dump({"id": "decode1-0", "prompt": _DECODE1_PROMPT, "prompt_token_ids": ids, "max_tokens": 256,
                       "ignore_eos": True, "arrival_s": 0.0}, f)
            f.write("\n")
        os.replace(path + ".partial", path)
    return path


# ---- set-up ------------------------------------------------------------------------------------------
def _set_up(peer: Peer, peers_dir: str, log_dir: str) -> tuple[PeerEnv, str]:
    env = ensure_venv(peer, peers_dir, log_dir)
    from kvserve.model_loader.gguf_loader import builtin_model_path

    gguf = builtin_model_path()
    wdir = os.path.join(peers_dir, "weights")
    os.makedirs(wdir, exist_ok=True)
    if peer.weights == "gguf":
        return env, gguf
    if peer.weights == "f32_gguf":
        return env, peer_weights.f32_gguf(gguf, os.path.join(wdir, "smollm2-135m-f32.gguf"))
    if peer.weights == "q8_0_gguf":
        return env, peer_weights.q8_0_gguf(gguf, os.path.join(wdir, "smollm2-135m-q8_0.gguf"))
    hf = peer_weights.hf_folder(gguf, os.path.join(wdir, "smollm2-135m-hf"))
    if peer.weights == "hf":
        return env, hf
    fmt = {"ov_ir": "fp32", "ov_ir_int8": "int8", "ov_ir_int4": "int4"}[peer.weights]
    ir = os.path.join(wdir, "smollm2-135m-ov" + ("" if fmt == "fp32" else f"-{fmt}"))
    if not os.path.isfile(os.path.join(ir, "openvino_model.xml")):
        # NOTE: int4 with optimum's defaults would keep some layers in int8 (ratio < 1) and pick its own
        # group size; all layers in int4, group 32 (the built-in file's) make it the same format as Q4_1.
        extra = ["--ratio", "1.0", "--group-size", "32"] if fmt == "int4" else []
        run_logged([os.path.join(env.bin_dir, "optimum-cli"), "export", "openvino", "--model", hf,
                    "--task", "text-generation-with-past", "--weight-format", fmt, *extra, ir + ".partial"],
                   os.path.join(log_dir, f"export-openvino-{fmt}.log"), f"exporting the OpenVINO IR ({fmt})",
                   env=thread_env(2))
        os.replace(ir + ".partial", ir)
    return env, ir


def _version(peer: Peer, ready: tuple[PeerEnv, str] | None) -> str:
    if not peer.packages:
        dist = peer.base
        from importlib.metadata import PackageNotFoundError, version
        with contextlib.suppress(PackageNotFoundError):
            return f"{dist} {version(dist)}"
        return dist
    if ready is None:
        return "not installed"
    dist = peer.packages[0].split("==")[0].split("[")[0]
    try:
        out = subprocess.run([ready[0].python, "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                             capture_output=True, text=True, timeout=60)
        return f"{dist} {out.stdout.strip() or '?'}"
    except (OSError, subprocess.TimeoutExpired):
        return dist


def _machine() -> dict:
    model = "?"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    return {"cpu": model, "cores": os.cpu_count()}


def _in_engine_env(code: str, s: RunSettings) -> object:
    """The JSON that `code` prints last, run in a fresh Python with an engine's environment (threads, and the
    --cpu-isa caps, which PyTorch and oneDNN read when torch loads: this process's torch is not capped)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env=thread_env(s.threads, s.cpu_isa), check=False)
    if out.returncode != 0:
        raise PeerError(f"probe failed (exit {out.returncode}): {out.stderr.strip()[-300:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _engine_isa(s: RunSettings) -> dict:
    """The instruction sets an engine started by this run gets (cpu_features.isa_info, from such a process)."""
    return _in_engine_env("import json; from kvserve.utils.cpu_features import isa_info; "
                          "print(json.dumps(isa_info()))", s)


# ---- running -----------------------------------------------------------------------------------------
def _run_one(peer: Peer, env: PeerEnv, weights: str, workload: str, reqs: list[WorkloadRequest],
             s: RunSettings, log_dir: str, startup_timeout: float) -> dict:
    if peer.kind == "driver":
        results, duration = _run_driver(peer, env, weights, workload, s, log_dir, prefix_caching=True)
    else:
        results, duration = _run_server(peer, env, weights, reqs, s, log_dir, startup_timeout)
    summary = serve.summarize(results, duration, peer.name)
    summary["texts"] = [r.text for r in results]
    short = [r for r, q in zip(results, reqs) if q.arrival_s == 0.0 and r.ok]
    if len(short) < len(results):  # the workload has late arrivals: latency of those that were there first
        summary["itl_first_arrivals"] = serve._stats([x for r in short for x in r.itls_s])
    return summary


def _run_server(peer: Peer, env: PeerEnv, weights: str, reqs: list[WorkloadRequest], s: RunSettings,
                log_dir: str, startup_timeout: float) -> tuple[list[serve.RequestResult], float]:
    port = _free_port()
    cmd, proc_env = server_command(peer, env, weights, port, s)
    log = os.path.join(log_dir, f"server-{peer.name}.log")
    with open(log, "w", encoding="utf-8") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=proc_env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, base, startup_timeout, log)
        _warm_up(base)
        start = time.perf_counter()
        arrivals = [r.arrival_s for r in reqs]
        results, _ = asyncio.run(serve.collect(base, reqs, arrivals))
        return results, time.perf_counter() - start
    finally:
        _stop(proc)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, base: str, timeout: float, log: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerError(f"server exited with code {proc.returncode}: {log_tail(log)} (log: {log})")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/v1/models", timeout=5).status_code == 200:
                return
        time.sleep(1.0)
    raise PeerError(f"server not ready after {timeout:.0f} s (log: {log})")


def _warm_up(base: str) -> None:
    """One short request, so that one-time costs (compilation, first allocations) are not the workload's."""
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(f"{base}/v1/completions", timeout=600, json={
        "model": model, "prompt": list(range(100, 164)), "max_tokens": 8, "temperature": 0.0})
    if r.status_code != 200:
        raise PeerError(f"warm-up request failed: HTTP {r.status_code}: {r.text[:200]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _run_driver(peer: Peer, env: PeerEnv, weights: str, workload: str, s: RunSettings, log_dir: str,
                prefix_caching: bool) -> tuple[list[serve.RequestResult], float]:
    log = os.path.join(log_dir, f"driver-{peer.name}.log")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": weights, "workload": os.path.abspath(workload), "threads": s.threads,
                   "max_num_batched_tokens": s.max_num_batched_tokens, "kv_cache_gb": s.kv_cache_gib,
                   "prefix_caching": prefix_caching, "precision": peer.precision}, f)
    try:
        with open(log, "w", encoding="utf-8") as err:
            proc = subprocess.run([*driver_command(peer, env), f.name], stdout=subprocess.PIPE, stderr=err,
                                  text=True, env=thread_env(s.threads, s.cpu_isa), timeout=7200)
    except subprocess.TimeoutExpired:
        raise PeerError(f"driver ran past 2 h (log: {log})") from None
    finally:
        os.unlink(f.name)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise PeerError(f"driver exited with code {proc.returncode}: {log_tail(log)} (log: {log})")
    data = json.loads(lines[-1])
    tokenizer = _tokenizer()
    results = []
    for d in data["results"]:
        text = tokenizer.decode(d["token_ids"], skip_special_tokens=True) if d["ok"] else ""
        results.append(serve.RequestResult(ok=d["ok"], prompt_tokens=d["prompt_tokens"],
                                           output_tokens=d["output_tokens"], ttft_s=d["ttft_s"],
                                           latency_s=d["latency_s"], itls_s=d["itls_s"], error=d["error"],
                                           text=text))
    return results, float(data["duration_s"])


_TOKENIZER = []


def _tokenizer():
    if not _TOKENIZER:
        from kvserve.model_loader.gguf_loader import builtin_model_path, load_gguf_tokenizer
        _TOKENIZER.append(load_gguf_tokenizer(builtin_model_path()))
    return _TOKENIZER[0]


def _mark_agreement(rows: dict) -> None:
    base = rows.get("kvserve", {}).get("texts")
    for row in rows.values():
        texts = row.pop("texts", None) if row is not rows.get("kvserve") else row.get("texts")
        if base and texts and len(texts) == len(base):
            row["same_text"] = sum(a == b and a != "" for a, b in zip(texts, base))
    rows.get("kvserve", {}).pop("texts", None)


def median_run(runs: list[dict], single_stream: bool = False) -> dict:
    """One engine's runs of a workload -> the run to report: the one of median speed among those that
    completed (single-stream decode tok/s for a one-request workload, else total tok/s; the lower middle of an
    even count), so that every figure of the row comes from one real run. With several runs the row keeps
    every run's speed in `repeats` (None for a failed one); with none completed it is the last run's error."""
    def speed(row: dict) -> float | None:
        if "error" in row or not row.get("completed"):
            return None
        return decode_tok_s(row) if single_stream else row["total_token_throughput"]

    speeds = [speed(r) for r in runs]
    ok = sorted((v, i) for i, v in enumerate(speeds) if v is not None)
    if not ok:
        return runs[-1]
    row = dict(runs[ok[(len(ok) - 1) // 2][1]])
    if len(runs) > 1:
        row["repeats"] = speeds
    return row


def _brief(row: dict) -> str:
    if "error" in row:
        return row["error"]
    return (f"{row['completed']} ok, {row['failed']} failed, {row['duration_s']:.1f} s, "
            f"{row['total_token_throughput']:.1f} total tok/s")


# ---- report ------------------------------------------------------------------------------------------
def _roofline(report: dict, requests: dict[str, list[WorkloadRequest]]) -> dict | None:
    row = report["workloads"].get("mixed", {}).get("kvserve")
    if not row or "error" in row:
        return None
    from kvserve.bench.roofline import workload_flops
    from kvserve.model_loader.gguf_loader import builtin_model_path, load_gguf_config

    cfg = load_gguf_config(builtin_model_path())
    # NOTE: the best of three: right after the last server's main process exits, the rest of its process group
    # may still be winding down on the same two cores (a single measurement there has read half the rate,
    # 214.8 GFLOP/s against 414 alone, and put kvserve at 112% of it). Measured in an engine's environment: the
    # rate of the instruction sets the engines ran (--cpu-isa).
    try:
        machine = _in_engine_env(
            "import json, torch; from kvserve.bench.roofline import measure_matmul_rate; "
            "from kvserve.model_loader.gguf_loader import builtin_model_path, load_gguf_config; "
            f"torch.set_num_threads({report['settings']['threads']}); cfg = load_gguf_config(builtin_model_path()); "
            "print(json.dumps(max(measure_matmul_rate(cfg) for _ in range(3))))", RunSettings(**report["settings"]))
    except (PeerError, subprocess.TimeoutExpired) as e:
        print(f"[compare] roofline not measured: {e}", file=sys.stderr, flush=True)
        return None
    achieved = workload_flops(cfg, requests["mixed"]) / row["duration_s"] / 1e9
    return {"machine_gflops": machine, "kvserve_gflops": achieved, "fraction": achieved / machine}


def _streaming(report: dict, ready: dict[str, tuple[PeerEnv, str]]) -> dict | None:
    """decode1's kvserve rows against the weight-streaming limit (bench/streaming.py): each row's model loaded
    with its own serve flags in an engine's environment, and the read rate measured there once."""
    rows = report["workloads"].get(DECODE1, {})
    names = [n for n, row in rows.items() if n in ready and PEERS[n].base == "kvserve" and not PEERS[n].baseline
             and decode_tok_s(row)]
    if not names:
        return None
    s = RunSettings(**report["settings"])
    out: dict = {"rows": {}}
    try:
        for name in names:
            env, weights = ready[name]
            flags = server_command(PEERS[name], env, weights, 0, s)[0][4:]  # after `python -m kvserve.cli.main serve`
            flags += [] if "read_gbps" in out else ["--read-rate"]
            probe = _in_engine_env(f"from kvserve.bench.streaming import main; main({flags!r})", s)
            out.setdefault("read_gbps", probe.get("read_gbps"))
            out["rows"][name] = StreamingFigure(decode_tok_s(rows[name]), probe["bytes_per_token"],
                                                out["read_gbps"]).as_dict()
    except (PeerError, subprocess.TimeoutExpired, KeyError) as e:
        print(f"[compare] weight-streaming limit not measured: {e}", file=sys.stderr, flush=True)
    return out if out["rows"] else None


def format_report(report: dict, requests: dict[str, list[WorkloadRequest]]) -> str:
    s = report["settings"]
    lines = [f"machine: {report['machine']['cpu']}, {report['machine']['cores']} cores; every engine: "
             f"{s['threads']} threads, fp32 unless the row says otherwise, greedy, {s['max_num_batched_tokens']} tokens/step, "
             f"{s['kv_cache_gib']} GiB KV cache"]
    for name, e in report["engines"].items():
        lines.append(f"  {name:<13}{e['version']}: {e['notes']}")
    if report.get("isa"):
        lines.append(f"instruction sets of every engine: {describe_isa(report['isa'])}")
    header = (f"{'engine':<13}{'out tok/s':>10}{'total tok/s':>12}{'TTFT p50':>10}{'TTFT p99':>10}"
              f"{'ITL p50':>9}{'ITL p99':>9}{'kvserve x':>10}{'same text':>10}")
    for wname, rows in report["workloads"].items():
        reqs = requests[wname]
        n_in = sum(len(r.prompt_token_ids) for r in reqs)
        n_out = sum(r.max_tokens for r in reqs)
        lines += ["", f"== {wname}: {len(reqs)} requests, {n_in} prompt + {n_out} output tokens "
                      f"(latencies in ms)", header]
        kv_row = rows.get("kvserve", {})
        kv = kv_row.get("total_token_throughput") if kv_row.get("completed") else None
        for name, row in rows.items():
            if "error" in row:
                lines.append(f"{name:<13}FAILED: {row['error'][:300]}")
                continue
            mine = row["total_token_throughput"] if row.get("completed") else None
            ratio = f"{kv / mine:.2f}" if kv and mine and name != "kvserve" else "-"
            same = f"{row['same_text']}/{row['completed']}" if "same_text" in row and name != "kvserve" else "-"
            lines.append(f"{name:<13}{row['output_throughput']:>10.1f}{row['total_token_throughput']:>12.1f}"
                         f"{row['ttft']['median_ms']:>10.0f}{row['ttft']['p99_ms']:>10.0f}"
                         f"{row['itl']['median_ms']:>9.0f}{row['itl']['p99_ms']:>9.0f}{ratio:>10}{same:>10}")
            if row["failed"]:
                lines.append(f"{'':<13}{row['failed']} requests failed: {row['errors'][:1]}")
        if len(reqs) == 1:
            lines.append("single-stream decode tok/s (1000 / mean time per output token after the first):")
            lines += [f"  {n:<15}{decode_tok_s(r):>8.1f}" for n, r in rows.items() if decode_tok_s(r)]
            if wname == DECODE1 and report.get("streaming"):
                lines.append(f"against the weight-streaming limit (read rate {report['streaming']['read_gbps']:.1f} "
                             "GB/s, measured in this run):")
                lines += [f"  {n:<15}{StreamingFigure(r['tok_s'], r['bytes_per_token'], r['read_gbps']).describe()}"
                          for n, r in report["streaming"]["rows"].items()]
        repeated = [(n, r["repeats"]) for n, r in rows.items() if "repeats" in r]
        if repeated:
            what = "single-stream decode tok/s" if len(reqs) == 1 else "total tok/s"
            lines.append(f"each run, in order ({what}; the median run is reported):")
            lines += [f"  {n:<15}" + " / ".join("failed" if v is None else f"{v:.1f}" for v in vs)
                      for n, vs in repeated]
        firsts = [(n, r["itl_first_arrivals"]) for n, r in rows.items() if "itl_first_arrivals" in r]
        if firsts:
            lines.append("requests there from t=0 (while the late prompts prefill): ITL p50 / p99 (p99/p50)")
            lines += [f"  {n:<11}{x['median_ms']:>8.0f}{x['p99_ms']:>8.0f}  ({x['p99_ms'] / x['median_ms']:.1f}x)"
                      for n, x in firsts if x["median_ms"]]
    if report.get("roofline"):
        r = report["roofline"]
        lines += ["", f"roofline: machine fp32 matmul {r['machine_gflops']:.1f} GFLOP/s at the model's layer "
                      f"shapes; kvserve on mixed achieved {r['kvserve_gflops']:.1f} GFLOP/s of model FLOPs "
                      f"= {100 * r['fraction']:.0f}%"]
    if report.get("targets"):
        lines += ["", "targets:"]
        lines += [f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['value']:.2f}" for t in report["targets"]]
    return "\n".join(lines)
