"""Engine: the in-process front end over an EngineCore (what `LLM` and the tests drive).

    add_request:  prompt -> Processor (tokenize, validate, fan out n samples) -> core.add_request
    step():       core.step() (schedule -> execute -> update) -> OutputProcessor (text, stop strings)
                  -> RequestOutputs; samples the front end finished are aborted in the core at once

The server runs the same two halves in two processes (engine/async_engine.py).
"""
from __future__ import annotations

import logging
import time

from kvserve.config import EngineArgs
from kvserve.engine.core import EngineCore
from kvserve.engine.lora_checker import AdapterChecker
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.processor import Processor, eos_token_ids
from kvserve.lora.request import LoRARequest
from kvserve.model_loader.loader import load_tokenizer
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve")


class Engine:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.config = args.create_engine_config()
        self.default_sampling = args.default_sampling()
        """SamplingParams defaults from --generation-config (LLM.get_default_sampling_params)."""
        self.core = EngineCore(self.config)
        self.tokenizer = load_tokenizer(self.config.model.source, self.config.load.load_format == "dummy")
        adapters = AdapterChecker(self.config.model.hf_config, self.config.lora) if self.config.lora else None
        self.processor = Processor(self.tokenizer, self.core.info,
                                   eos_token_ids(getattr(self.config.model.hf_config, "eos_token_id", None), self.tokenizer), adapters)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.last_kv_events: list = []
        """--kv-events-config: what the last step put into and took out of the prefix cache."""

    # ---- what callers read ---------------------------------------------------------------------------
    @property
    def hf_config(self):
        return self.config.model.hf_config

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    @property
    def model_name(self) -> str:
        return self.config.model.served_name

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.processor.eos_token_ids

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def block_pool(self):
        return self.core.block_pool

    freeze_gc = staticmethod(EngineCore.freeze_gc)

    # ---- requests -------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.processor.tokenize_prompt(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Checks a request fits this engine; returns its resolved max_tokens. Raises ValueError."""
        return self.processor.validate(prompt_token_ids, params)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    prompt_text: str | None = None, arrival_time: float | None = None,
                    cache_pin: tuple[int, float] | None = None, lora_request: LoRARequest | None = None) -> None:
        """Queue a request (n samples become n core requests). Raises ValueError if it cannot run.

        cache_pin: (prefix tokens, TTL seconds) — keep the KV of that prefix cached (pinned) for TTL
        seconds after its last use (Anthropic-style prompt caching). lora_request: run with this adapter
        (needs enable_lora)."""
        params = params or SamplingParams()
        if self.output_processor.sample_ids(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.tokenize_prompt(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = self.processor.make_requests(request_id, token_ids, params, arrival, cache_pin, lora_request)
        if any(c.request_id in self.core.scheduler.requests for c in children):
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt_text is None and isinstance(prompt, str):
            prompt_text = prompt
        self.output_processor.add_group(request_id, prompt_text, token_ids, [c.request_id for c in children],
                                        params, arrival)
        for child in children:
            self.core.add_request(child)

    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its samples); its blocks are released now and its final output has
        finish_reason "abort". Unknown or finished ids are ignored."""
        self.core.abort_requests(self.output_processor.sample_ids(request_id))

    def explain_prefix(self, prompt: str | list[int], snippet_tokens: int = 8,
                       lora_request: LoRARequest | None = None) -> dict:
        """How much of a prompt the prefix cache would serve (for the base model, or an adapter), and where
        the closest cached sequence diverges (position and a short text snippet on each side), to find what
        broke a cache hit."""
        token_ids = self.tokenize_prompt(prompt)
        self.processor.check_explain_prompt(token_ids)
        lora_id = lora_request.lora_int_id if lora_request is not None else 0
        return self.processor.explain(self.core.explain_prefix(token_ids, lora_id), token_ids, snippet_tokens)

    def prefix_cache_stats(self) -> dict:
        return self.core.prefix_cache_stats()

    def shutdown(self) -> None:
        """Stop the workers (tensor parallelism: its processes end); the engine cannot step after."""
        self.core.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or self.output_processor.has_unfinished_requests()

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration of the core, then its outputs as RequestOutputs. A failure attributable to one
        request (sampling, detokenization, stop strings) fails that request alone (finish_reason "error");
        a failure of the forward pass raises."""
        processed = self.output_processor.process(self.core.step())
        self.last_kv_events = self.core.drain_kv_events()  # NOTE: drained every step, so they never pile up
        if processed.reqs_to_abort:
            self.core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs
