"""The requests of `kvserve bench soak`: seeded random traffic over /v1/completions, /v1/chat/completions
and /v1/messages, each request planned with what a correct server must answer to it.

Valid requests draw random prompt lengths and sampling parameters, stay within max_model_len, and
sometimes start with one of a few long shared prefixes (pinned with Anthropic's cache_control on
/v1/messages). Invalid ones break exactly one rule (bad JSON, a wrong type, an out-of-range value, an
unknown model, empty messages, a prompt over max_model_len) and must get a 4xx. About 20% of the valid
ones are planned to be abandoned by their client. The runner (soak.py) sends them, hangs up where
planned, and records each answer as a Result.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

COMPLETIONS, CHAT, MESSAGES = "/v1/completions", "/v1/chat/completions", "/v1/messages"
ENDPOINT_NAMES = {COMPLETIONS: "completions", CHAT: "chat", MESSAGES: "messages"}

# Common English words: text prompts are made of them, and token-id prompts of their token ids.
WORDS = tuple("""the of and to in is was for on that with as by at from his her they this had not are but
which have one were all their there been has when who more will would can out about into them some than
time only its could other new these two may first then any like our over such man made after also did
many before must through back years where much your way well down should because each just those people
how too little state good very make world still own see men work long get here between both life being
under never day same another know while last might great old year off come since against go came right
used take three small place house water city light night story river green morning music garden window
table paper friend winter summer letter answer travel number simple mountain question market family
history student teacher station picture village island engine bridge forest ocean silver yellow purple
""".split())

NUM_SHARED_PREFIXES = 3

# How a request ended (Result.outcome).
COMPLETED, ABORTED, OVERLOADED, REJECTED, UNEXPECTED = (
    "completed", "client_aborted", "overloaded", "rejected", "unexpected")


@dataclass(frozen=True)
class ServerInfo:
    """What the generator needs to know of the server (read once at the start of the soak)."""

    model: str
    max_model_len: int
    token_ids: tuple[int, ...]
    """Real token ids (the tokenization of WORDS) that token-id prompts are drawn from."""
    tokens_per_word: float
    """Tokens per word of WORDS text, to keep text prompts within max_model_len."""


@dataclass(frozen=True)
class PlannedRequest:
    """One request and what its answer must be."""

    endpoint: str
    body: bytes
    """The raw body: invalid requests may carry bytes that are not JSON on purpose."""
    stream: bool
    valid: bool
    """True: it must get a 2xx (or an overload answer). False: it must get a 4xx with an error body."""
    num_choices: int = 1
    """Choices (OpenAI) a complete answer holds: prompts x n."""
    tags: tuple[str, ...] = ()
    """Traffic categories: shared_prefix, pinned, burst, and for invalid requests the rule broken."""
    disconnect_after_chunks: int | None = None
    """Streams: the client closes the connection after this many data lines."""
    cancel_after_s: float | None = None
    """Whole answers: the client gives up after this many seconds."""

    @property
    def anthropic(self) -> bool:
        return self.endpoint == MESSAGES


@dataclass
class Result:
    """How one request ended: an outcome above, the HTTP status if one came, and for an unexpected
    answer what was wrong with it."""

    planned: PlannedRequest
    outcome: str
    status: int | None = None
    problem: str | None = None
    excerpt: str = ""


class TrafficGenerator:
    """Seeded random PlannedRequests for one server."""

    def __init__(self, info: ServerInfo, rng: random.Random, invalid_fraction: float = 0.05,
                 disconnect_fraction: float = 0.2, shared_fraction: float = 0.35):
        self.info, self.rng = info, rng
        self.invalid_fraction, self.disconnect_fraction = invalid_fraction, disconnect_fraction
        self.shared_fraction = shared_fraction
        # NOTE: prompts stay "short to a few hundred tokens" and leave room for max_tokens up to 128.
        self.max_prompt_tokens = max(8, min(320, info.max_model_len - 160))
        prefix_tokens = max(4, min(200, self.max_prompt_tokens * 2 // 3))
        self.prefix_ids = [self._ids(prefix_tokens) for _ in range(NUM_SHARED_PREFIXES)]
        self.prefix_texts = [self._words(int(prefix_tokens / info.tokens_per_word)) for _ in range(NUM_SHARED_PREFIXES)]
        self._invalid_cycle: list[tuple[str, str]] = []

    # ---- the next request ------------------------------------------------------------------------
    def next(self, burst: bool = False) -> PlannedRequest:
        """A request for a client task; `burst` requests are small, valid and never abandoned."""
        r = self.rng
        if not burst and r.random() < self.invalid_fraction:
            return self.invalid()
        endpoint = r.choice((COMPLETIONS, CHAT, MESSAGES))
        stream = r.random() < 0.5
        build = {COMPLETIONS: self._completion, CHAT: self._chat, MESSAGES: self._message}[endpoint]
        req = build(stream, burst)
        if burst:
            return replace(req, tags=req.tags + ("burst",))
        if r.random() < self.disconnect_fraction:
            if stream:
                return replace(req, disconnect_after_chunks=r.randint(0, 12))
            return replace(req, cancel_after_s=round(r.uniform(0.02, 1.5), 3))
        return req

    def probe(self) -> PlannedRequest:
        """The smallest valid request (one greedy token), to make an idle engine step once."""
        body = {"model": self.info.model, "prompt": self._ids(4), "max_tokens": 1, "temperature": 0}
        return PlannedRequest(COMPLETIONS, _dumps(body), stream=False, valid=True, tags=("probe",))

    # ---- valid requests ------------------------------------------------------------------------
    def _max_tokens(self, burst: bool, room: int) -> int:
        r = self.rng
        wanted = r.randint(1, 16) if burst else r.choice((r.randint(1, 8), r.randint(1, 32), r.randint(16, 128)))
        return max(1, min(wanted, room))

    def _prompt_len(self) -> int:
        r = self.rng
        return r.choice((r.randint(1, 16), r.randint(8, 64), r.randint(32, self.max_prompt_tokens)))

    def _completion(self, stream: bool, burst: bool) -> PlannedRequest:
        r, tags = self.rng, []
        if not burst and r.random() < self.shared_fraction:
            prefix = r.choice(self.prefix_ids)
            prompt = prefix + self._ids(r.randint(1, max(1, self.max_prompt_tokens - len(prefix))))
            tags.append("shared_prefix")
        else:
            prompt = self._ids(self._prompt_len())
        prompts = [prompt] if burst or r.random() < 0.9 else [prompt, self._ids(self._prompt_len())]
        room = self.info.max_model_len - max(len(p) for p in prompts)
        body = {"model": self.info.model, "prompt": prompts[0] if len(prompts) == 1 else prompts, "stream": stream}
        body.update(self._openai_sampling(self._max_tokens(burst, room)))
        if r.random() < 0.2:
            body["logprobs"] = r.randint(0, 5)
        elif r.random() < 0.05:
            body["echo"] = True
        if stream and r.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return PlannedRequest(COMPLETIONS, _dumps(body), stream, True, len(prompts) * body.get("n", 1), tuple(tags))

    def _chat(self, stream: bool, burst: bool) -> PlannedRequest:
        r, tags = self.rng, []
        messages = []
        if not burst and r.random() < self.shared_fraction:
            messages.append({"role": "system", "content": r.choice(self.prefix_texts)})
            tags.append("shared_prefix")
        elif r.random() < 0.3:
            messages.append({"role": "system", "content": self._words(r.randint(1, 20))})
        for turn in range(r.choice((1, 1, 1, 3))):
            messages.append({"role": "user" if turn % 2 == 0 else "assistant",
                             "content": self._words(r.randint(1, 40))})
        num_words = sum(len(m["content"].split()) for m in messages)
        budget = self._text_budget(num_words, len(messages))
        if budget < 1:  # shrink the last message until the prompt fits
            messages[-1]["content"] = self._words(1)
            budget = self._text_budget(sum(len(m["content"].split()) for m in messages), len(messages))
        body = {"model": self.info.model, "messages": messages, "stream": stream}
        sampling = self._openai_sampling(self._max_tokens(burst, max(1, budget)))
        if r.random() < 0.5:
            sampling["max_completion_tokens"] = sampling.pop("max_tokens")
        body.update(sampling)
        if r.random() < 0.2:
            body["logprobs"] = True
            if r.random() < 0.7:
                body["top_logprobs"] = r.randint(0, 5)
        if stream and r.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return PlannedRequest(CHAT, _dumps(body), stream, True, body.get("n", 1), tuple(tags))

    def _message(self, stream: bool, burst: bool) -> PlannedRequest:
        r, tags = self.rng, []
        body: dict = {"model": self.info.model, "stream": stream}
        system_words = 0
        if not burst and r.random() < self.shared_fraction:
            text = r.choice(self.prefix_texts)
            block = {"type": "text", "text": text}
            if r.random() < 0.7:
                block["cache_control"] = {"type": "ephemeral"}
                tags.append("pinned")
            body["system"] = [block]
            system_words = len(text.split())
            tags.append("shared_prefix")
        elif r.random() < 0.3:
            body["system"] = self._words(r.randint(1, 20))
            system_words = len(body["system"].split())
        turns = r.choice((1, 1, 1, 3))
        if r.random() < 0.1:
            turns += 1  # ends with an assistant message: a prefill the reply continues
        messages = []
        for turn in range(turns):
            content = self._words(r.randint(1, 40))
            if r.random() < 0.3:
                content = [{"type": "text", "text": content}]
            messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": content})
        body["messages"] = messages
        num_words = system_words + sum(len((m["content"] if isinstance(m["content"], str)
                                            else m["content"][0]["text"]).split()) for m in messages)
        body["max_tokens"] = self._max_tokens(burst, max(1, self._text_budget(num_words, len(messages) + 1)))
        if r.random() < 0.8:
            body["temperature"] = r.choice((0.0, 0.0, 0.3, 0.7, 1.0))
        if r.random() < 0.3:
            body["top_p"] = r.choice((0.1, 0.5, 0.9, 1.0))
        if r.random() < 0.3:
            body["top_k"] = r.choice((1, 5, 40, 200))
        if r.random() < 0.2:
            body["stop_sequences"] = [r.choice(WORDS) for _ in range(r.randint(1, 3))]
        return PlannedRequest(MESSAGES, _dumps(body), stream, True, 1, tuple(tags))

    def _openai_sampling(self, max_tokens: int) -> dict:
        """Random sampling fields shared by completions and chat, all within their valid ranges."""
        r = self.rng
        p: dict = {"max_tokens": max_tokens}
        optional: list[tuple[float, str, Callable[[], object]]] = [
            (0.85, "temperature", lambda: r.choice((0.0, 0.0, 0.3, 0.7, 1.0, 1.5))),
            (0.4, "top_p", lambda: r.choice((0.1, 0.5, 0.9, 0.95, 1.0))),
            (0.4, "top_k", lambda: r.choice((-1, 0, 1, 5, 40, 200))),
            (0.25, "min_p", lambda: r.choice((0.0, 0.05, 0.2, 0.5))),
            (0.25, "presence_penalty", lambda: round(r.uniform(-2, 2), 2)),
            (0.25, "frequency_penalty", lambda: round(r.uniform(-2, 2), 2)),
            (0.2, "repetition_penalty", lambda: r.choice((0.8, 1.0, 1.1, 1.3))),
            (0.3, "seed", lambda: r.randrange(2 ** 31)),
            (0.3, "n", lambda: r.randint(1, 3)),
            (0.25, "stop", lambda: r.choice((r.choice(WORDS), "\n", [r.choice(WORDS) for _ in range(3)]))),
            (0.3, "ignore_eos", lambda: True),
            (0.1, "min_tokens", lambda: r.randint(0, max_tokens)),
            (0.05, "logit_bias", lambda: {str(r.choice(self.info.token_ids)): round(r.uniform(-5, 5), 2)}),
        ]
        for probability, name, value in optional:
            if r.random() < probability:
                p[name] = value()
        return p

    def _text_budget(self, num_words: int, num_messages: int) -> int:
        """Tokens left for max_tokens after a text prompt of this size (estimated with a margin for the
        chat template's role markers and for words that tokenize longer than average)."""
        estimate = 1.25 * num_words * self.info.tokens_per_word + 8 * num_messages + 32
        return int(self.info.max_model_len - estimate)

    # ---- invalid requests ----------------------------------------------------------------------
    def invalid(self) -> PlannedRequest:
        """A request that breaks exactly one rule; a correct server answers it with a 4xx. The (endpoint,
        rule) pairs come round in a shuffled cycle, so even a short soak sends many different ones."""
        if not self._invalid_cycle:
            self._invalid_cycle = [(e, reason) for e in (COMPLETIONS, CHAT, MESSAGES)
                                   for reason in self._invalid_cases(e, False)]
            self.rng.shuffle(self._invalid_cycle)
        endpoint, reason = self._invalid_cycle.pop()
        stream = self.rng.random() < 0.3
        body = self._invalid_cases(endpoint, stream)[reason]()
        return PlannedRequest(endpoint, body if isinstance(body, bytes) else _dumps(body), stream, False,
                              tags=("invalid", f"invalid:{reason}"))

    def _invalid_cases(self, endpoint: str, stream: bool) -> dict[str, Callable[[], bytes | dict]]:
        r = self.rng
        base = {"model": self.info.model, "max_tokens": 4, "stream": stream}
        if endpoint == COMPLETIONS:
            base["prompt"] = self._ids(8)
        else:
            base["messages"] = [{"role": "user", "content": self._words(5)}]
        too_long = self.info.max_model_len + 16
        cases: dict[str, Callable[[], bytes | dict]] = {
            "bad_json": lambda: _dumps(base)[:-5],
            "not_an_object": lambda: b"[1, 2, 3]",
            "unknown_model": lambda: {**base, "model": f"no-such-model-{r.randrange(10 ** 6)}"},
            "temperature_negative": lambda: {**base, "temperature": -1},
            "temperature_nan": lambda: {**base, "temperature": float("nan")},
            "temperature_infinity": lambda: {**base, "temperature": float("inf")},
            "temperature_string": lambda: {**base, "temperature": "hot"},
            "top_p_above_1": lambda: {**base, "top_p": 2},
            "top_k_below_minus_1": lambda: {**base, "top_k": -5},
            "max_tokens_zero": lambda: {**base, "max_tokens": 0},
            "max_tokens_string": lambda: {**base, "max_tokens": "10"},
            "stream_string": lambda: {**base, "stream": "yes"},
        }
        if endpoint == COMPLETIONS:
            cases.update({
                "empty_prompt": lambda: {**base, "prompt": []},
                "prompt_wrong_type": lambda: {**base, "prompt": {"text": "hi"}},
                "token_id_out_of_vocab": lambda: {**base, "prompt": [1, 10 ** 9, 2]},
                "too_long_prompt": lambda: {**base, "prompt": self._ids(too_long)},
                "logprobs_too_many": lambda: {**base, "logprobs": 50},
                "prompt_logprobs_too_many": lambda: {**base, "prompt_logprobs": 50},
            })
        else:
            cases.update({
                "empty_messages": lambda: {**base, "messages": []},
                "messages_wrong_type": lambda: {**base, "messages": "hello"},
                "too_long_prompt": lambda: {**base, "messages": [
                    {"role": "user", "content": self._words(int(1.5 * too_long / self.info.tokens_per_word))}]},
            })
        if endpoint == MESSAGES:
            cases.update({
                "missing_max_tokens": lambda: {k: v for k, v in base.items() if k != "max_tokens"},
                "system_role_in_messages": lambda: {**base, "messages": [{"role": "system", "content": "hi"}]},
                "image_block": lambda: {**base, "messages": [{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
            })
        else:
            cases.update({
                "n_zero": lambda: {**base, "n": 0},
                "presence_penalty_out_of_range": lambda: {**base, "presence_penalty": 3.5},
                "repetition_penalty_nan": lambda: {**base, "repetition_penalty": float("nan")},
                "min_p_above_1": lambda: {**base, "min_p": 1.5},
                "stop_empty_string": lambda: {**base, "stop": [""]},
                "min_tokens_above_max_tokens": lambda: {**base, "min_tokens": 9},
                "logit_bias_bad_key": lambda: {**base, "logit_bias": {"abc": 1.0}},
            })
        return cases

    # ---- pieces ----------------------------------------------------------------------------------
    def _ids(self, n: int) -> list[int]:
        return [self.rng.choice(self.info.token_ids) for _ in range(n)]

    def _words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(max(1, n)))


def _dumps(body: dict) -> bytes:
    # NOTE: allow_nan (json's default) writes nan and inf as the bare tokens NaN and Infinity, which are not
    # JSON (RFC 8259); the *_nan and *_infinity cases send them on purpose.
    return json.dumps(body).encode()
