"""SchedulerConfig: how many requests and tokens one step may carry, and in which order requests run."""
from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "lpm")
AUTO = "auto"
"""--target-itl-ms auto: the step limit follows the machine's decode step and the queue (scheduler/step_target.py)."""


def parse_target_itl_ms(value: object) -> float | str:
    """--target-itl-ms as given: `auto`, or milliseconds >= 0 (0: off). A ValueError names the flag."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == AUTO:
            return AUTO
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"--target-itl-ms must be 'auto' or milliseconds >= 0, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"--target-itl-ms must be 'auto' or milliseconds >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    """Most requests running in one step."""
    max_num_batched_tokens: int
    """Most tokens (prompt chunks + decodes) in one forward pass."""
    max_model_len: int
    """Longest prompt + output."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps; without it a whole prompt must fit one step."""
    policy: str = "fcfs"
    """fcfs, or lpm: longest cached prefix first (bounded: see WaitingOrder)."""
    long_prefill_token_threshold: int = 0
    """In a step that also decodes, no request computes more than this many prompt tokens (0: no cap)."""
    target_itl_ms: float | str = 0.0
    """In a step that also decodes, prompt chunks are sized so the step's predicted time stays within this
    many ms, or `auto`: a limit relative to the decode step that grows with the prompts waiting
    (scheduler/step_target.py); 0: off, the token budget alone (EngineArgs defaults to auto)."""
    static_batching: bool = False
    """Admit a batch together and run it until its last request ends (scheduler/static_batch.py)."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        object.__setattr__(self, "target_itl_ms", parse_target_itl_ms(self.target_itl_ms))
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
