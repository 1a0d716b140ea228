"""Prompts to token ids on the server side: plain text, token ids, and chat messages (chat template)."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.server.errors import APIError


@dataclass(frozen=True)
class Prompt:
    """One prompt as the engine gets it, plus its text for `echo`."""

    token_ids: list[int]
    text: str | None  # None for a token-id prompt (decoded only if needed)


def completion_prompts(tokenizer, prompt: str | list[int] | list[str] | list[list[int]]) -> list[Prompt]:
    """OpenAI's four prompt forms -> one Prompt per prompt (a text prompt gets the tokenizer's BOS rules)."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return [Prompt(tokenizer.encode(p, add_special_tokens=True), p) if isinstance(p, str) else Prompt(list(p), None)
            for p in prompts]


def render_chat(tokenizer, conversation: list[dict[str, str]], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict | None = None) -> str:
    """The model's chat template applied to the conversation; template errors are the client's (400)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    if continue_final_message and add_generation_prompt:
        add_generation_prompt = False  # NOTE: continuing the assistant's message excludes opening a new one
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             **(template_kwargs or {}))
    except Exception as e:  # jinja's raise_exception, or a bad continue_final_message
        raise APIError(400, f"chat template failed: {e}", param="messages") from None


def chat_prompt(tokenizer, text: str) -> Prompt:
    # NOTE: the rendered template already holds its special tokens; the tokenizer must not add a BOS again.
    return Prompt(tokenizer.encode(text, add_special_tokens=False), text)
