"""Single-stream decode speed per weight quantization, same run: `python -m kvserve.bench.quant`.

One request at a time (greedy, `--output-len` tokens, EOS ignored, speculative decoding off so every step
is one token) on the built-in SmolLM2 (or `--model`), for each `--quantization` setting, interleaved over
`--repeats` rounds so a noisy neighbour hits every setting alike; the best round counts. Decode tok/s
excludes the prefill: (output_len - 1) / (time of the whole request - time of a 1-token request).
A setting is a `--quantization` value, optionally `:GROUP` (int8/int4's --quantization-group-size, -1: per
channel) and `:fp32-head` (--no-quantize-lm-head), e.g. `none int8 int8:-1:fp32-head int4:64 gguf`.
"""
from __future__ import annotations

import argparse
import time

from kvserve.engine.llm import LLM
from kvserve.sampling_params import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _settings(names: list[str]) -> dict[str, dict]:
    out = {}
    for name in names:
        method, *options = name.split(":")
        kwargs = {} if method == "none" else {"quantization": method}
        for option in options:
            if option == "fp32-head":
                kwargs["quantize_lm_head"] = False
            elif option.lstrip("-").isdigit():
                kwargs["quantization_group_size"] = int(option)
            else:
                raise ValueError(f"setting {name!r}: {option!r} is neither a group size nor fp32-head")
        out[name] = kwargs
    return out


def _seconds(llm: LLM, max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([PROMPT], params)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--quantization", nargs="+", default=["none", "int8", "int8:-1:fp32-head", "int4:64", "gguf"],
                        help="settings: METHOD[:GROUP][:fp32-head] (int4:64: the largest group dividing SmolLM2's 576)")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    try:
        settings = _settings(args.quantization)
    except ValueError as e:
        parser.error(str(e))
    llms = {name: LLM(args.model, speculative_config=None, kv_cache_memory="256MiB", **kwargs)
            for name, kwargs in settings.items()}
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, llm in llms.items():
            _seconds(llm, 1)  # warm-up: first-call kernel and allocator costs
            decode = _seconds(llm, args.output_len) - _seconds(llm, 1)
            best[name] = max(best.get(name, 0.0), (args.output_len - 1) / decode)
    base = best.get("none")
    print(f"single-stream decode, {args.output_len} output tokens, best of {args.repeats}")
    print(f"{'quantization':20s} {'tok/s':>8s} {'vs none':>8s}")
    for name, tok_s in best.items():
        print(f"{name:20s} {tok_s:8.1f} {tok_s / base if base else float('nan'):7.2f}x")


if __name__ == "__main__":
    main()
