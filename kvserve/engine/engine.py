"""Engine: add_request / abort_request / step, over scheduler -> model runner -> output processor.

    step():  scheduler.schedule() -> runner.execute() -> scheduler.update() -> output processor

Everything here is single-threaded; the server runs it in a background loop (AsyncEngine).
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

from kvserve.attention.registry import make_backend
from kvserve.config import EngineArgs
from kvserve.engine.output_processor import OutputProcessor
from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.kv_cache.sizing import kv_bytes_per_token
from kvserve.models.cpu_linear import onednn_available, prepack_linears
from kvserve.models.layer_ops import load_fused_layer_ops
from kvserve.models.loader import (ModelSource, build_model, iter_checkpoint_tensors, load_hf_config,
                                   load_tokenizer, load_weights)
from kvserve.models.registry import resolve_architecture
from kvserve.outputs import RequestOutput
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler, SchedulerConfig
from kvserve.worker.model_runner import ModelRunner

logger = logging.getLogger("kvserve")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVCacheLayout:
    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token


def check_token_ids(token_ids, vocab_size: int, what: str) -> None:
    """Raises ValueError naming up to five ids that are not integers in [0, vocab_size).

    NOTE: the one place token ids from outside are checked; past admission every id is trusted."""
    bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} token ids must be integers in [0, {vocab_size}), got {bad[:5]}")


def _wrap_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # NOTE: no native bf16 matmul on the AVX2 CPUs we target (under 1 GFLOP/s): fp32 there.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class Engine:
    def __init__(self, args: EngineArgs):
        self.args = args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        # NOTE: like vLLM, the engine seed seeds torch's default generator, which unseeded requests draw
        # from; seeded requests own their generators and never touch it.
        torch.manual_seed(args.seed)
        source = ModelSource.resolve(args.model)
        self.hf_config = load_hf_config(source)
        self.architecture, _ = resolve_architecture(self.hf_config)
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.max_model_len = self._resolve_max_model_len(args)
        self.tokenizer = load_tokenizer(source)
        self.eos_token_ids = self._eos_token_ids()

        backend = make_backend(args.attention_backend, self.device.type)
        model = build_model(self.hf_config, backend, self.max_model_len, self.dtype, self.device)
        load_weights(model, iter_checkpoint_tensors(source, self.dtype))
        model.eval()
        if self.device.type == "cpu" and self.dtype == torch.float32:
            if onednn_available():
                model.untie_lm_head()
                prepack_linears(model)
            if args.attention_backend != "torch_sdpa":  # torch_sdpa: the all-PyTorch path, for comparison
                model.ops = load_fused_layer_ops() or model.ops

        self.kv_layout = self._size_kv_cache(args)
        self.runner = ModelRunner(model, backend, self.kv_layout.num_blocks, args.block_size, self.dtype,
                                  self.device)
        self.block_pool = BlockPool(self.kv_layout.num_blocks)
        kv_manager = KVCacheManager(self.block_pool, args.block_size, args.enable_prefix_caching,
                                    max_pinned_blocks=int(self.kv_layout.num_blocks * args.max_pinned_fraction))
        batched = args.max_num_batched_tokens
        if not args.enable_chunked_prefill:
            batched = max(batched, self.max_model_len)  # a whole prompt must fit one step
        self.scheduler = Scheduler(SchedulerConfig(args.max_num_seqs, batched, self.max_model_len,
                                                   args.enable_chunked_prefill, args.scheduling_policy,
                                                   args.long_prefill_token_threshold),
                                   kv_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._aborted: list[Request] = []
        self.model_name = args.model or "SmolLM2-135M-Instruct"
        self._log_kv_cache()

    @staticmethod
    def freeze_gc() -> None:
        """For a process that keeps one engine for its lifetime (a server, a benchmark): what loading made
        (the tokenizer's vocabulary, config and module objects) lives as long as the engine; frozen, the
        cyclic GC stops re-scanning it at every full collection, which otherwise shows up as pauses in the
        middle of decode steps (a py-spy profile of `mixed` had 1-3% of samples in gc_collect). Not done by
        the constructor: a process that builds many engines (tests) would never collect the old ones."""
        gc.collect()
        gc.freeze()

    # ---- set-up helpers -----------------------------------------------------------------------
    def _resolve_max_model_len(self, args: EngineArgs) -> int:
        limit = int(getattr(self.hf_config, "max_position_embeddings", 0) or 2048)
        window = getattr(self.hf_config, "sliding_window", None)
        if window and getattr(self.hf_config, "use_sliding_window", True):
            # NOTE: sliding-window attention is not implemented; within the window it equals full attention.
            limit = min(limit, int(window))
        if args.max_model_len is None:
            return limit
        if args.max_model_len > limit:
            raise ValueError(f"max_model_len {args.max_model_len} exceeds the model's limit of {limit} tokens")
        return args.max_model_len

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = getattr(self.hf_config, "eos_token_id", None)
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(ids)

    def _size_kv_cache(self, args: EngineArgs) -> KVCacheLayout:
        per_token = kv_bytes_per_token(self.hf_config, torch.empty((), dtype=self.dtype).element_size())
        per_block = per_token * args.block_size
        if args.num_gpu_blocks_override is not None:
            num_blocks = args.num_gpu_blocks_override
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - args.gpu_memory_utilization) * total
            num_blocks = int(budget // per_block)
        else:
            num_blocks = args.kv_cache_memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"the KV-cache budget holds no block of {per_block} bytes; raise --kv-cache-memory "
                             "or --gpu-memory-utilization")
        return KVCacheLayout(num_blocks, args.block_size, per_token)

    def _log_kv_cache(self) -> None:
        c, kv = self.hf_config, self.kv_layout
        elem = torch.empty((), dtype=self.dtype).element_size()
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %d bytes (%.2f GiB); %d bytes/token "
            "= 2 x %d layers x %d kv_heads x %d head_dim x %d B; max concurrency at max_model_len %d: %.2fx",
            kv.num_blocks, kv.block_size, kv.num_tokens, kv.num_bytes, kv.num_bytes / 2**30, kv.bytes_per_token,
            c.num_hidden_layers, c.num_key_value_heads, c.head_dim, elem, self.max_model_len,
            kv.num_tokens / self.max_model_len)

    # ---- requests ---------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Text -> token ids (with the tokenizer's BOS rules); token ids are checked against the vocabulary."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        check_token_ids(prompt, self.hf_config.vocab_size, "prompt")
        return list(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Checks a request fits this engine; returns its resolved max_tokens. Raises ValueError."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty")
        vocab = self.hf_config.vocab_size
        check_token_ids(prompt_token_ids, vocab, "prompt")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, but max_model_len is {self.max_model_len} "
                             "(the prompt plus at least one generated token must fit)")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} tokens "
                             f"exceeds max_model_len ({self.max_model_len})")
        blocks = -(-(n + max_tokens) // self.kv_layout.block_size)
        if blocks > self.kv_layout.num_blocks:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {blocks} KV blocks, but the "
                             f"whole pool has {self.kv_layout.num_blocks} (raise --kv-cache-memory)")
        if params.logprobs is not None and params.logprobs > self.args.max_logprobs:
            raise ValueError(f"logprobs {params.logprobs} exceeds max_logprobs ({self.args.max_logprobs})")
        check_token_ids(params.logit_bias or {}, vocab, "logit_bias")
        check_token_ids(params.stop_token_ids, vocab, "stop_token_ids")
        return max_tokens

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    prompt_text: str | None = None, arrival_time: float | None = None,
                    cache_pin: tuple[int, float] | None = None) -> None:
        """Queue a request (n samples become n child sequences). Raises ValueError if it cannot run.

        cache_pin: (prefix tokens, TTL seconds) — keep the KV of that prefix cached (pinned) for TTL
        seconds after its last use (Anthropic-style prompt caching)."""
        params = params or SamplingParams()
        if request_id in self.scheduler.requests or self.output_processor.group_children(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.tokenize_prompt(prompt)
        max_tokens = self.validate(token_ids, params)
        if prompt_text is None and isinstance(prompt, str):
            prompt_text = prompt
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else _wrap_int64(params.seed + i))
            gen = None if child_params.seed is None else torch.Generator().manual_seed(child_params.seed)
            salt = None
            if params.n > 1 and not self.args.enable_prefix_caching:
                salt = f"n-group:{request_id}"  # share the prompt among the samples only
            child = Request(request_id if params.n == 1 else f"{request_id}#{i}", token_ids, child_params,
                            self.eos_token_ids, max_tokens, cache_salt=salt, generator=gen,
                            cache_pin=cache_pin if i == 0 else None)
            child.timings.arrival = arrival
            children.append(child)
        self.output_processor.add_group(request_id, prompt_text, children)
        for i, child in enumerate(children):
            self.scheduler.add_request(child, wait_for=children[0] if i else None)

    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its samples); its blocks are released now and its final output has
        finish_reason "abort". Unknown or finished ids are ignored."""
        children = self.output_processor.group_children(request_id)
        for child in children:
            req = self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                self._aborted.append(req)

    def explain_prefix(self, prompt: str | list[int], snippet_tokens: int = 8) -> dict:
        """How much of a prompt the prefix cache would serve, and where the closest cached sequence diverges
        (position and a short text snippet on each side), to find what broke a cache hit."""
        token_ids = self.tokenize_prompt(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len ({self.max_model_len})")
        ex = self.scheduler.kv.explain(token_ids)
        pos = ex.num_matched_tokens
        block_start = pos - pos % self.args.block_size
        decode = self.tokenizer.decode
        out = {"num_prompt_tokens": ex.num_prompt_tokens, "num_cached_tokens": ex.num_hit_tokens,
               "num_matched_tokens": pos,
               # None: the prompt is wholly cached, or the cached sequence simply ends at num_matched_tokens
               "diverges_at": pos if pos < len(token_ids) and ex.cached_continuation is not None else None,
               "common_text": decode(token_ids[max(0, pos - snippet_tokens):pos]),
               "prompt_text_after": decode(token_ids[pos:pos + snippet_tokens]), "cached_text_after": None}
        if ex.cached_continuation is not None:
            cached_after = ex.cached_continuation[pos - block_start:]
            out["cached_text_after"] = decode(cached_after[:snippet_tokens])
        return out

    def prefix_cache_stats(self) -> dict:
        pool, stats = self.block_pool, self.scheduler.stats
        counts = pool.counts()
        return {"block_size": self.args.block_size, "total_blocks": pool.num_blocks,
                "cached_blocks": pool.num_cached_blocks,
                "cached_tokens": pool.num_cached_blocks * self.args.block_size,
                "evictable_blocks": counts["cached"], "pinned_blocks": self.scheduler.kv.pins.num_pinned,
                "max_pinned_blocks": self.scheduler.kv.pins.max_blocks,
                "query_tokens": stats.num_prefix_query_tokens, "hit_tokens": stats.num_prefix_hit_tokens,
                "hit_rate": stats.num_prefix_hit_tokens / max(1, stats.num_prefix_query_tokens),
                "evictions": pool.num_evictions}

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._aborted)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration. A failure attributable to one request (its sampling, detokenization or stop
        strings) finishes that request with finish_reason "error" and the step goes on; anything else
        (the forward pass itself) raises: the engine's state is then no longer trusted."""
        sched_out = self.scheduler.schedule()
        runner_out = self.runner.execute(sched_out)
        failed = [self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR, error)
                  for rid, error in runner_out.errors.items()]
        advanced = self.scheduler.update(sched_out, runner_out.sampled_token_ids)
        ended, self._aborted = self._aborted + [r for r in failed if r is not None], []
        return self.output_processor.process(
            advanced, runner_out.logprobs, ended,
            on_stop=lambda r: self.scheduler.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED),
            on_error=self._fail)

    def _fail(self, req: Request, error: str) -> None:
        if self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR, error) is None:
            req.status, req.error = RequestStatus.FINISHED_ERROR, error  # it had finished in this very step
