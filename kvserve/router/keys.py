"""A request's routing key: the prompt the worker will run, as text and (with a tokenizer) token ids.

Chat requests are keyed on the whole conversation rendered with the model's chat template, as the worker
renders it (server/prompts.py), never on the first message alone: two conversations that share a system
prompt but not their turns must not look identical, and a conversation's next turn must extend its key.
Without a tokenizer the key is the messages' roles and contents in order (still prefix-preserving).
Tools are not rendered into the key (a worker renders them with its --tool-call-parser's plan).
"""
from __future__ import annotations

import logging

from kvserve.router.policies import RoutingKey
from kvserve.server.errors import APIError
from kvserve.server.prompts import render_chat, template_kwargs
from kvserve.server.protocol import ChatCompletionRequest

logger = logging.getLogger("kvserve.router")


def plain_chat_text(messages: list) -> str:
    parts = []
    for m in messages:
        if isinstance(m, dict):
            parts.append(f"<{m.get('role')}>{m.get('content')}")
    return "".join(parts)


class KeyMaker:
    """Routing keys; `tokenizer` None: text only (the precise policy then routes by load alone)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def key(self, path: str, body: dict) -> RoutingKey:
        """Never raises: a body the worker will refuse is routed on what can be read of it."""
        if path.endswith("/chat/completions"):
            return self._chat_key(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch goes to one worker: its first prompt decides where
        if isinstance(prompt, str):
            ids = self._encode(prompt, add_special_tokens=True)
            return RoutingKey(prompt, ids)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return RoutingKey("".join(f"{t}," for t in prompt), list(prompt))
        return RoutingKey("")

    def _chat_key(self, body: dict) -> RoutingKey:
        messages = body.get("messages")
        fallback = RoutingKey(plain_chat_text(messages) if isinstance(messages, list) else "")
        if self.tokenizer is None or getattr(self.tokenizer, "chat_template", None) is None:
            return fallback
        try:
            request = ChatCompletionRequest.model_validate(body)
            kwargs = template_kwargs(request.chat_template_kwargs, None, trusted=False)
            text = render_chat(self.tokenizer, request.conversation(), bool(request.add_generation_prompt),
                               bool(request.continue_final_message), kwargs)
        except (APIError, ValueError) as e:  # the worker will answer the client's error itself
            logger.debug("routing on the plain messages: %s", e)
            return fallback
        return RoutingKey(text, self._encode(text, add_special_tokens=False))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int] | None:
        if self.tokenizer is None:
            return None
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:  # an id-only tokenizer (dummy weights) cannot encode text
            logger.debug("routing on text alone: %s", e)
            return None
