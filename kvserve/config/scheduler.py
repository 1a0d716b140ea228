"""SchedulerConfig: how many requests and tokens one step may carry, and in which order requests run."""
from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "lpm")


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
    target_itl_ms: float = 0.0
    """In a step that also decodes, prompt chunks are sized so the step's predicted time stays within this
    (scheduler/step_cost.py); 0: off, the token budget alone (EngineArgs turns it on by default)."""
    static_batching: bool = False
    """Admit a batch together and run it until its last request ends (scheduler/static_batch.py)."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if not self.target_itl_ms >= 0:
            raise ValueError(f"target_itl_ms must be >= 0, got {self.target_itl_ms}")
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
