"""ServerConfig: the HTTP server's own flags (the engine's are EngineArgs); the CLI is generated from it."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from kvserve.utils.cli_args import add_dataclass_args, dataclass_from_args
from kvserve.utils.sizes import parse_size


@dataclass(frozen=True)
class ServerConfig:
    """Everything `kvserve serve` needs besides the engine arguments."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "TCP port; 0 picks a free one (printed at start-up)"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "the model name clients send and /v1/models lists; default: the --model argument"})
    api_key: str | None = field(default=None, metadata={
        "help": "require `Authorization: Bearer KEY` on every endpoint except /health, /metrics, /version"})
    max_queue_len: int = field(default=256, metadata={
        "help": "most sequences waiting beyond --max-num-seqs running; past it requests get HTTP 429"})
    max_body_size: str = field(default="16MiB", metadata={
        "help": "largest request body (e.g. 1MiB); larger bodies get HTTP 413"})
    shutdown_timeout: float = field(default=30.0, metadata={
        "help": "seconds in-flight requests may take to finish after SIGTERM before they are aborted"})
    stats_interval: float = field(default=5.0, metadata={
        "help": "seconds between stats log lines while requests are in flight; 0 disables them"})
    engine_loop: str = field(default="process", metadata={
        "help": "where the engine steps: its own process (default; see docs/SERVER.md for why) or a thread "
                "of the server process", "choices": ("process", "thread")})
    access_log: bool = field(default=True, metadata={"help": "log one line per HTTP request"})

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {self.max_queue_len}")
        if self.max_body_size_bytes < 1:
            raise ValueError(f"max_body_size must be at least 1 byte, got {self.max_body_size!r}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.stats_interval < 0:
            raise ValueError(f"stats_interval must be >= 0, got {self.stats_interval}")
        if self.engine_loop not in ("process", "thread"):
            raise ValueError(f"engine_loop must be process or thread, got {self.engine_loop!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")

    @property
    def max_body_size_bytes(self) -> int:
        return parse_size(self.max_body_size)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_args(cls, parser)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "ServerConfig":
        return dataclass_from_args(cls, args)
