"""EngineArgs: every engine flag in one frozen dataclass; the CLI and `LLM(**kwargs)` are generated from it.

Flag names follow vLLM's (`--max-num-seqs`, `--max-num-batched-tokens`, `--block-size`, ...) so users can
switch without rereading docs. `create_engine_config()` resolves them into one config per concern
(model, cache, scheduler, parallel, device, load); derived values (pool size) are the worker's.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import kvserve.envs as envs
from kvserve.config.batch_invariance import model_refusal, refusal
from kvserve.config.cache import CacheConfig
from kvserve.config.device import DeviceConfig
from kvserve.config.engine import EngineConfig
from kvserve.config.generation import default_sampling, parse_override
from kvserve.config.kv_transfer import KVTransferConfig
from kvserve.config.kv_events import KVEventsConfig
from kvserve.config.load import LoadConfig
from kvserve.config.lora import LoRAConfig
from kvserve.config.model import ModelConfig
from kvserve.config.parallel import DISTRIBUTED_EXECUTOR_BACKENDS, ParallelConfig
from kvserve.config.quantization import QuantizationConfig
from kvserve.config.scheduler import AUTO, SchedulerConfig, parse_target_itl_ms
from kvserve.config.speculative import SpeculativeConfig
from kvserve.kv_cache.quant import KV_CACHE_DTYPES
from kvserve.kv_cache.reservation import KV_RESERVATIONS
from kvserve.sample.sampler import DEFAULT_LOGPROBS_MODE, LOGPROBS_MODES
from kvserve.utils.cli_args import add_dataclass_args, dataclass_from_args
from kvserve.utils.sizes import parse_size

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# NOTE: on by default: exact, and self-limiting where proposals are poor (`kvserve bench spec`: never slower
# on the shared workloads; docs/features/speculative-decoding.md).
DEFAULT_SPECULATIVE_CONFIG = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                              '"prompt_lookup_max": 5}')
# NOTE: auto: the step limit follows this machine's decode step and the prompts' wait (scheduler/step_target.py);
# the former fixed 150 ms (LEGACY_TARGET_ITL_MS, fitted to the 2-core AVX-512 development machine) starved
# prompts on slower machines (docs/features/latency-budget.md).
DEFAULT_TARGET_ITL_MS = AUTO
LEGACY_TARGET_ITL_MS = 150.0


def _target_itl_arg(text: str) -> float | str:
    try:
        return parse_target_itl_ms(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_ATTENTION_BACKENDS = ("auto", "cpu_paged", "torch_ref", "torch_sdpa", "triton_paged")


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = field(default=None, metadata={
        "help": "Hugging Face folder or .gguf file; default: the built-in SmolLM2-135M-Instruct GGUF"})
    dtype: str = field(default="auto", metadata={
        "help": "weights and KV dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 (on CPU fast "
                "with AVX512_BF16 or AMX, emulated and slow without), float16",
        "choices": _DTYPES})
    device: str = field(default="auto", metadata={
        "help": "auto (the CPU: the CUDA path is not yet tested), cpu or cuda", "choices": ("auto", "cpu", "cuda")})
    attention_backend: str = field(default="auto", metadata={
        "help": "auto (on CPU: the C++ paged decode kernel and fused layer ops when they build; on CUDA: "
                "triton_paged when triton is installed and the KV cache is unquantized), cpu_paged, triton_paged "
                "(Triton kernels, CUDA), or torch_ref (PyTorch only, the reference path; torch_sdpa is its old "
                "name)",
        "choices": _ATTENTION_BACKENDS})
    quantization: str | None = field(default=None, metadata={
        "help": "weight-only quantization of the decoder layers' linear weights (activations float32): int8 "
                "(symmetric, a scale per --quantization-group-size inputs), int4 (group-wise min and scale), gguf "
                "(a GGUF file's Q4_0/Q4_1/Q8_0 blocks as stored); the LM head then runs int8 (see "
                "--quantize-lm-head), the embedding stays full precision; default: none (a quantized GGUF file is "
                "dequantized to --dtype)",
        "choices": ("int8", "int4", "gguf")})
    quantization_group_size: int | None = field(default=None, metadata={
        "help": "int8 / int4: input columns per scale group, 32, 64 or 128 (must divide every layer's input "
                "size: the built-in SmolLM2's 576 takes 32 or 64), or -1 for one scale per output channel "
                "(int8 only); default: 32 for int8, 128 for int4"})
    quantize_lm_head: bool = field(default=True, metadata={
        "help": "with --quantization, run the LM head in int8 with a scale per 32 inputs (GGUF's Q8_0; it is "
                "read every decode step); --no-quantize-lm-head keeps it in --dtype"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV-cache block"})
    kv_cache_memory: str = field(default="2GiB", metadata={
        "help": "KV-cache pool size on CPU, e.g. 2GiB or 512MiB"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "KV-cache element type: auto (the model's dtype), int8 or fp8_e4m3 (fp8: vLLM's alias; one byte per element "
                "plus a bfloat16 scale per block and KV head for K and for V: ~4x the tokens of a float32 "
                "cache in the same --kv-cache-memory)",
        "choices": KV_CACHE_DTYPES})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "fraction of GPU memory for weights + activations + KV cache (CUDA only)"})
    num_gpu_blocks_override: int | None = field(default=None, metadata={
        "help": "use exactly this many KV blocks (tests, experiments); overrides the memory budget; default: "
                "sized from --kv-cache-memory (CPU) or --gpu-memory-utilization (CUDA)"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest prompt + output in tokens; default: the model's max_position_embeddings"})
    max_num_seqs: int = field(default=256, metadata={"help": "most requests running in one step"})
    max_num_batched_tokens: int = field(default=512, metadata={
        "help": "most tokens (prefill chunks + decodes) in one forward pass"})
    long_prefill_token_threshold: int = field(default=0, metadata={
        "help": "while other requests decode, compute at most this many prompt tokens of one request per "
                "step, to bound their inter-token latency (0: no cap)"})
    target_itl_ms: float | str = field(default=DEFAULT_TARGET_ITL_MS, metadata={
        "help": "latency-aware step budget: in a step that also decodes, size prompt chunks so the step's "
                "predicted time (a cost model fitted online to measured steps) stays within this many ms, or "
                "twice the decodes' own time where that is longer; auto: a prompt that fits one step is "
                "computed whole, a longer one in chunks whose steps take at most 2.2x the decode-only step, "
                "more once it has waited 3x its own time; prompt-only steps still take the whole "
                "--max-num-batched-tokens (0: off, the fixed token budget alone)",
        "type": _target_itl_arg})
    enable_chunked_prefill: bool = field(default=True, metadata={
        "help": "split long prompts over several steps so decodes keep flowing"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV blocks of prompt prefixes already computed"})
    scheduling_policy: str = field(default="fcfs", metadata={
        "help": "fcfs, or lpm: admit the waiting request with the longest cached prefix first (bounded wait)",
        "choices": ("fcfs", "lpm")})
    static_batching: bool = field(default=False, metadata={
        "help": "static batching: admit a batch together and admit nothing more until its last request ends "
                "(the pre-Orca baseline; offline jobs of equal lengths); default: continuous batching"})
    kv_reservation: str = field(default="paged", metadata={
        "help": "paged: a request holds blocks as it grows (PagedAttention); contiguous: a request is admitted "
                "only when --max-model-len tokens of blocks can be set aside for it, as engines did before "
                "PagedAttention (same outputs, fewer requests at once)",
        "choices": KV_RESERVATIONS})
    max_pinned_fraction: float = field(default=0.5, metadata={
        "help": "most of the KV pool that prompt-cache pins (cache_control) may hold; past it, new pins "
                "are not made and requests still run"})
    max_logprobs: int = field(default=20, metadata={"help": "largest logprobs a request may ask for"})
    logprobs_mode: str = field(default=DEFAULT_LOGPROBS_MODE, metadata={
        "help": "what `logprobs` report (vLLM's flag): raw_logprobs / raw_logits: the model's own output, before "
                "penalties, logit_bias, grammars and temperature; processed_logprobs / processed_logits: the "
                "values the token was chosen from (after those, and top_k/top_p/min_p), so at temperature 0 the "
                "chosen token is the top-1; default processed_logprobs (vLLM's is raw_logprobs); prompt "
                "logprobs are always raw",
        "choices": LOGPROBS_MODES})
    speculative_config: str | dict | None = field(default=DEFAULT_SPECULATIVE_CONFIG, metadata={
        "help": "speculative decoding, a JSON object as in vLLM's flag: {\"method\": \"ngram\" | \"draft_model\", "
                "\"num_speculative_tokens\": K, \"prompt_lookup_min\": .., \"prompt_lookup_max\": .., "
                "\"model\": draft path}; the draft length adapts per request and step (down to none) unless "
                "\"adaptive\": false; none: off"})
    enable_lora: bool = field(default=False, metadata={
        "help": "serve PEFT LoRA adapters (a request names one with a LoRARequest); off: the base model only"})
    max_loras: int = field(default=1, metadata={
        "help": "LoRA adapters resident at once: the most distinct adapters in one step"})
    max_lora_rank: int = field(default=16, metadata={"help": "largest LoRA rank an adapter may have"})
    max_cpu_loras: int | None = field(default=None, metadata={
        "help": "LoRA adapters kept loaded in host memory (LRU); default: max_loras"})
    generation_config: str = field(default="auto", metadata={
        "help": "default sampling parameters for what a request leaves unset: auto (the model's "
                "generation_config.json; the built-in model's own defaults), vllm (none: the API's defaults) "
                "or a folder / generation_config.json path"})
    override_generation_config: str | dict | None = field(default=None, metadata={
        "help": "JSON object overriding those defaults, e.g. '{\"temperature\": 0.5, \"max_new_tokens\": 128}'; "
                "default: no overrides"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "CUDA: run every step eagerly (no CUDA graphs for decode-only steps); no effect on CPU"})
    batch_invariant: bool = field(default=False, metadata={
        "help": "batch-invariant mode: a request's logits are bit-identical whatever else shares its steps, "
                "however its prompt is chunked, with prefix-cache hits, preemption or speculative decoding "
                "(fixed-order matmul and attention kernels; slower); VLLM_BATCH_INVARIANT=1 or "
                "KVSERVE_BATCH_INVARIANT=1 also turn it on; refuses quantization, a quantized KV cache, "
                "tensor parallelism, LoRA and MoE/MLA models (docs/features/batch-invariance.md)"})
    load_format: str = field(default="auto", metadata={
        "help": "auto: the checkpoint's weights; dummy: random weights of the model's real shapes from its "
                "config.json alone (no download; a folder without a tokenizer takes prompts as token ids; "
                "configs of real models: kvserve/models/configs/)",
        "choices": ("auto", "dummy")})
    seed: int = field(default=0, metadata={"help": "seed of the engine's own generator (unseeded requests)"})
    # ---- tensor parallelism (docs/PARALLELISM.md) ----
    tensor_parallel_size: int = field(default=1, metadata={
        "aliases": ("-tp",),
        "help": "ranks to shard the model over (Megatron-style; must divide the attention heads): each rank holds "
                "its shard of the weights and of the KV cache; gloo on CPU, NCCL on CUDA"})
    distributed_executor_backend: str = field(default="mp", metadata={
        "help": "how the ranks start: mp (worker processes on this machine), ray (Ray actors, on this machine "
                "or a Ray cluster's nodes, and with --data-parallel-size each engine too; needs kvserve[ray]) or "
                "external_launcher (every rank started by "
                "torchrun, on one host or several)",
        "choices": DISTRIBUTED_EXECUTOR_BACKENDS})
    data_parallel_size: int = field(default=1, metadata={
        "aliases": ("-dp",),
        "help": "`kvserve serve`: engine cores, each its own process with its own KV cache and a full copy of the "
                "weights (x tensor_parallel_size processes each), behind one API server that balances requests "
                "by load and prefix (docs/SCALING.md); each engine gets --num-threads / N threads (default: the "
                "machine's cores / N). The offline LLM runs one engine"})
    data_parallel_balance_abs_threshold: float = field(default=4.0, metadata={
        "help": "--data-parallel-size: a request keeps its prefix's engine unless that engine's load (requests in "
                "flight, plus waiting prompt tokens in steps of --max-num-batched-tokens) is more than this above "
                "the least loaded engine's ..."})
    data_parallel_balance_rel_threshold: float = field(default=1.5, metadata={
        "help": "... and more than this many times it; past both, the least loaded engine gets the request"})
    num_threads: int | None = field(default=None, metadata={
        "help": "torch intra-op threads on CPU; default: torch's own choice (with --data-parallel-size N: the "
                "total, split evenly over the N engines)"})
    # ---- KV transfer (docs/features/kv-connectors.md) ----
    kv_transfer_config: str | dict | None = field(default=None, metadata={
        "help": "a KV connector, vLLM's JSON: {\"kv_connector\": \"SharedStorageConnector\" | \"ExampleConnector\" | "
                "\"OffloadingConnector\" | \"MultiConnector\", \"kv_role\": \"kv_producer\" | \"kv_consumer\" | "
                "\"kv_both\", \"kv_connector_extra_config\": {...}, \"kv_load_failure_policy\": \"recompute\" | "
                "\"fail\", \"kv_connector_module_path\": .., \"kv_rank\", \"kv_parallel_size\", \"kv_ip\", "
                "\"kv_port\", \"engine_id\": ..}; unknown keys are an error; default: none"})
    kv_events_config: str | dict | None = field(default=None, metadata={
        "help": "KV events (what enters and leaves the prefix cache, for a cache-aware router), a JSON object "
                "as in vLLM's flag: {\"enable_kv_cache_events\": true, \"publisher\": \"http\" | \"zmq\" | "
                "\"null\", \"buffer_steps\": N, ...}; served at GET /kv_events (\"zmq\" too: docs/SCALING.md); "
                "default: off"})

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        # NOTE: the configs that need no checkpoint validate themselves now, so a bad flag fails at once.
        SpeculativeConfig.parse(self.speculative_config)
        parse_override(self.override_generation_config)
        KVTransferConfig.parse(self.kv_transfer_config)
        KVEventsConfig.parse(self.kv_events_config)
        self._cache_config()
        self._scheduler_config(max_model_len=self.max_model_len or 1)
        self._lora_config()
        self._quantization_config()
        LoadConfig(self.load_format)
        if self.load_format == "dummy" and self.quantization == "gguf":
            raise ValueError("quantization gguf keeps a GGUF file's blocks as stored: it cannot use random "
                             "(--load-format dummy) weights")
        self._parallel_config()
        if self.data_parallel_balance_abs_threshold < 0 or self.data_parallel_balance_rel_threshold < 1:
            raise ValueError("data_parallel_balance_abs_threshold must be >= 0 and data_parallel_balance_rel_threshold "
                             f">= 1, got {self.data_parallel_balance_abs_threshold} and "
                             f"{self.data_parallel_balance_rel_threshold}")
        if self.invariant:
            why = refusal(quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype,
                          tensor_parallel_size=self.tensor_parallel_size, enable_lora=self.enable_lora,
                          attention_backend=self.attention_backend)
            if why is not None:
                raise ValueError(f"--batch-invariant cannot be kept with {why}")

    @property
    def invariant(self) -> bool:
        """--batch-invariant, or the environment's VLLM_BATCH_INVARIANT=1 / KVSERVE_BATCH_INVARIANT=1."""
        return self.batch_invariant or envs.batch_invariant()

    def _parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend,
                              data_parallel_size=self.data_parallel_size)

    def _quantization_config(self) -> QuantizationConfig:
        return QuantizationConfig(self.quantization, self.quantization_group_size, self.quantize_lm_head)

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def _cache_config(self) -> CacheConfig:
        return CacheConfig(self.block_size, self.kv_cache_memory_bytes, self.gpu_memory_utilization,
                           self.num_gpu_blocks_override, self.enable_prefix_caching, self.max_pinned_fraction,
                           self.kv_cache_dtype, self.kv_reservation)

    def _scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        batched = self.max_num_batched_tokens
        if not self.enable_chunked_prefill:
            batched = max(batched, max_model_len)  # a whole prompt must fit one step
        return SchedulerConfig(self.max_num_seqs, batched, max_model_len, self.enable_chunked_prefill,
                               self.scheduling_policy, self.long_prefill_token_threshold, self.target_itl_ms,
                               self.static_batching)

    def default_sampling(self) -> dict:
        """SamplingParams defaults for the fields a request leaves unset (see config/generation.py)."""
        return default_sampling(self.generation_config, self.model, self.override_generation_config)

    @property
    def kv_cache_memory_bytes(self) -> int:
        return parse_size(self.kv_cache_memory)

    def create_engine_config(self) -> EngineConfig:
        """Resolve the flags into one config per concern (reads the model's config file, not its weights)."""
        if self.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size {self.data_parallel_size}: one engine core runs one copy of the "
                             "model; N engine cores run behind `kvserve serve --data-parallel-size N` (or start "
                             "one LLM per process)")
        device = DeviceConfig(DeviceConfig.resolve_device(self.device), self.attention_backend, self.num_threads,
                              self.enforce_eager, self.invariant)
        model = ModelConfig.resolve(self.model, self.dtype, device.device, self.max_model_len, self.max_logprobs,
                                    logprobs_mode=self.logprobs_mode)
        why = model_refusal(model.hf_config) if self.invariant else None
        if why is not None:
            raise ValueError(f"--batch-invariant cannot be kept with {why}")
        quantization = self._quantization_config()
        quantization.check_source(model.source)
        speculative = SpeculativeConfig.parse(self.speculative_config)
        draft = None
        if speculative is not None and speculative.method == "draft_model":
            draft = ModelConfig.resolve(speculative.model, self.dtype, device.device, None, 0)
            if draft.vocab_size != model.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from the "
                                 f"target's ({model.vocab_size}): a draft must share the target's tokenizer")
            if draft.max_model_len < model.max_model_len:
                raise ValueError(f"the draft model holds {draft.max_model_len} positions, fewer than the target's "
                                 f"max_model_len {model.max_model_len}; lower --max-model-len")
            draft = dataclasses.replace(draft, max_model_len=model.max_model_len)
        parallel = self._parallel_config()
        parallel.check_model(model.hf_config)
        return EngineConfig(
            model=model,
            cache=self._cache_config(),
            scheduler=self._scheduler_config(model.max_model_len),
            parallel=parallel,
            device=device,
            load=LoadConfig(self.load_format),
            speculative=speculative,
            draft_model=draft,
            lora=self._lora_config(),
            quantization=quantization,
            seed=self.seed,
            kv_transfer=KVTransferConfig.parse(self.kv_transfer_config),
            kv_events=KVEventsConfig.parse(self.kv_events_config))

    # ---- CLI generation -------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
        add_dataclass_args(cls, parser, exclude)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "EngineArgs":
        return dataclass_from_args(cls, args)

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> "EngineArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(model=model, **kwargs)
