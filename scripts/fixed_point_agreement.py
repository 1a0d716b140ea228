"""What the quantized kernels' fixed-point rows change in greedy decoding: `python scripts/fixed_point_agreement.py
--quantization int8 --num-requests 16 --max-tokens 128`. Runs the first requests of a workload one at a time
(so every decode step has one row: the fixed-point path) with KVSERVE_QUANT_FIXED_POINT=0 (the float32
kernel) and with it on (the default), and prints how many greedy outputs are identical and, where they differ,
at which token.
"""
from __future__ import annotations

import argparse
import os

from kvserve import LLM, SamplingParams
from kvserve.bench.workload import load_workload


def _outputs(quantization: str, fixed: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    os.environ["KVSERVE_QUANT_FIXED_POINT"] = fixed
    llm = LLM(quantization=quantization, speculative_config="none", max_num_seqs=1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mixed", help="workload .jsonl file, or a built-in name")
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    prompts = [r.prompt_token_ids for r in load_workload(args.workload, args.num_requests)]
    off = _outputs(args.quantization, "0", prompts, args.max_tokens)
    on = _outputs(args.quantization, "1", prompts, args.max_tokens)
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(off, on)]
    same = sum(f is None for f in first)
    print(f"--quantization {args.quantization}: {same}/{len(prompts)} greedy outputs identical over "
          f"{args.max_tokens} tokens; first differing token of the others: {[f for f in first if f is not None]}")


if __name__ == "__main__":
    main()
