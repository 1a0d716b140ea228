"""Prompts to token ids on the server side: plain text, token ids, and chat messages (chat template).

Everything here is synchronous and may be slow (a long text, a big conversation); the handlers run it
on the server's tokenizer thread (ServerState.off_loop), never on the event loop.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.server.errors import APIError

# apply_chat_template's own arguments: a client's chat_template_kwargs may not set them (they would change
# what the call returns, or which template runs).
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass(frozen=True)
class Prompt:
    """One prompt as the engine gets it, plus its text for `echo`."""

    token_ids: list[int]
    text: str | None  # None for a token-id prompt (decoded only if needed)


@dataclass(frozen=True)
class TextLimit:
    """The longest text worth tokenizing: no token of the vocabulary spells more than `max_chars_per_token`
    characters, so a longer text than max_model_len x that cannot fit and is refused without tokenizing."""

    max_model_len: int
    max_chars_per_token: int

    @classmethod
    def of(cls, tokenizer, max_model_len: int) -> "TextLimit":
        # NOTE: byte-level vocabularies spell each byte as one character, so a token's string is at least as
        # long as the text it decodes to; the bound is safe (it may only be loose).
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        return cls(max_model_len, max(1, longest))

    @property
    def max_chars(self) -> int:
        return self.max_model_len * self.max_chars_per_token

    def check(self, text: str, param: str) -> None:
        if len(text) > self.max_chars:
            raise APIError(400, f"the prompt has {len(text)} characters, more than can fit in max_model_len "
                                f"({self.max_model_len} tokens of at most {self.max_chars_per_token} characters)",
                           param=param, code="context_length_exceeded")


def completion_prompts(tokenizer, prompt: str | list[int] | list[str] | list[list[int]],
                       limit: TextLimit) -> list[Prompt]:
    """OpenAI's four prompt forms -> one Prompt per prompt (a text prompt gets the tokenizer's BOS rules)."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    for p in prompts:
        if isinstance(p, str):
            limit.check(p, "prompt")
    return [Prompt(tokenizer.encode(p, add_special_tokens=True), p) if isinstance(p, str) else Prompt(list(p), None)
            for p in prompts]


def template_kwargs(kwargs: dict | None, chat_template: str | None, trusted: bool) -> dict:
    """A request's chat_template_kwargs (+ vLLM's `chat_template` field) as apply_chat_template kwargs.

    Refuses a client's own template unless the server trusts them (--trust-request-chat-template): it is
    code the server would run. Refuses kwargs that are apply_chat_template's own arguments."""
    kwargs = dict(kwargs or {})
    template = kwargs.pop("chat_template", None) if chat_template is None else chat_template
    if template is not None and not trusted:
        raise APIError(400, "this server does not accept chat templates from requests "
                            "(start it with --trust-request-chat-template)", param="chat_template")
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}",
                       param="chat_template_kwargs")
    if template is not None:
        if not isinstance(template, str):
            raise APIError(400, "chat_template must be a string", param="chat_template")
        kwargs["chat_template"] = template
    return kwargs


def render_chat(tokenizer, conversation: list[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict | None = None,
                tools: list[dict] | None = None) -> str:
    """The model's chat template applied to the conversation; template errors are the client's (400).

    tools: OpenAI's tool objects, passed as HF's apply_chat_template takes them (the template renders them)."""
    if getattr(tokenizer, "chat_template", None) is None and "chat_template" not in (template_kwargs or {}):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    if continue_final_message and add_generation_prompt:
        add_generation_prompt = False  # NOTE: continuing the assistant's message excludes opening a new one
    if tools:
        template_kwargs = {**(template_kwargs or {}), "tools": tools}
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             **(template_kwargs or {}))
    except Exception as e:  # jinja's raise_exception, or a bad continue_final_message
        raise APIError(400, f"chat template failed: {e}", param="messages") from None
    if not isinstance(text, str):
        raise APIError(400, "the chat template did not render to text", param="messages")
    return text


def chat_prompt(tokenizer, text: str, limit: TextLimit) -> Prompt:
    limit.check(text, "messages")
    # NOTE: the rendered template already holds its special tokens; the tokenizer must not add a BOS again.
    return Prompt(tokenizer.encode(text, add_special_tokens=False), text)


def render_chat_prompt(tokenizer, conversation: list[dict], limit: TextLimit,
                       add_generation_prompt: bool = True, continue_final_message: bool = False,
                       template_kwargs: dict | None = None, tools: list[dict] | None = None) -> Prompt:
    """render_chat then chat_prompt, as one call for the tokenizer thread."""
    text = render_chat(tokenizer, conversation, add_generation_prompt, continue_final_message, template_kwargs,
                       tools)
    return chat_prompt(tokenizer, text, limit)
