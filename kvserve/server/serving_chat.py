"""POST /v1/chat/completions: messages -> the model's chat template -> a chat completion or SSE stream.

A stream opens each choice with a `{"role": "assistant", "content": ""}` delta, then sends content
deltas, the last of which carries finish_reason (OpenAI's chunk sequence). With tools, the output goes
through the request's tool parser (tool_choice.py, tool_output.py): calls stream as `tool_calls` deltas.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from kvserve.engine.async_engine import RequestStream
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.logprobs import chat_logprobs, prompt_logprobs_field
from kvserve.server.limits import check_messages
from kvserve.server.prompts import render_chat_prompt, template_kwargs
from kvserve.server.protocol import (ChatChoice, ChatChoiceLogprobs, ChatCompletionChunk, ChatCompletionRequest,
                                     ChatCompletionResponse, ChatDelta, ChatStreamChoice, Usage)
from kvserve.server.serving import (SSE_DONE, EventStream, ServerState, check_output, close_all, error_event,
                                    final_output, new_id, read_request, sse, unless_disconnected, with_output_kind)
from kvserve.server.tool_choice import ToolPlan, plan_tools
from kvserve.server.tool_output import ToolDeltas, tool_finish_reason, tool_message


async def create_chat_completion(state: ServerState, raw_request: Request) -> Response:
    request = await read_request(state, raw_request, ChatCompletionRequest)
    model = state.resolve_model(request.model)
    check_messages(state.config, len(request.messages))
    tools = plan_tools(request, state.tool_parser, state.config.enable_auto_tool_choice,
                       getattr(state.tokenizer, "chat_template", None))
    params = with_output_kind(tools.constrain(request.to_sampling_params(state.default_sampling)),
                              bool(request.stream))
    state.check_request(params)
    await state.check_structured_outputs(params, "tools" if tools.constraint else
                                         "structured_outputs" if request.structured_outputs else "response_format")
    kwargs = tools.template_kwargs(template_kwargs(request.chat_template_kwargs, request.chat_template,
                                                   state.config.trust_request_chat_template))
    prompt = await state.off_loop(render_chat_prompt, state.tokenizer, request.conversation(), state.text_limit,
                                  bool(request.add_generation_prompt), bool(request.continue_final_message), kwargs,
                                  tools=tools.tools)
    run = _ChatRun(request, model, params, tools)
    streams = await state.open_streams(run.id, [prompt], params, prompt_param="messages", model=model)
    if request.stream:
        return EventStream(run.events(streams[0]), close_all(streams))
    return await unless_disconnected(raw_request, run.respond(streams[0]), streams)


class _ChatRun:
    """Formats one chat request's engine outputs (streamed or whole)."""

    def __init__(self, request: ChatCompletionRequest, model: str, params: SamplingParams, tools: ToolPlan):
        self.id = new_id("chatcmpl")
        self.created = int(time.time())
        self.request, self.model, self.params, self.tools = request, model, params, tools

    def _logprobs(self, o: CompletionOutput, token_ids: list[int]) -> ChatChoiceLogprobs | None:
        if self.params.logprobs is None:
            return None
        entries = o.logprobs[len(o.token_ids) - len(token_ids):] if token_ids else []
        return ChatChoiceLogprobs(content=chat_logprobs(token_ids, entries, self.params.logprobs))

    def _chunk(self, choices: list[ChatStreamChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                       usage=usage))

    async def respond(self, stream: RequestStream) -> Response:
        final = await final_output(stream)
        choices = []
        for o in final.outputs:
            message = tool_message(self.tools, o.text)
            choices.append(ChatChoice(index=o.index, message=message, logprobs=self._logprobs(o, o.token_ids),
                                      finish_reason=tool_finish_reason(o.finish_reason, bool(message.tool_calls)),
                                      stop_reason=o.stop_reason))
        prompt_logprobs = None
        if self.request.prompt_logprobs is not None and final.prompt_logprobs is not None:  # vLLM's extra field
            prompt_logprobs = prompt_logprobs_field(final.prompt_token_ids, final.prompt_logprobs,
                                                    self.request.prompt_logprobs)
        body = ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=_usage(final, stream), prompt_logprobs=prompt_logprobs,
                                      kv_transfer_params=final.kv_transfer_params)
        return Response(body.model_dump_json(), media_type="application/json")

    async def events(self, stream: RequestStream) -> AsyncIterator[str]:
        try:
            for i in range(self.params.n):
                yield self._chunk([ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content=""),
                                                    logprobs=None, finish_reason=None)])
            done: set[int] = set()
            final = None
            parsers = {i: ToolDeltas(self.tools) for i in range(self.params.n)} if self.tools.parser else {}
            async for out in stream:
                check_output(out)
                for o in out.outputs:
                    if o.index in done:
                        continue
                    text, new_ids = out.new_texts[o.index], out.new_token_ids[o.index]
                    finished = o.finish_reason is not None
                    logprobs = self._logprobs(o, new_ids) if new_ids else None
                    content, calls, reason = text or None, None, o.finish_reason
                    if o.index in parsers:
                        content, calls = parsers[o.index].feed(text, finished)
                        reason = tool_finish_reason(reason, parsers[o.index].called)
                    if not content and not calls and not finished and logprobs is None:
                        continue  # held back: a partial character, stop string or tool-call tag
                    if finished:
                        done.add(o.index)
                    yield self._chunk([ChatStreamChoice(index=o.index,
                                                        delta=ChatDelta(content=content, tool_calls=calls),
                                                        logprobs=logprobs, finish_reason=reason,
                                                        stop_reason=o.stop_reason)])
                final = out
            if self.request.include_usage and final is not None:
                yield self._chunk([], _usage(final, stream))
        except Exception as e:  # the stream already said 200: report in-band, as OpenAI does
            yield error_event(e)
        yield SSE_DONE


def _usage(out: RequestOutput, stream: RequestStream) -> Usage:
    return Usage.of(prompt_tokens=len(out.prompt_token_ids),
                    completion_tokens=sum(stream.num_output_tokens),
                    cached_tokens=out.num_cached_tokens)
