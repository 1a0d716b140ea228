"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM-shaped)."""
from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field

# Below this temperature a request is treated as greedy (vLLM uses the same cut-off).
_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names)."""

    CUMULATIVE = 0
    """Everything so far: the whole text, token ids and logprobs, in every output."""
    DELTA = 1
    """Only what is new since the previous output (streaming)."""
    FINAL_ONLY = 2
    """One output, when the request finishes, with everything."""


@dataclass
class StructuredOutputsParams:
    """Constrained decoding (vLLM's names): exactly one of json, regex, choice, grammar, json_object,
    structural_tag. Checked here for shape only; whether the grammar compiles is checked at admission."""

    json: str | dict | None = None
    """A JSON schema (a dict, or its JSON text): the output is a JSON value that validates against it."""
    regex: str | None = None
    """The output matches this regular expression (whole)."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF (GBNF) grammar whose `root` rule the output matches."""
    json_object: bool | None = None
    """The output is some JSON object (OpenAI's response_format json_object)."""
    structural_tag: str | dict | None = None
    """An xgrammar structural tag (free text with constrained segments, e.g. tool calls)."""
    disable_any_whitespace: bool = False
    """JSON without optional whitespace (compact)."""
    disable_additional_properties: bool = False
    """Accepted for vLLM compatibility; kvserve's JSON grammars are always strict (objects carry only the
    properties their schema names)."""
    whitespace_pattern: str | None = None

    _KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        set_kinds = [k for k in self._KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object, structural_tag; got {set_kinds or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object or string), got {self.json!r}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"structured_outputs.regex must be a non-empty string, got {self.regex!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"structured_outputs.grammar must be a non-empty string, got {self.grammar!r}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be true or false, got {self.json_object!r}")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise ValueError("structured_outputs.structural_tag must be an object or a string")

    @property
    def kind(self) -> str:
        return next(k for k in self._KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """What the compiled grammar depends on (the compile cache's key)."""
        spec = getattr(self, self.kind)
        if isinstance(spec, dict):
            spec = json.dumps(spec, sort_keys=True)
        elif isinstance(spec, (list, tuple)):
            spec = tuple(spec)
        return (self.kind, spec, self.disable_any_whitespace, self.whitespace_pattern)


@dataclass
class SamplingParams:
    """Per-request sampling and stopping rules; validated on construction (ValueError)."""

    n: int = 1
    """Number of samples drawn for the prompt; they share the prompt's KV blocks."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's; in [0, 1]."""
    repetition_penalty: float = 1.0
    """> 1 discourages tokens already in the prompt or output (CTRL-style, multiplicative)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated; in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logit of tokens already generated; in [-2, 2]."""
    logit_bias: dict[int, float] | None = None
    """Token id -> bias added to its logit before anything else; each bias in [-100, 100]."""
    seed: int | None = None
    """Same seed => same output, whatever else is in the batch."""
    max_tokens: int | None = 16
    """Tokens to generate at most; None means up to max_model_len."""
    min_tokens: int = 0
    """EOS and stop_token_ids are masked until this many tokens were generated."""
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    """Stop strings, found across token boundaries; excluded from the text unless include_stop_str_in_output."""
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top alternatives (0: only the sampled one)."""
    prompt_logprobs: int | None = None
    """Return each prompt token's logprob plus this many top alternatives (vLLM's; the first token has none)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (xgrammar)."""
    skip_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """What each output carries: everything so far, only what is new, or only the final output."""
    extra_args: dict | None = None
    """vLLM's: arguments for plug-ins; "kv_transfer_params" is what the request tells the KV connector."""
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        elif isinstance(self.stop, (list, tuple)) or self.stop is None:
            self._stop_list = list(self.stop or [])
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, rule: str, value) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}")

        def integer(name: str, low: int | None = None, high: int | None = None, optional: bool = False) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            rule = "an integer" + (f" >= {low}" if low is not None and high is None else "")
            if low is not None and high is not None:
                rule = f"an integer in [{low}, {high}]"
            if not _is_int(value) or (low is not None and value < low) or (high is not None and value > high):
                raise bad(name, rule, value)

        def real(name: str, rule: str, ok) -> None:
            value = getattr(self, name)
            # NOTE: NaN fails every comparison, so a range check alone would let it through.
            if not _is_real(value) or not math.isfinite(value):
                raise bad(name, "a finite number", value)
            if not ok(value):
                raise bad(name, rule, value)

        integer("n", 1)
        real("temperature", "non-negative", lambda v: v >= 0.0)
        real("top_p", "in (0, 1]", lambda v: 0.0 < v <= 1.0)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "-1 (disabled), 0 (disabled) or a positive integer", self.top_k)
        real("min_p", "in [0, 1]", lambda v: 0.0 <= v <= 1.0)
        real("repetition_penalty", "greater than 0", lambda v: v > 0.0)
        real("presence_penalty", "in [-2, 2]", lambda v: -2.0 <= v <= 2.0)
        real("frequency_penalty", "in [-2, 2]", lambda v: -2.0 <= v <= 2.0)
        integer("seed", -2**63, 2**63 - 1, optional=True)
        integer("max_tokens", 1, optional=True)
        integer("min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}, max_tokens={self.max_tokens}")
        integer("logprobs", 0, optional=True)
        integer("prompt_logprobs", 0, optional=True)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "a StructuredOutputsParams", self.structured_outputs)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "a RequestOutputKind", self.output_kind)
        for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, flag), bool):
                raise bad(flag, "true or false", getattr(self, flag))
        if any(not isinstance(s, str) or s == "" for s in self._stop_list):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise bad("logit_bias", "a mapping of token id to bias", self.logit_bias)
        for token_id, bias in (self.logit_bias or {}).items():
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token_id!r}")
            if not _is_real(bias) or not -100.0 <= bias <= 100.0:  # NaN fails the range
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token_id}")

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def effective_top_k(self) -> int:
        """top_k with both disabled spellings (-1, 0) mapped to 0."""
        return max(self.top_k, 0)

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def clone(self, **changes) -> "SamplingParams":
        kwargs = {f: getattr(self, f) for f in self.__dataclass_fields__ if not f.startswith("_")}
        kwargs.update(changes)
        return SamplingParams(**kwargs)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
