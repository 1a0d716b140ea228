"""SpeculativeConfig: vLLM's `--speculative-config` / `LLM(speculative_config={...})`, same keys.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "/path/to/small-model", "num_speculative_tokens": 4}

`adaptive` (ours, default on) lets the engine choose each request's draft length every step, down to 0,
from its acceptance and the measured cost of scoring tokens (spec_decode/policy.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.config.json_flag import json_object

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4
    """Most draft tokens per request per step (K)."""
    prompt_lookup_min: int = 2
    """ngram: shortest suffix to look up."""
    prompt_lookup_max: int = 5
    """ngram: longest suffix to look up (tried first)."""
    model: str | None = None
    """draft_model: Hugging Face folder or .gguf file with the target's vocabulary."""
    adaptive: bool = True
    """Choose each request's draft length per step (0 = no speculation) to maximise tokens per second;
    False: always propose num_speculative_tokens."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer in [1, 16], "
                             f"got {self.num_speculative_tokens!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 64):
                raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, "
                                 f"got {lo!r} and {hi!r}")
            if self.model is not None:
                raise ValueError("speculative_config.model is for method 'draft_model', not 'ngram'")
        elif not self.model:
            raise ValueError("speculative_config.method 'draft_model' needs a 'model' (a folder or .gguf file)")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """From a dict (LLM kwargs), a JSON object string (the CLI flag) or None / "" / "none" (off)."""
        if isinstance(value, cls):
            return value
        value = json_object(value, cls, "speculative_config")
        if value is None:
            return None
        if "method" not in value:
            raise ValueError(f"speculative_config needs a 'method': one of {', '.join(METHODS)}")
        return cls(**value)
