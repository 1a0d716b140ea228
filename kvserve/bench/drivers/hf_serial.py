"""Peer driver: `transformers` generate, one request at a time in arrival order (the setup kvserve replaces).

Args (JSON file): model (HF folder), workload, threads. Greedy; ignore_eos requests generate exactly
max_tokens. A request waits while earlier ones run, as it would behind a one-at-a-time server, so its TTFT
counts that wait.
"""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

import replay


class _TokenClock(BaseStreamer):
    """Timestamps each generated token; generate() hands the prompt to put() first, which is skipped."""

    def __init__(self, timing: replay.RequestTiming, clock: replay.Clock):
        self.timing, self.clock, self.seen_prompt = timing, clock, False

    def put(self, value):
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.timing.token_times.append(self.clock.now())
        self.timing.token_ids.extend(int(t) for t in value.reshape(-1).tolist())

    def end(self):
        pass


def main() -> None:
    args = replay.read_args()
    torch.set_num_threads(int(args["threads"]))
    model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32).eval()
    requests = replay.load_requests(args["workload"])

    def generate(ids: list[int], max_tokens: int, ignore_eos: bool, streamer=None):
        return model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=max_tokens, min_new_tokens=max_tokens if ignore_eos else None,
                              do_sample=False, streamer=streamer, pad_token_id=model.config.eos_token_id)

    with torch.inference_mode():
        generate([1, 2, 3, 4], 4, True)  # warm-up: first-call allocations are not the workload's
        clock = replay.Clock()
        timings = []
        for r in requests:
            t = replay.RequestTiming(str(r["id"]), len(r["prompt_token_ids"]), float(r.get("arrival_s", 0.0)))
            timings.append(t)
            clock.sleep_until(t.arrival_s)
            try:
                generate(r["prompt_token_ids"], int(r["max_tokens"]), bool(r.get("ignore_eos", True)),
                         _TokenClock(t, clock))
            except Exception as e:  # reported per request, as a server would answer an error
                t.error = f"{type(e).__name__}: {e}"
        replay.write_results(timings, clock.now())


if __name__ == "__main__":
    main()
