"""`kvserve` console script: one subcommand per module, each exposing add_arguments(parser) and run(args)."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvserve.utils.cli_help import DefaultsHelpFormatter

# subcommand -> (module, help). `bench` has its own sub-subcommands.
_COMMANDS = {
    "serve": ("kvserve.server.cli", "serve the OpenAI-compatible HTTP API"),
    "generate": ("kvserve.cli.generate", "generate completions offline (prompts from arguments or a JSONL file)"),
    "router": ("kvserve.router.cli", "route OpenAI requests over several `kvserve serve` workers by load and prefix cache"),
    "proxy": ("kvserve.router.pd_cli", "disaggregated serving: send each OpenAI request to a prefill instance, "
              "then with its KV to a decode instance (vLLM's flow)"),
    "kv-calc": ("kvserve.cli.kv_calc",
                "KV-cache memory calculator (reads only the model config, or takes the shape as flags)"),
}
_BENCH = {
    "offline": ("kvserve.bench.offline", "offline throughput vs transformers, same run"),
    "serve": ("kvserve.bench.serve", "replay a workload against an OpenAI-compatible server"),
    "prefix": ("kvserve.bench.prefix", "a shared-prefix workload offline, prefix caching on vs off, same run"),
    "lora": ("kvserve.bench.lora", "a workload over N LoRA adapters: multi-LoRA vs the base model vs one engine per adapter"),
    "spec": ("kvserve.bench.spec", "speculative decoding off vs on (repeat at concurrency 1 and 16, mixed), same run"),
    "structured": ("kvserve.bench.structured", "a workload with a JSON schema vs without (same token counts), same run"),
    "quality": ("kvserve.bench.quality", "quantized settings vs the full-precision model, teacher-forced: top-1 agreement, KL, perplexity"),
    "steps": ("kvserve.bench.steps", "time each engine step of a workload, by kind of step (where time goes)"),
    "soak": ("kvserve.bench.soak", "a fault soak: random, partly hostile traffic for M minutes, then leak checks"),
    "tp": ("kvserve.bench.tp", "tensor parallelism: TP=N vs TP=1 throughput, bytes each rank sends, and the all-reduce cost model"),
    "compare": ("kvserve.bench.compare", "kvserve vs vLLM CPU, OpenVINO GenAI, llama.cpp, transformers, same run"),
    "itl": ("kvserve.bench.itl", "the latency-aware step budget vs the fixed one (interference ITL, mixed tok/s), same run"),
    "sweep": ("kvserve.bench.sweep", "a server at several Poisson request rates: throughput vs latency, JSON and a PNG plot"),
    "sweep-plot": ("kvserve.bench.sweep_plot", "one serving-curve PNG from several `bench sweep` JSON files"),
    "playbook": ("kvserve.bench.playbook", "the serving playbook's cost table (batching, PagedAttention, chunked "
                 "prefill, prefix and prompt caching, speculation, multi-LoRA, MoE), each row measured in one run"),
    "startup": ("kvserve.bench.startup", "start `kvserve serve` N times: where the start-up seconds go (import, weights, "
                "kernels, tokenizer, ..., first token)"),
    "scale": ("kvserve.bench.scale", "scaling out, same run: colocated vs disaggregated prefill/decode (ITL, TTFT, KV "
              "transfer) and router policies' prefix hit rate against the best possible, against one 2-thread engine"),
    "moe": ("kvserve.bench.moe", "one MoE layer (Qwen3-30B-A3B's shape): kvserve's expert paths vs transformers' eager block, same run"),
}


def _add(sub, name: str, module: str, help_text: str, load: bool) -> None:
    parser = sub.add_parser(name, help=help_text, description=help_text, formatter_class=DefaultsHelpFormatter)
    if load:  # NOTE: only the chosen subcommand is imported, so `generate` never pays for FastAPI's import
        mod = importlib.import_module(module)
        mod.add_arguments(parser)
        parser.set_defaults(_run=mod.run)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    words = [a for a in argv if not a.startswith("-")]
    chosen = words[:2]
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM inference and serving engine",
                                     formatter_class=DefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in _COMMANDS.items():
        _add(sub, name, module, help_text, load=chosen[:1] == [name])
    bench_help = "benchmarks that print ratios against a baseline run alongside"
    bench = sub.add_parser("bench", help=bench_help, description=bench_help, formatter_class=DefaultsHelpFormatter)
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, (module, help_text) in _BENCH.items():
        _add(bench_sub, name, module, help_text, load=chosen == ["bench", name])
    return parser


def _start_engine_process(argv: list[str]):
    """`kvserve serve`: the engine's process, started before the server imports its modules, so that both
    import at once (engine/engine_process.py); None for every other command."""
    words = [a for a in argv if not a.startswith("-")]
    if words[:1] != ["serve"] or "-h" in argv or "--help" in argv:
        return None
    from kvserve.engine.engine_process import EngineProcess

    return EngineProcess()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    engine_process = _start_engine_process(argv)
    args = build_parser(argv).parse_args(argv)
    args.engine_process = engine_process
    try:
        return args._run(args) or 0
    except ValueError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
