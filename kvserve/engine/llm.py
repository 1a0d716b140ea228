"""LLM: the offline API, shaped like vLLM's (`LLM(model).generate(prompts, params)`)."""
from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.lora.request import LoRARequest
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]
Message = dict[str, object]


class LLM:
    """Offline batched generation. Engine args are the CLI flags with underscores, e.g.
    `LLM(max_num_batched_tokens=256, kv_cache_memory="64MiB")`."""

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = Engine(EngineArgs.from_kwargs(model, **engine_args))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """End the engine's worker processes now (tensor parallelism) rather than when this LLM is collected."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt (text or token ids) to completion; outputs come back in input order.

        lora_request: one adapter for every prompt, or a list with one (or None: the base model) per prompt.
        All requests are validated before any is queued, so a bad one raises ValueError and leaves
        the engine as it was."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        # NOTE: only finished outputs are read here, so the engine need not build the others.
        final = RequestOutputKind.FINAL_ONLY
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("sampling_params must be SamplingParams or a list of them")
        params = [p if p.output_kind == final else p.clone(output_kind=final) for p in params]
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")
        token_ids = []
        for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras)):
            ids = self.engine.tokenize_prompt(prompt)
            try:
                self.engine.validate(ids, p)
                if lora is not None:
                    self.engine.processor.check_lora(lora)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            token_ids.append(ids)
        order = {}
        for prompt, ids, p, lora in zip(prompts, token_ids, params, loras):
            rid = str(next(self._ids))
            order[rid] = len(order)
            self.engine.add_request(rid, ids, p, prompt_text=prompt if isinstance(prompt, str) else None,
                                    lora_request=lora)
        return self._run(order, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters used when none are given: --generation-config's defaults (vLLM's)."""
        return SamplingParams(**self.engine.default_sampling)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.tokenizer.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template)
            for conv in conversations]
        # NOTE: the template already holds any special tokens; don't let the tokenizer add a BOS again.
        ids = [self.engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outputs = self.generate(ids, sampling_params, use_tqdm)
        for out, text in zip(outputs, prompts):
            out.prompt = text
        return outputs

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start = time.perf_counter()
        num_in = num_out = 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        num_in += len(out.prompt_token_ids)
                        num_out += sum(len(o.token_ids) for o in out.outputs)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(f"input: {num_in / elapsed:.1f} tok/s, "
                                            f"output: {num_out / elapsed:.1f} tok/s", refresh=False)
                        bar.update(1)
        finally:
            bar.close()
        return results
