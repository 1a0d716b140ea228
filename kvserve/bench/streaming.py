"""Single-stream decode against the weight-streaming limit: the bench figure behind issue 32's "≥ 80%".

One decode step reads every weight the token passes through once, so a step cannot be faster than those bytes
over the machine's read rate. The limit, in tokens per second, is read_rate / bytes_per_token:
- bytes per token: from the loaded model, every linear layer's stored bytes as its method reads them (the float32
  weight or its oneDNN-packed copy, the same bytes; or int8/int4 codes with their scales and mins, not the dense
  weight a layer may keep beside them), biases, and the LM head (its own copy or the tied embedding it multiplies by); the token
  embedding is not counted (a lookup reads one row). A mixture-of-experts layer counts top_k / num_experts
  of its experts' bytes (what one token's experts hold);
- read rate: attention/microbench.stream_gbps (a sum over a tensor far past the last-level cache, every thread),
  measured in the same run as the decode.
Norms, RoPE tables and the KV cache are left out: at short contexts they are a small share, so the fraction is
an upper bound on how close the engine comes.

`python -m kvserve.bench.streaming [serve flags]` prints, as JSON, the bytes per token of the model those
flags load (`kvserve bench compare` runs it for each kvserve row) and, with --read-rate, the read rate;
`python -m kvserve.bench.streaming --linear-paths` times the float32 linears' two paths at decode row counts.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch
from torch import nn

_CODES = ("qweight", "scales", "mins")
"""A quantized layer's tensors: its method reads these and not the dense weight."""


def _bytes(t: torch.Tensor | None) -> int:
    # NOTE: oneDNN's packed weight is opaque (no storage), but numel and element_size hold
    return 0 if t is None or t.device.type == "meta" else t.numel() * t.element_size()


def linear_bytes(layer: nn.Module) -> int:
    """Bytes a linear layer's method reads per call: its codes and scales, or its packed copy, or its weight;
    and its bias."""
    if getattr(layer, "qweight", None) is not None:
        read = sum(_bytes(getattr(layer, name, None)) for name in _CODES)
    elif getattr(layer, "packed_weight", None) is not None:
        read = _bytes(layer.packed_weight)
    else:
        read = _bytes(layer.weight)
    return read + _bytes(getattr(layer, "bias", None))


def weight_bytes_per_token(model: nn.Module) -> int:
    """Weight bytes one decode token reads (the module docstring says what is counted)."""
    from kvserve.bench.moe import expert_bytes
    from kvserve.layers.linear import LinearBase
    from kvserve.layers.moe import FusedMoE

    total = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            total += linear_bytes(module)
        elif isinstance(module, FusedMoE):
            total += module.top_k * expert_bytes(module, module.w13.shape[-1])
    return total


@dataclass(frozen=True)
class StreamingFigure:
    tok_s: float            # single-stream decode tokens per second, measured
    bytes_per_token: int
    read_gbps: float        # the machine's read rate, GB/s (1e9 bytes)

    @property
    def limit_tok_s(self) -> float:
        return self.read_gbps * 1e9 / self.bytes_per_token

    @property
    def fraction(self) -> float:
        return self.tok_s / self.limit_tok_s

    def describe(self) -> str:
        return (f"{self.tok_s:.1f} tok/s; weights read per token {self.bytes_per_token / 1e6:.1f} MB at "
                f"{self.read_gbps:.1f} GB/s read rate -> limit {self.limit_tok_s:.1f} tok/s; "
                f"{self.fraction:.0%} of the weight-streaming limit")

    def as_dict(self) -> dict:
        return {"tok_s": self.tok_s, "bytes_per_token": self.bytes_per_token, "read_gbps": self.read_gbps,
                "limit_tok_s": self.limit_tok_s, "fraction": self.fraction}


def read_rate(repeats: int = 3) -> float:
    """The best of `repeats` stream measurements (a shared machine's noise only lowers one)."""
    from kvserve.attention.microbench import stream_gbps

    with torch.inference_mode():
        return max(stream_gbps() for _ in range(repeats))


def load_model(argv: list[str]) -> nn.Module:
    """The model that `kvserve serve` with these flags loads (flags the engine does not take, such as --port, are
    ignored)."""
    from kvserve.config import EngineArgs
    from kvserve.worker.worker import Worker

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args, _ = parser.parse_known_args(argv)
    worker = Worker(EngineArgs.from_cli(args).create_engine_config())
    worker.load_model()
    return worker.model


def model_bytes_per_token(argv: list[str]) -> int:
    """The bytes per token of the model that `kvserve serve` with these flags loads."""
    return weight_bytes_per_token(load_model(argv))


def compare_linear_paths(rows: tuple[int, ...] = (1, 2, 3, 4, 8), rounds: int = 16) -> None:
    """F.linear vs the packed path over every linear of the built-in model (weights from memory, as in decode),
    the two alternating pass by pass: the measurement behind layers/linear_methods.OneDNNPackedMethod.GEMV_ROWS."""
    import statistics
    import time

    import torch.nn.functional as F

    from kvserve.layers.linear import LinearBase
    from kvserve.layers.linear_methods import packed_linear

    layers = [m for m in load_model(["--dtype", "float32"]).modules() if isinstance(m, LinearBase) and hasattr(m, "packed_weight")]
    for m in rows:
        xs = [torch.randn(m, layer.input_size) for layer in layers]
        paths = {"F.linear": lambda xs=xs: [F.linear(x, la.weight, la.bias) for la, x in zip(layers, xs)],
                 "packed": lambda xs=xs: [packed_linear(la, x) for la, x in zip(layers, xs)]}
        seconds = {name: [] for name in paths}
        for i in range(rounds + 1):
            for name in (list(paths) if i % 2 else list(paths)[::-1]):
                start = time.perf_counter()
                paths[name]()
                if i:  # the first round warms up
                    seconds[name].append(time.perf_counter() - start)
        ratios = sorted(p / d for p, d in zip(seconds["packed"], seconds["F.linear"]))
        print(f"M={m}: F.linear {statistics.median(seconds['F.linear']) * 1e3:.1f} ms, packed "
              f"{statistics.median(seconds['packed']) * 1e3:.1f} ms a pass; packed / F.linear per pass: median "
              f"{statistics.median(ratios):.2f} (range {ratios[0]:.2f}-{ratios[-1]:.2f})", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--linear-paths"]:
        with torch.inference_mode():
            compare_linear_paths()
        return 0
    measure = "--read-rate" in argv
    argv = [a for a in argv if a != "--read-rate"]
    out = {"bytes_per_token": model_bytes_per_token(argv)}
    if measure:
        out["read_gbps"] = read_rate()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
