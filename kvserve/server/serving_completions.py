"""POST /v1/completions: prompts (text or token ids, one or many) -> a completion or an SSE stream.

Choice indices follow OpenAI's rule: prompt i, sample j -> index i * n + j.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from kvserve.engine.async_engine import RequestStream
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.logprobs import completion_logprobs, concat_logprobs, echo_logprobs, prompt_logprobs_field
from kvserve.server.prompts import Prompt, completion_prompts
from kvserve.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage
from kvserve.server.serving import (SSE_DONE, EventStream, ServerState, check_output, close_all, error_event,
                                    merge_streams, new_id, read_request, sse, stream_error, unless_disconnected,
                                    with_output_kind)


async def create_completion(state: ServerState, raw_request: Request) -> Response:
    request = await read_request(state, raw_request, CompletionRequest)
    model = state.resolve_model(request.model)
    params = with_output_kind(request.to_sampling_params(state.default_sampling), bool(request.stream))
    state.check_request(params, request.num_prompts)
    await state.check_structured_outputs(params, "structured_outputs" if request.structured_outputs else
                                         "response_format")
    prompts = await state.off_loop(completion_prompts, state.tokenizer, request.prompt, state.text_limit)
    run = _CompletionRun(state, request, model, prompts, params)
    streams = await state.open_streams(run.id, prompts, params, model=model)
    if request.stream:
        return EventStream(run.events(streams), close_all(streams))
    return await unless_disconnected(raw_request, run.respond(streams), streams)


class _CompletionRun:
    """Formats one completion request's engine outputs (streamed or whole)."""

    def __init__(self, state: ServerState, request: CompletionRequest, model: str, prompts: list[Prompt],
                 params: SamplingParams):
        self.id = new_id("cmpl")
        self.created = int(time.time())
        self.state, self.request, self.model, self.prompts, self.params = state, request, model, prompts, params
        self._echo_logprobs: dict[int, CompletionLogprobs] = {}  # prompt index -> its tokens' (echo + logprobs)

    def _echo(self, prompt_index: int) -> str:
        if not self.request.echo:
            return ""
        prompt = self.prompts[prompt_index]
        return prompt.text if prompt.text is not None else self.state.tokenizer.decode(prompt.token_ids)

    def _logprobs(self, o: CompletionOutput, token_ids: list[int], text_offset: int) -> CompletionLogprobs | None:
        if self.params.logprobs is None or not token_ids:
            return None
        return completion_logprobs(token_ids, o.logprobs[len(o.token_ids) - len(token_ids):], self.params.logprobs,
                                   text_offset)

    async def _prompt_logprobs(self, prompt_index: int, out: RequestOutput) -> CompletionLogprobs | None:
        """echo with logprobs: the prompt tokens' part of a choice's logprobs (the same for the prompt's n
        choices; a DELTA stream brings the prompt logprobs in its first output only, so they are kept)."""
        if not self.request.echo or self.request.logprobs is None:
            return None
        if prompt_index not in self._echo_logprobs and out.prompt_logprobs is not None:
            self._echo_logprobs[prompt_index] = await self.state.off_loop(
                echo_logprobs, self.state.tokenizer, self.prompts[prompt_index].token_ids, out.prompt_logprobs,
                self.request.logprobs)
        return self._echo_logprobs.get(prompt_index)

    def _prompt_logprobs_field(self, out: RequestOutput):
        """vLLM's `prompt_logprobs` on each choice, when the request asked for it by that name."""
        if self.request.prompt_logprobs is None or out.prompt_logprobs is None:
            return None
        return prompt_logprobs_field(out.prompt_token_ids, out.prompt_logprobs, self.request.prompt_logprobs)

    def _response(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    async def respond(self, streams: list[RequestStream]) -> Response:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in merge_streams(streams):
                if out.finished:
                    finals[i] = check_output(out)
        except Exception as e:
            raise stream_error(e) from None
        choices = []
        for i, out in enumerate(finals):
            echo, prompt_part = self._echo(i), await self._prompt_logprobs(i, out)
            field = self._prompt_logprobs_field(out)
            for o in out.outputs:
                logprobs = concat_logprobs(prompt_part, self._logprobs(o, o.token_ids, len(echo)))
                choices.append(CompletionChoice(index=i * self.params.n + o.index, text=echo + o.text,
                                                logprobs=logprobs, finish_reason=o.finish_reason,
                                                stop_reason=o.stop_reason, prompt_logprobs=field))
        body = self._response(choices, _usage(finals, streams))
        body.kv_transfer_params = finals[0].kv_transfer_params if len(finals) == 1 else None
        return Response(body.model_dump_json(), media_type="application/json")

    async def events(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        n = self.params.n
        echoed, done, offsets = set(), set(), {}
        finals: list[RequestOutput] = []
        try:
            async for i, out in merge_streams(streams):
                check_output(out)
                for o in out.outputs:
                    index = i * n + o.index
                    if index in done:
                        continue
                    text = out.new_texts[o.index]
                    prompt_part = None
                    if index not in echoed:
                        echoed.add(index)
                        echo = self._echo(i)
                        text, offsets[index] = echo + text, len(echo)
                        prompt_part = await self._prompt_logprobs(i, out)
                    new_ids = out.new_token_ids[o.index]
                    logprobs = self._logprobs(o, new_ids, offsets.get(index, 0))
                    if logprobs is not None:
                        offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs.tokens)
                    logprobs = concat_logprobs(prompt_part, logprobs)
                    finished = o.finish_reason is not None
                    if not text and not finished and logprobs is None:
                        continue  # the detokenizer held the text back (a partial character or stop string)
                    if finished:
                        done.add(index)
                    yield sse(self._response([CompletionChoice(
                        index=index, text=text, logprobs=logprobs, finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason)]))
                if out.finished:
                    finals.append(out)
            if self.request.include_usage:
                yield sse(self._response([], _usage(finals, streams)))
        except Exception as e:  # the stream already said 200: report in-band, as OpenAI does
            yield error_event(e)
        yield SSE_DONE


def _usage(finals: list[RequestOutput], streams: list[RequestStream]) -> Usage:
    return Usage.of(prompt_tokens=sum(len(out.prompt_token_ids) for out in finals),
                    completion_tokens=sum(sum(s.num_output_tokens) for s in streams),
                    cached_tokens=sum(out.num_cached_tokens for out in finals))
