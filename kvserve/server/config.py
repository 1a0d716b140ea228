"""ServerConfig: the HTTP server's own flags (the engine's are EngineArgs); the CLI is generated from it.

The limits here bound what one client can make the server do; each is answered with a clear 4xx
naming the flag (see docs/SERVER.md, "Limits").
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from kvserve import envs
from kvserve.server import tool_parsers
from kvserve.utils.cli_args import add_dataclass_args, dataclass_from_args
from kvserve.utils.sizes import parse_size

# --max-body-size auto: this many bytes per token of max_model_len, and never less than _MIN_AUTO_BODY.
# A token of text is a few bytes; JSON escaping (\uXXXX) can make one character six bytes.
_AUTO_BODY_BYTES_PER_TOKEN = 64
_MIN_AUTO_BODY = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    """Everything `kvserve serve` needs besides the engine arguments."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "TCP port; 0 picks a free one (printed at start-up)"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "the model name clients send and /v1/models lists; default: the --model argument"})
    api_key: tuple[str, ...] | None = field(default=None, metadata={
        "help": "require `Authorization: Bearer KEY` (or `x-api-key: KEY`) with one of these keys on every "
                "endpoint except /health and /version (and /metrics, unless --require-api-key-for-metrics); "
                "default: the KVSERVE_API_KEY environment variable, if set"})
    require_api_key_for_metrics: bool = field(default=False, metadata={
        "help": "with --api-key, /metrics needs a key too"})
    enable_debug_endpoints: bool = field(default=False, metadata={
        "help": "serve /debug/prefix-cache, /debug/prefix-cache/explain and /debug/prefix-cache/report (they "
                "show snippets of other clients' prompts)"})
    prefix_report_interval: float = field(default=300.0, metadata={
        "help": "seconds between log lines of the prefix-cache report (requests whose shared prefix a varying "
                "date or id cuts short: GET /debug/prefix-cache/report); the varying text itself is logged only "
                "with --log-requests; 0: off (the report then needs --enable-debug-endpoints)"})
    log_requests: bool = field(default=False, metadata={
        "help": "log each request's prompt, parameters and output text (never logged otherwise)"})
    trust_request_chat_template: bool = field(default=False, metadata={
        "help": "let requests send their own Jinja chat template (chat_template, chat_template_kwargs)"})
    max_queue_len: int = field(default=256, metadata={
        "help": "most sequences waiting beyond --max-num-seqs running; past it requests get HTTP 429"})
    max_body_size: str = field(default="auto", metadata={
        "help": "largest request body (e.g. 1MiB), or auto: 64 bytes per token of max_model_len, at least "
                "1MiB; larger bodies get HTTP 413"})
    max_n: int = field(default=32, metadata={
        "help": "largest n (samples per prompt) a request may ask for; also bounded by what the engine can "
                "ever hold (max-num-seqs + max-queue-len)"})
    max_tokens_limit: int | None = field(default=None, metadata={
        "help": "largest max_tokens a request may ask for; default: whatever fits max_model_len"})
    max_stop_strings: int = field(default=16, metadata={"help": "most stop strings in one request"})
    max_stop_string_length: int = field(default=256, metadata={"help": "longest stop string, in characters"})
    max_messages: int = field(default=1024, metadata={"help": "most messages in one chat request"})
    max_logit_bias: int = field(default=1024, metadata={"help": "most logit_bias entries in one request"})
    request_timeout: float = field(default=600.0, metadata={
        "help": "seconds a request may take from arrival to its last token before it is aborted "
                "(HTTP 408, or an error event in a stream); 0 disables the deadline"})
    shutdown_timeout: float = field(default=30.0, metadata={
        "help": "seconds in-flight requests may take to finish after SIGTERM; then they are aborted and "
                "open streams end with an error event"})
    stats_interval: float = field(default=5.0, metadata={
        "help": "seconds between stats log lines while requests are in flight; 0 disables them"})
    lora_modules: tuple[str, ...] | None = field(default=None, metadata={
        "help": "LoRA adapters served at start-up, name=path ... (needs --enable-lora); a request's `model` "
                "names one"})
    allowed_lora_dirs: tuple[str, ...] | None = field(default=None, metadata={
        "help": "folders adapters may be loaded from (--lora-modules and POST /v1/load_lora_adapter); "
                "default: anywhere"})
    engine_loop: str = field(default="process", metadata={
        "help": "where the engine steps: its own process (see docs/SERVER.md for why) or a thread of the "
                "server process", "choices": ("process", "thread")})
    access_log: bool = field(default=True, metadata={"help": "log one line per HTTP request"})
    enable_auto_tool_choice: bool = field(default=True, metadata={
        "help": "let the model decide whether to call tools (tool_choice auto, the default when a request has "
                "tools), read by --tool-call-parser; vLLM's flag, on by default here"})
    tool_call_parser: str = field(default=tool_parsers.AUTO, metadata={
        "help": "how tool calls are read from the model's output: auto (from the chat template: smollm2 for "
                "SmolLM2, hermes for templates with <tool_call>), hermes or smollm2",
        "choices": (tool_parsers.AUTO, *tool_parsers.PARSER_NAMES)})

    def __post_init__(self) -> None:
        def at_least(name: str, low: float) -> None:
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")

        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_queue_len", "shutdown_timeout", "stats_interval", "request_timeout",
                     "prefix_report_interval"):
            at_least(name, 0)
        for name in ("max_n", "max_tokens_limit", "max_stop_string_length", "max_messages"):
            at_least(name, 1)
        for name in ("max_stop_strings", "max_logit_bias"):
            at_least(name, 0)
        if self.max_body_size != "auto" and parse_size(self.max_body_size) < 1:
            raise ValueError(f"max_body_size must be at least 1 byte, got {self.max_body_size!r}")
        if self.engine_loop not in ("process", "thread"):
            raise ValueError(f"engine_loop must be process or thread, got {self.engine_loop!r}")
        if self.api_key is not None and (not self.api_key or not all(self.api_key)):
            raise ValueError("api_key must not be empty")
        if self.tool_call_parser != tool_parsers.AUTO:
            tool_parsers.get_tool_parser(self.tool_call_parser)  # ValueError naming the known parsers

    def body_limit(self, max_model_len: int) -> int:
        """--max-body-size in bytes (auto: derived from max_model_len)."""
        if self.max_body_size == "auto":
            return max(_MIN_AUTO_BODY, _AUTO_BODY_BYTES_PER_TOKEN * max_model_len)
        return parse_size(self.max_body_size)

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The accepted keys: --api-key, else KVSERVE_API_KEY; empty = no authentication."""
        return self.api_key or envs.api_keys()

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_args(cls, parser)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "ServerConfig":
        return dataclass_from_args(cls, args)
