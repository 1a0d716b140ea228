"""RouterConfig: `kvserve router` flags, named as sglang-router's (cache-aware and health parameters, same
defaults for the cache-aware ones) and `--host`/`--port` as on `kvserve serve`."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from kvserve.router.policies import POLICIES, BalanceRule
from kvserve.router.workers import HealthConfig
from kvserve.utils.cli_args import add_dataclass_args, dataclass_from_args


def _field_help(cls, name: str) -> str:
    return next(f.metadata["help"] for f in fields(cls) if f.name == name)


def _instance_url(flag: str, url: str) -> str:
    if url.isdigit():
        raise ValueError(f"{flag} takes URLs, got {url!r}: sglang-router's bootstrap port has no use here (the KV "
                         "moves through the instances' --kv-transfer-config connector)")
    # NOTE: vLLM's disaggregated proxy example takes host:port; a URL needs its scheme here.
    return url if "://" in url else f"http://{url}"


@dataclass(frozen=True)
class RouterConfig:
    worker: tuple[str, ...] | None = field(default=None, metadata={
        "help": "a worker's base URL, e.g. http://10.0.0.5:8000 (repeat the flag for each worker)"})
    pd_disaggregation: bool = field(default=False, metadata={
        "help": "front disaggregated prefill and decode pools (--prefill, --decode) instead of --worker replicas: "
                "each request is prefilled on a prefill instance, then decoded on a decode instance that loads "
                "its KV (vLLM's flow; `kvserve proxy` is the same)"})
    prefill: tuple[str, ...] | None = field(default=None, metadata={
        "help": "a prefill instance's base URL (`kvserve serve --kv-transfer-config` with kv_role kv_producer or "
                "kv_both); repeat the flag for each"})
    decode: tuple[str, ...] | None = field(default=None, metadata={
        "help": "a decode instance's base URL (kv_role kv_consumer or kv_both); repeat the flag for each"})
    prefill_policy: str | None = field(default=None, metadata={
        "help": "--pd-disaggregation: the prefill pool's policy; default: --policy", "choices": POLICIES})
    decode_policy: str | None = field(default=None, metadata={
        "help": "--pd-disaggregation: the decode pool's policy; default: --policy", "choices": POLICIES})
    policy: str = field(default="cache_aware", metadata={
        "help": "round_robin, power_of_two (the less loaded of two at random), cache_aware (SGLang's: longest "
                "prefix of the templated prompt among what each worker was sent) or precise (the workers' own "
                "cached blocks, from their KV events: start them with --kv-events-config "
                "'{\"enable_kv_cache_events\": true}')",
        "choices": POLICIES})
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "TCP port; 0 picks a free one (printed at start-up)"})
    cache_threshold: float = field(default=0.3, metadata={
        "help": "cache_aware: route to the best-matching worker when its match covers at least this fraction of "
                "the prompt's text; else to the least loaded"})
    balance_abs_threshold: int = field(default=64, metadata={
        "help": "loads are imbalanced when max - min exceeds this many in-flight requests (and the relative "
                "threshold holds): the least loaded worker then gets the request"})
    balance_rel_threshold: float = field(default=1.5, metadata={
        "help": "... and max > min x this factor"})
    eviction_interval_secs: float = field(default=120.0, metadata={
        "help": "cache_aware: how often the router prunes its prefix trees to --max-tree-size"})
    max_tree_size: int = field(default=2 ** 26, metadata={
        "help": "cache_aware: characters each worker's prefix tree keeps (least recently used leaves go first)"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "the workers' tokenizer (model folder or .gguf) to template and tokenize prompts with; default: "
                "the model the first worker reports at /v1/models (when it is a path on this machine)"})
    health_check_interval_secs: float = field(default=5.0, metadata={
        "help": "how often each worker's /health is polled"})
    health_check_timeout_secs: float = field(default=5.0, metadata={"help": "one /health poll's timeout"})
    health_failure_threshold: int = field(default=3, metadata={
        "help": "failed polls in a row that take a worker out of rotation (a refused connection on dispatch "
                "takes it out at once)"})
    health_success_threshold: int = field(default=2, metadata={
        "help": "good polls in a row that bring a worker back"})
    api_key: str | None = field(default=None, metadata={
        "help": "the workers' --api-key, for the router's own calls (/kv_events, /v1/models); clients' requests "
                "are forwarded with their own Authorization header"})
    request_timeout_secs: float = field(default=1800.0, metadata={
        "help": "longest wait for a worker's answer (or for its stream's next chunk)"})

    def __post_init__(self) -> None:
        self._check_pools()
        for name in ("policy", "prefill_policy", "decode_policy"):
            value = getattr(self, name)
            if value not in POLICIES and (value is not None or name == "policy"):
                raise ValueError(f"--{name.replace('_', '-')} must be one of {', '.join(POLICIES)}, got {value!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"--cache-threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("--balance-abs-threshold must be >= 0 and --balance-rel-threshold >= 1")
        if not self.eviction_interval_secs > 0 or self.max_tree_size < 1:
            raise ValueError("--eviction-interval-secs must be > 0 and --max-tree-size >= 1")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not self.request_timeout_secs > 0:
            raise ValueError("--request-timeout-secs must be > 0")
        self.health_config()

    def _check_pools(self) -> None:
        if self.pd_disaggregation:
            if self.worker:
                raise ValueError("--worker is not used with --pd-disaggregation: give --prefill and --decode URLs")
            if not self.prefill or not self.decode:
                raise ValueError("disaggregated serving needs at least one --prefill and one --decode URL")
            object.__setattr__(self, "prefill", tuple(_instance_url("--prefill", u) for u in self.prefill))
            object.__setattr__(self, "decode", tuple(_instance_url("--decode", u) for u in self.decode))
        elif self.prefill or self.decode:
            raise ValueError("--prefill and --decode need --pd-disaggregation (or `kvserve proxy`)")
        elif not self.worker:
            raise ValueError("give at least one --worker URL")
        for flag, urls in (("--worker", self.worker), ("--prefill", self.prefill), ("--decode", self.decode)):
            for url in urls or ():
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"{flag} must be an http(s):// URL, got {url!r}")

    def pools(self) -> list[tuple[str, tuple[str, ...], str]]:
        """(role, URLs, policy) of each pool: one of workers, or (--pd-disaggregation) prefill and decode."""
        if not self.pd_disaggregation:
            return [("worker", self.worker, self.policy)]
        return [("prefill", self.prefill, self.prefill_policy or self.policy),
                ("decode", self.decode, self.decode_policy or self.policy)]

    def worker_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def balance(self) -> BalanceRule:
        return BalanceRule(self.balance_abs_threshold, self.balance_rel_threshold)

    def health_config(self) -> HealthConfig:
        return HealthConfig(self.health_check_interval_secs, self.health_check_timeout_secs,
                            self.health_failure_threshold, self.health_success_threshold)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, proxy: bool = False) -> None:
        """proxy: `kvserve proxy`'s flags (disaggregated pools only, round robin by default)."""
        if proxy:
            add_dataclass_args(cls, parser, exclude=("worker", "pd_disaggregation"))
            parser.set_defaults(pd_disaggregation=True, policy="round_robin")
            return
        # NOTE: --worker-urls is sglang-router's and vllm-router's name for the same list.
        parser.add_argument("--worker", "--worker-urls", dest="worker", nargs="+", action="extend", default=None,
                            help=_field_help(cls, "worker"))
        add_dataclass_args(cls, parser, exclude=("worker",))

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "RouterConfig":
        return dataclass_from_args(cls, args)
