"""Pydantic models of the OpenAI API: request bodies (validated strictly) and response bodies.

This is the only place pydantic is used. Requests are parsed with `model_validate_json(..., strict)`,
so wrong JSON types are errors (no "5" -> 5 coercion), unknown fields are ignored (clients send fields
we do not implement), and `to_sampling_params` turns a request into the engine's SamplingParams.
Response fields the schema requires are declared without defaults, so they are always serialized
(null included); optional ones use `exclude_if=None` so they are left out rather than sent as null.
"""
from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.server.errors import APIError


def _none(value: Any) -> bool:
    return value is None


# ---- requests ---------------------------------------------------------------------------------
class _Request(BaseModel):
    # NOTE: JSON has no NaN or Infinity, but Python's parser (and so pydantic's, by default) reads them.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool | None = False


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions, including vLLM's extras."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    """OpenAI's: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's extra: {"json" | "regex" | "choice" | "grammar" | "structural_tag": ..., options}."""
    prompt_logprobs: int | None = None
    """vLLM's extra: the prompt tokens' logprobs with this many alternatives (`prompt_logprobs` in the body)."""
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's extra: what the request tells the KV connector (--kv-transfer-config), e.g. {"do_remote_decode": true}."""

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _checked_prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is not None and self.stream:  # vLLM's rule: a stream chunk has no such field
            raise APIError(400, "prompt_logprobs is not available with stream: true", param="prompt_logprobs")
        return self.prompt_logprobs

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         defaults: dict | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
        """defaults (--generation-config): for every field the request leaves unset; set fields win."""
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise APIError(400, "logit_bias keys must be token ids (integers as strings)",
                               param="logit_bias") from None
        values = dict(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                      min_p=self.min_p, presence_penalty=self.presence_penalty,
                      frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                      seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                      min_tokens=self.min_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
                      skip_special_tokens=self.skip_special_tokens, prompt_logprobs=prompt_logprobs)
        # None means "the default" for every field a client may send as null.
        kwargs = {k: v for k, v in values.items() if v is not None}
        for key, value in (defaults or {}).items():
            if key == "max_tokens":
                max_tokens = value if max_tokens is None else max_tokens
            else:
                kwargs.setdefault(key, value)
        structured = self.structured_outputs_params()
        try:
            extra = {"kv_transfer_params": self.kv_transfer_params} if self.kv_transfer_params is not None else None
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, logit_bias=bias,
                                  structured_outputs=structured, extra_args=extra, **kwargs)
        except ValueError as e:
            first = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), param=first if first in values or first == "max_tokens" else None) from None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """response_format or structured_outputs as the engine's StructuredOutputsParams (APIError 400 if the
        shape is wrong; whether the grammar compiles is checked at admission)."""
        if self.response_format is not None and self.structured_outputs is not None:
            raise APIError(400, "set response_format or structured_outputs, not both", param="response_format")
        if self.structured_outputs is not None:
            fields = set(StructuredOutputsParams.__dataclass_fields__)
            unknown = sorted(set(self.structured_outputs) - fields)
            if unknown:
                raise APIError(400, f"structured_outputs has unknown fields {unknown}; it takes "
                                    f"{sorted(fields)}", param="structured_outputs")
            try:
                return StructuredOutputsParams(**self.structured_outputs)
            except (TypeError, ValueError) as e:
                raise APIError(400, str(e), param="structured_outputs") from None
        return _response_format_params(self.response_format)


def _response_format_params(fmt: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError(400, "response_format json_schema needs a `json_schema` object "
                                "({\"name\": ..., \"schema\": {...}})", param="response_format")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                           param="response_format")
        return StructuredOutputsParams(json=schema)
    if kind == "structural_tag":
        return StructuredOutputsParams(structural_tag={k: v for k, v in fmt.items()})
    raise APIError(400, f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="response_format")


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @property
    def num_prompts(self) -> int:
        p = self.prompt
        return 1 if isinstance(p, str) or not p or isinstance(p[0], int) else len(p)

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError(400, "best_of is only supported equal to n", param="best_of")
        prompt_logprobs = self._checked_prompt_logprobs()
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens get logprobs too
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return self._sampling_params(self.max_tokens, self.logprobs, defaults, prompt_logprobs)


class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON Schema of an object; none means no parameters."""
    strict: bool | None = None


class ChatTool(_Request):
    """An entry of `tools`: only functions (OpenAI's custom tools are refused)."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    """tool_choice {"type": "function", "function": {"name": ...}}: call this function."""

    type: Literal["function"]
    function: FunctionName


class MessageFunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(_Request):
    """A call an earlier assistant message made (sent back in the conversation)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall

    def template_dict(self) -> dict[str, Any]:
        # NOTE: chat templates write arguments with `tojson`, so they get a dict, not the JSON text OpenAI
        # sends (vLLM does the same); text that is not JSON is passed as it is.
        args = self.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    """An assistant message's calls."""
    tool_call_id: str | None = None
    """A tool message: the call it answers."""

    def text(self) -> str:
        """The content as one string; a list of text parts is joined with newlines (as vLLM does)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"content parts of type {part.type!r} are not supported (text only)",
                               param="messages")
            texts.append(part.text)
        return "\n".join(texts)


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    """vLLM's extra: a Jinja template for this request (only with --trust-request-chat-template)."""
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """None: "auto" with tools, "none" without (OpenAI's defaults). See server/tool_choice.py."""
    parallel_tool_calls: bool | None = None

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be in [0, 20], got {self.top_logprobs}", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, defaults,
                                     self._checked_prompt_logprobs())

    def conversation(self) -> list[dict[str, Any]]:
        return conversation_of(self.messages)


def conversation_of(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat-template input for OpenAI messages. Raises APIError 400 for no messages."""
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    # NOTE: chat templates know system/user/assistant; OpenAI's newer "developer" role is a system prompt.
    return [_template_message(m) for m in messages]


def _template_message(m: ChatMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        message["tool_calls"] = [c.template_dict() for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True
    return_token_strs: bool | None = False


class ExplainPrefixRequest(_Request):
    """POST /debug/prefix-cache/explain: a prompt (text or token ids), or chat messages (chat template)."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's)."""

    model: str | None = None
    tokens: list[int]


# ---- responses --------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's Logprob, in its `prompt_logprobs` response field."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# vLLM's shape: per prompt token, null for the first, else token id (a string: JSON keys) -> its Logprob.
PromptLogprobsField = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = Field(default=None, exclude_if=_none)
    prompt_logprobs: PromptLogprobsField | None = Field(default=None, exclude_if=_none)


class CompletionResponse(BaseModel):
    """A /v1/completions body; stream chunks have the same shape (as in OpenAI's API)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(default=None, exclude_if=_none)
    kv_transfer_params: dict[str, Any] | None = Field(default=None, exclude_if=_none)
    """vLLM's extra: what the KV connector returned for the request (--kv-transfer-config)."""


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str
    """JSON text, as the model wrote it."""


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ResponseToolCall] | None = Field(default=None, exclude_if=_none)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = Field(default=None, exclude_if=_none)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsField | None = Field(default=None, exclude_if=_none)
    kv_transfer_params: dict[str, Any] | None = Field(default=None, exclude_if=_none)
    """vLLM's extra: what the KV connector returned for the request (--kv-transfer-config)."""


class FunctionCallChunk(BaseModel):
    name: str | None = Field(default=None, exclude_if=_none)
    arguments: str | None = Field(default=None, exclude_if=_none)


class ToolCallChunk(BaseModel):
    """A piece of a streamed call: the first carries id, type and name; later ones argument text."""

    index: int
    id: str | None = Field(default=None, exclude_if=_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_none)
    function: FunctionCallChunk | None = Field(default=None, exclude_if=_none)


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_none)
    content: str | None = Field(default=None, exclude_if=_none)
    tool_calls: list[ToolCallChunk] | None = Field(default=None, exclude_if=_none)


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = Field(default=None, exclude_if=_none)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = Field(default=None, exclude_if=_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    root: str
    parent: str | None = None
    """For a LoRA adapter: the base model it runs on."""
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(default=None, exclude_if=_none)


class DetokenizeResponse(BaseModel):
    prompt: str


class LoadLoRAAdapterRequest(_Request):
    """POST /v1/load_lora_adapter (vLLM's)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(_Request):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None
