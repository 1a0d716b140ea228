"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM-shaped)."""
from __future__ import annotations

from dataclasses import dataclass, field

# Below this temperature a request is treated as greedy (vLLM uses the same cut-off).
_GREEDY_EPS = 1e-5


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
    skip_special_tokens: bool = True
    detokenize: bool = True
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, rule: str, value) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1", self.n)
        if self.temperature < 0.0:
            raise bad("temperature", "non-negative", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "-1 (disabled), 0 (disabled) or a positive integer", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]", self.min_p)
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", "greater than 0", self.repetition_penalty)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1", self.max_tokens)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}, max_tokens={self.max_tokens}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "a non-negative integer", self.logprobs)
        if any(not isinstance(s, str) or s == "" for s in self._stop_list):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        for token_id, bias in (self.logit_bias or {}).items():
            if not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token_id!r}")
            if not -100.0 <= float(bias) <= 100.0:
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
