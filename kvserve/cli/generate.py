"""`kvserve generate`: offline completions from arguments or a JSONL file, printed or written as JSONL.

JSONL input: one object per line with `prompt` (text) or `prompt_token_ids`, and optionally any
SamplingParams field (`max_tokens`, `temperature`, `stop`, `seed`, ...) overriding the command-line values.
(`--seed` is the engine's seed, as in vLLM; a per-request seed goes in the JSONL.)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kvserve.config import EngineArgs
from kvserve.sampling_params import SamplingParams

_SAMPLING_FLAGS = {  # flag -> (type, default, help)
    "max_tokens": (int, 64, "tokens to generate per prompt"),
    "temperature": (float, 0.0, "0 = greedy"),
    "top_p": (float, 1.0, "nucleus sampling"),
    "top_k": (int, -1, "-1 = off"),
    "min_p": (float, 0.0, "min-p sampling"),
    "repetition_penalty": (float, 1.0, ""),
    "presence_penalty": (float, 0.0, ""),
    "frequency_penalty": (float, 0.0, ""),
    "n": (int, 1, "samples per prompt"),
    "min_tokens": (int, 0, ""),
    "logprobs": (int, None, "top-k logprobs per token (default: none)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompt texts (default: none; then --input gives them)")
    parser.add_argument("--input", help="JSONL file of requests (prompt or prompt_token_ids per line)")
    parser.add_argument("--output", help="write one JSON result per line here (default: print them)")
    parser.add_argument("--chat", action="store_true", help="wrap each text prompt as a user message in the "
                                                            "model's chat template")
    parser.add_argument("--system", help="system message, with --chat (default: none)")
    for name, (typ, default, help_text) in _SAMPLING_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=typ, default=default, help=help_text or None)
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    group = parser.add_argument_group("engine")
    EngineArgs.add_cli_args(group)


def _read_requests(args) -> list[dict]:
    requests = [{"prompt": p} for p in args.prompts]
    if args.input:
        with open(args.input, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{args.input}:{n}: not valid JSON ({e.msg})") from None
                if not isinstance(item, dict) or ("prompt" not in item and "prompt_token_ids" not in item):
                    raise ValueError(f"{args.input}:{n}: each line needs 'prompt' or 'prompt_token_ids'")
                requests.append(item)
    if not requests:
        raise ValueError("no prompts: give them as arguments or with --input FILE.jsonl")
    return requests


def _params(args, item: dict) -> SamplingParams:
    fields = {f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_")}
    kwargs = {name: getattr(args, name) for name in _SAMPLING_FLAGS}
    kwargs.update(stop=args.stop, ignore_eos=args.ignore_eos)
    kwargs.update({k: v for k, v in item.items() if k in fields})
    return SamplingParams(**kwargs)


def run(args) -> int:
    from kvserve.engine.llm import LLM

    requests = _read_requests(args)
    params = [_params(args, item) for item in requests]
    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli(args)))
    tok = llm.get_tokenizer()
    prompts = []
    for item in requests:
        if "prompt_token_ids" in item:
            prompts.append(list(item["prompt_token_ids"]))
        elif args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": item["prompt"]})
            prompts.append(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        else:
            prompts.append(item["prompt"])
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    sink = open(args.output, "w", encoding="utf-8") if args.output else None
    try:
        for item, out in zip(requests, outputs):
            record = {"id": item.get("id"), "prompt": out.prompt, "num_prompt_tokens": len(out.prompt_token_ids),
                      "num_cached_tokens": out.num_cached_tokens,
                      "outputs": [{"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                                  for o in out.outputs]}
            if sink:
                sink.write(json.dumps(record) + "\n")
                continue
            for o in out.outputs:
                print(f"--- prompt: {out.prompt!r}" if out.prompt is not None else
                      f"--- prompt: {len(out.prompt_token_ids)} tokens")
                print(o.text)
                print(f"--- [{len(o.token_ids)} tokens, finish_reason={o.finish_reason}]")
    finally:
        if sink:
            sink.close()
    return 0


if __name__ == "__main__":
    from kvserve.cli.standalone import standalone_main

    sys.exit(standalone_main("kvserve generate", __doc__.splitlines()[0], add_arguments, run))
