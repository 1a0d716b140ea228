"""Worker: one rank's model, KV cache and model runner — everything that holds tensors.

The engine core asks it, in order: load_model(), determine_num_blocks() (how many KV blocks the memory
budget holds), init_kv_cache(num_blocks), then execute_model(scheduler_output) every step. A tensor-
parallel rank is a Worker built with its ShardContext; it needs nothing else from the engine.
"""
from __future__ import annotations

import logging

import torch

from kvserve.attention.registry import make_backend
from kvserve.config.engine import EngineConfig
from kvserve.config.model import ModelConfig
from kvserve.config.quantization import QuantizationConfig
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.kv_cache.quant import SCALE_DTYPE, dtype_name, is_quantized, resolve_kv_cache_dtype
from kvserve.layers.linear_methods import default_method
from kvserve.layers.lora import LoRABatch, LoRAMethod
from kvserve.layers.parallel import ShardContext
from kvserve.layers.quant import check_layers, make_head_method, make_linear_method, weight_bytes
from kvserve.lora.manager import LoRAManager
from kvserve.models.layer_ops import load_fused_layer_ops
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.loader import build_model, iter_checkpoint_tensors
from kvserve.models.weight_loader import load_weights
from kvserve.scheduler.output import SchedulerOutput
from kvserve.spec_decode.draft_model import DraftModelProposer
from kvserve.spec_decode.ngram import NgramProposer
from kvserve.spec_decode.proposer import Proposer
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger("kvserve")


class Worker:
    def __init__(self, config: EngineConfig, shard: ShardContext = ShardContext()):
        self.config = config
        self.shard = shard
        self.device = config.device.device
        if config.device.num_threads:
            torch.set_num_threads(config.device.num_threads)
        # NOTE: like vLLM, the engine seed seeds torch's default generator, which unseeded requests draw
        # from; seeded requests own their generators and never touch it.
        torch.manual_seed(config.seed)
        self.model = None
        self.draft_model = None
        """speculative method draft_model: its own weights; its KV pool shares the target's block ids."""
        self.backend = None
        self.runner: ModelRunner | None = None
        self.lora: LoRAManager | None = None
        """enable_lora: the target model's adapter slots (the draft model never runs adapters)."""

    def load_model(self) -> None:
        self.backend = make_backend(self.config.device.attention_backend, self.device.type)
        lora = self.config.lora
        batch = LoRABatch() if lora is not None else None
        self.model = self._load(self.config.model, batch)
        if lora is not None:
            self.lora = LoRAManager(self.model, batch, lora, self.config.model.hf_config, self.device)
        if self.config.draft_model is not None:
            self.draft_model = self._load(self.config.draft_model)

    def _load(self, mc: ModelConfig, lora_batch: LoRABatch | None = None) -> LlamaForCausalLM:
        dense = default_method(self.device, mc.dtype)
        # NOTE: only the target model is quantized (a draft model is small, and its proposals are verified).
        quant = self.config.quantization if mc is self.config.model else QuantizationConfig()
        method = make_linear_method(quant.method, quant.group, dense)
        head = make_head_method(quant, mc.hf_config.hidden_size, dense)
        if lora_batch is not None:
            lora = self.config.lora
            method = LoRAMethod(method, lora_batch, lora.max_loras, lora.max_lora_rank)
        model = build_model(mc.hf_config, self.backend, mc.max_model_len, mc.dtype, self.device, method, self.shard,
                            head_method=head)
        check_layers(model, quant.method, quant.group)
        loaded_bytes = weight_bytes(model)
        load_weights(model, iter_checkpoint_tensors(mc.source, mc.dtype, keep_blocks=quant.method == "gguf"))
        model.eval()
        if mc is self.config.model:
            held = weight_bytes(model)
            logger.info("quantization: %s; weights %d bytes (%.1f MiB) in %s -> %d bytes (%.1f MiB) held "
                        "(linear layers%s; LM head %s; embedding in %s)", quant.describe(), loaded_bytes,
                        loaded_bytes / 2**20, str(mc.dtype).removeprefix("torch."), held, held / 2**20,
                        f" {quant.describe()}" if quant.method else f" {dense.name}",
                        "int8 (group 32)" if head is not dense else str(mc.dtype).removeprefix("torch."),
                        str(mc.dtype).removeprefix("torch."))
        if self.device.type == "cpu" and mc.dtype == torch.float32 and self.backend.name != "torch_ref":
            model.ops = load_fused_layer_ops() or model.ops  # torch_ref stays all-PyTorch: the reference path
        return model

    def kv_cache_spec(self, num_blocks: int, model: LlamaForCausalLM | None = None) -> KVCacheSpec:
        """The target's (or the draft `model`'s) cache: both store --kv-cache-dtype."""
        model = model or self.model
        attn = model.layers[0].self_attn
        dtype = resolve_kv_cache_dtype(self.config.cache.kv_cache_dtype, self.config.model.dtype)
        return KVCacheSpec(model.config.num_hidden_layers, num_blocks, self.config.cache.block_size,
                           attn.num_kv_heads, attn.head_dim, dtype, SCALE_DTYPE if is_quantized(dtype) else None)

    def determine_num_blocks(self) -> int:
        """KV blocks the budget holds: --num-gpu-blocks-override, else --kv-cache-memory on CPU, else the
        free share of --gpu-memory-utilization on CUDA (after the weights are loaded)."""
        cache = self.config.cache
        per_block = self.kv_cache_spec(1).num_bytes
        if self.draft_model is not None:  # every block id holds the draft's K/V too
            per_block += self.kv_cache_spec(1, self.draft_model).num_bytes
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            num_blocks = int((free - (1 - cache.gpu_memory_utilization) * total) // per_block)
        else:
            num_blocks = cache.kv_cache_memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"the KV-cache budget holds no block of {per_block} bytes; raise --kv-cache-memory "
                             "or --gpu-memory-utilization")
        return num_blocks

    def init_kv_cache(self, num_blocks: int) -> KVCacheSpec:
        spec = self.kv_cache_spec(num_blocks)
        proposer = self._make_proposer(num_blocks)
        self.runner = ModelRunner(self.model, self.backend, spec, self.config.scheduler.max_num_seqs,
                                  self.config.model.max_model_len, self.device, proposer, self.lora)
        max_len = self.config.model.max_model_len
        scales = f" + {spec.scale_size} B scale" if spec.quantized else ""
        logger.info(
            "KV cache (%s): %d blocks x %d tokens = %d tokens, %d bytes (%.2f GiB); %d bytes/token "
            "= 2 x %d layers x %d kv_heads x (%d head_dim x %d B%s); max concurrency at max_model_len %d: %.2fx",
            dtype_name(spec.dtype), spec.num_blocks, spec.block_size, spec.num_tokens, spec.num_bytes,
            spec.num_bytes / 2**30, spec.bytes_per_token, spec.num_layers, spec.num_kv_heads, spec.head_dim,
            spec.element_size, scales, max_len, spec.num_tokens / max_len)
        return spec

    def _make_proposer(self, num_blocks: int) -> Proposer | None:
        spec = self.config.speculative
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        return DraftModelProposer(self.draft_model, self.backend, self.kv_cache_spec(num_blocks, self.draft_model),
                                  self.device)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(out)
