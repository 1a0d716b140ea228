"""Decode-only engine step time against the number of sequences, per --quantization, in one run:
`python scripts/decode_step_times.py --quantization none,int8,gguf --seqs 1,8,16,24,32,48,64`.

Each setting runs `seqs` requests of 100 prompt tokens for 24 greedy tokens, speculation off, and prints the
median of the decode-only steps' measured times (those the scheduler's step-cost model is fed), leaving
out each run's first three. Where the linear kernels switch paths (kvserve/layers/quant/kernels.py) the
step time shows it.
"""
from __future__ import annotations

import argparse
import statistics

from kvserve import LLM, SamplingParams


class _Recorder:
    """The scheduler's step-cost model, passed through, with each observed step kept."""

    def __init__(self, inner):
        self.inner, self.steps = inner, []

    def predict(self, features):
        return self.inner.predict(features)

    def observe(self, features, seconds):
        self.steps.append((features, seconds))
        self.inner.observe(features, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="none,int8", help="comma-separated; none: fp32")
    parser.add_argument("--seqs", default="1,8,16,24,32,48,64", help="comma-separated sequence counts")
    args = parser.parse_args()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for quant in args.quantization.split(","):
        llm = LLM(speculative_config="none", max_num_seqs=128,
                  **({} if quant == "none" else {"quantization": quant}))
        scheduler = llm.engine.core.scheduler
        recorder = scheduler.step_cost = _Recorder(scheduler.step_cost)
        for n in (int(s) for s in args.seqs.split(",")):
            recorder.steps.clear()
            llm.generate([[1 + (i * 7 + j) % 1000 for j in range(100)] for i in range(n)], params, use_tqdm=False)
            decode = [s for f, s in recorder.steps if f.num_tokens == n == f.num_seqs][3:]
            ms = f"{statistics.median(decode) * 1e3:7.2f} ms" if decode else "      - "
            print(f"{quant:6s} {n:4d} sequences: {ms} ({len(decode)} decode steps)", flush=True)
        llm.shutdown()


if __name__ == "__main__":
    main()
