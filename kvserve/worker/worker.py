"""Worker: one rank's model, KV cache and model runner — everything that holds tensors.

The engine core asks it, in order: load_model(), determine_num_blocks() (how many KV blocks the memory
budget holds), init_kv_cache(num_blocks), then execute_model(scheduler_output) every step. A tensor-
parallel rank is a Worker built with its ShardContext; it needs nothing else from the engine. Only the
driver (rank 0) samples and proposes drafts: a draft model lives there alone, unsharded.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from kvserve.attention.backend import CommonAttentionMetadata
from kvserve.attention.mla import MLABackend
from kvserve.attention.registry import make_backend
from kvserve.config.engine import EngineConfig
from kvserve.config.model import ModelConfig
from kvserve.config.quantization import QuantizationConfig
from kvserve.core_types import ModelRunnerOutput, SchedulerOutput
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.kv_cache.quant import SCALE_DTYPE, dtype_name, is_quantized, resolve_kv_cache_dtype
from kvserve.kv_transfer.base import KVConnectorRole
from kvserve.kv_transfer.factory import KVConnectorFactory
from kvserve.layers.batch_invariant import BatchInvariantMethod
from kvserve.layers.batch_invariant import load_kernel as load_batch_invariant_kernel
from kvserve.layers.linear_methods import default_method
from kvserve.layers.lora import LoRABatch, LoRAMethod
from kvserve.layers.parallel import ShardContext
from kvserve.layers.quant import check_layers, make_head_method, make_linear_method, step_cost_knee, weight_bytes
from kvserve.model_loader.architectures import resolve_architecture
from kvserve.model_loader.dummy import initialize_dummy_weights
from kvserve.model_loader.loader import iter_checkpoint_tensors
from kvserve.model_loader.weight_loader import load_weights
from kvserve.models.build import build_model
from kvserve.models.layer_ops import TritonInvariantLayerOps, load_fused_layer_ops
from kvserve.models.llama import LlamaForCausalLM
from kvserve.spec_decode.draft_model import DraftModelProposer
from kvserve.spec_decode.ngram import NgramProposer
from kvserve.spec_decode.proposer import Proposer
from kvserve.utils.cpu_features import describe_isa
from kvserve.utils.host_malloc import keep_freed_memory
from kvserve.utils.startup_clock import PhaseTimes
from kvserve.worker.cuda_graph import CudaGraphRunner
from kvserve.worker.kv_connector import ConnectorStep
from kvserve.worker.kv_pool import KVPool
from kvserve.worker.lora_manager import LoRAManager
from kvserve.worker.memory_plan import CudaMemoryPlan, plan_cuda_memory
from kvserve.worker.model_runner import ModelRunner

logger = logging.getLogger("kvserve")


class Worker:
    def __init__(self, config: EngineConfig, shard: ShardContext = ShardContext()):
        self.config = config
        self.shard = shard
        self.is_driver = shard.rank == 0
        self.device = config.device.device
        if config.device.num_threads:
            torch.set_num_threads(config.device.num_threads)
        if self.device.type == "cpu":
            keep_freed_memory()   # every step's activations reuse the last one's pages (utils/host_malloc.py)
        # NOTE: like vLLM, the engine seed seeds torch's default generator, which unseeded requests draw
        # from; seeded requests own their generators and never touch it.
        torch.manual_seed(config.seed)
        self.model = None
        self.draft_model = None
        """speculative method draft_model: its own weights; its KV pool shares the target's block ids."""
        self.backend = None
        self.runner: ModelRunner | None = None
        self.memory_plan: CudaMemoryPlan | None = None
        """CUDA: how the KV pool was sized (worker/memory_plan.py)."""
        self.lora: LoRAManager | None = None
        """enable_lora: the target model's adapter slots (the draft model never runs adapters)."""
        self.startup = PhaseTimes()
        """Seconds of loading by phase (weights, kernels, kv cache, warm-up): `kvserve bench startup` reads them."""

    def load_model(self) -> None:
        quantized_kv = is_quantized(resolve_kv_cache_dtype(self.config.cache.kv_cache_dtype, self.config.model.dtype))
        draft = self.config.draft_model
        if draft is not None and resolve_architecture(draft.hf_config)[1].mla:
            raise ValueError("an MLA (DeepSeek) model as the draft model is not supported yet")
        if resolve_architecture(self.config.model.hf_config)[1].mla:
            self.backend = self._mla_backend(quantized_kv)
        else:
            with self.startup.phase("kernels"):  # the backend loads its C++ kernel (from the cache)
                self.backend = make_backend(self.config.device.attention_backend, self.device.type, quantized_kv,
                                            batch_invariant=self.config.device.batch_invariant)
        lora = self.config.lora
        batch = LoRABatch() if lora is not None else None
        self.model = self._load(self.config.model, batch)
        if lora is not None:
            self.lora = LoRAManager(self.model, batch, lora, self.config.model.hf_config, self.device)
        if self.config.draft_model is not None and self.is_driver:
            self.draft_model = self._load(self.config.draft_model, shard=ShardContext())

    def _mla_backend(self, quantized_kv: bool) -> MLABackend:
        """An MLA model's layers attend through their own latent-cache op (attention/mla.py) whatever
        --attention-backend says; what that op does not combine with yet is refused here, by name."""
        if quantized_kv:
            raise ValueError("the MLA latent KV cache is not quantized yet: use --kv-cache-dtype auto")
        if self.config.draft_model is not None:
            raise ValueError("a draft model beside an MLA model is not supported yet (its KV cache layout differs); "
                             "use ngram speculation")
        if self.config.lora is not None:
            raise ValueError("LoRA adapters on an MLA (DeepSeek) model are not supported yet")
        if self.config.device.attention_backend not in ("auto", "torch_ref"):
            logger.info("MLA layers attend through their latent-cache op, not --attention-backend %s",
                        self.config.device.attention_backend)
        return MLABackend()

    def _load(self, mc: ModelConfig, lora_batch: LoRABatch | None = None,
              shard: ShardContext | None = None) -> LlamaForCausalLM:
        shard = self.shard if shard is None else shard
        dense = self._invariant_method() if self.config.device.batch_invariant else default_method(self.device,
                                                                                                    mc.dtype)
        # NOTE: only the target model is quantized (a draft model is small, and its proposals are verified).
        quant = self.config.quantization if mc is self.config.model else QuantizationConfig()
        method = make_linear_method(quant.method, quant.group, dense)
        head = make_head_method(quant, mc.hf_config.hidden_size, dense)
        if lora_batch is not None:
            lora = self.config.lora
            method = LoRAMethod(method, lora_batch, lora.max_loras, lora.max_lora_rank)
        with self.startup.phase("weights"):
            model = build_model(mc.hf_config, self.backend, mc.max_model_len, mc.dtype, self.device, method, shard,
                                head_method=head)
            check_layers(model, quant.method, quant.group)
            loaded_bytes = weight_bytes(model)
            if self.config.load.load_format == "dummy":
                initialize_dummy_weights(model, self.config.seed)
            else:
                # NOTE: a sharded rank reads only its slices of each tensor (model_loader/lazy_tensor.py)
                load_weights(model, iter_checkpoint_tensors(mc.source, mc.dtype, keep_blocks=quant.method == "gguf",
                                                            lazy=shard.size > 1))
            model.eval()
        if mc is self.config.model:
            held = weight_bytes(model)
            logger.info("quantization: %s; weights %d bytes (%.1f MiB) in %s -> %d bytes (%.1f MiB) held "
                        "(linear layers%s; LM head %s; embedding in %s)", quant.describe(), loaded_bytes,
                        loaded_bytes / 2**20, str(mc.dtype).removeprefix("torch."), held, held / 2**20,
                        f" {quant.describe()}" if quant.method else f" {dense.name}",
                        "int8 (group 32)" if head is not dense else str(mc.dtype).removeprefix("torch."),
                        str(mc.dtype).removeprefix("torch."))
            if shard.size > 1:
                logger.info("tensor parallel rank %d of %d holds %d bytes (%.1f MiB) of weights: its shard",
                            shard.rank, shard.size, held, held / 2**20)
        if (self.device.type == "cpu" and mc.dtype in (torch.float32, torch.bfloat16)
                and self.backend.name != "torch_ref"):
            with self.startup.phase("kernels"):
                model.ops = load_fused_layer_ops() or model.ops  # torch_ref stays all-PyTorch: the reference path
        if self.device.type == "cuda" and self.config.device.batch_invariant:
            model.ops = TritonInvariantLayerOps()  # PyTorch's CUDA norm picks its reduction split by shape
        if self.device.type == "cpu" and mc is self.config.model:
            logger.info("CPU instruction sets: %s", describe_isa())  # docs/features/cpu-kernels.md
        if self.config.device.batch_invariant and mc is self.config.model:
            logger.info("batch-invariant mode: on (fixed-order matmul and %s attention: a request's logits do not "
                        "depend on the rest of its steps; docs/features/batch-invariance.md)", self.backend.name)
        return model

    def _invariant_method(self) -> BatchInvariantMethod:
        """--batch-invariant: every linear layer and the LM head through the fixed-order matmul."""
        if self.device.type == "cuda":
            return BatchInvariantMethod()
        kernel = load_batch_invariant_kernel()
        if kernel is None:
            raise ValueError("--batch-invariant needs a C++ compiler and ninja to build its matmul kernel")
        return BatchInvariantMethod(kernel)

    def kv_cache_spec(self, num_blocks: int, model: LlamaForCausalLM | None = None) -> KVCacheSpec:
        """The target's (or the draft `model`'s) cache: both store --kv-cache-dtype."""
        model = model or self.model
        attn = model.layers[0].self_attn
        dtype = resolve_kv_cache_dtype(self.config.cache.kv_cache_dtype, self.config.model.dtype)
        latent = getattr(attn, "latent_dim", None)
        if latent is not None:  # MLA: one latent vector per token and layer (attention/mla.py)
            return KVCacheSpec(model.config.num_hidden_layers, num_blocks, self.config.cache.block_size, 1, latent,
                               dtype, latent=True)
        return KVCacheSpec(model.config.num_hidden_layers, num_blocks, self.config.cache.block_size,
                           attn.num_kv_heads, attn.head_dim, dtype, SCALE_DTYPE if is_quantized(dtype) else None)

    def determine_num_blocks(self) -> int:
        """KV blocks the budget holds: --num-gpu-blocks-override, else --kv-cache-memory on CPU, else
        --gpu-memory-utilization of the device's memory minus what is in use on CUDA (after the weights are
        loaded and a warm-up forward at the largest batch: worker/memory_plan.py)."""
        cache = self.config.cache
        per_block = self.kv_cache_spec(1).num_bytes
        if self.draft_model is not None:  # every block id holds the draft's K/V too
            per_block += self.kv_cache_spec(1, self.draft_model).num_bytes
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
        elif self.device.type == "cuda":
            with self.startup.phase("warm-up"):
                self.memory_plan = plan_cuda_memory(self.device, cache.gpu_memory_utilization, self._warm_up)
            logger.info("CUDA memory: %s", self.memory_plan.describe())
            num_blocks = self.memory_plan.num_blocks(per_block)
        else:
            num_blocks = cache.kv_cache_memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"the KV-cache budget holds no block of {per_block} bytes; raise --kv-cache-memory "
                             "or --gpu-memory-utilization")
        return num_blocks

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One forward pass at the largest batch (--max-num-batched-tokens tokens as one prompt, through a
        KV pool just big enough for them) and the LM head and sampling over --max-num-seqs rows: the
        activation peak every later step stays under. Everything it allocates is freed."""
        sched, bs = self.config.scheduler, self.config.cache.block_size
        num_tokens = sched.max_num_batched_tokens
        num_blocks = -(-num_tokens // bs)
        pool = KVPool.allocate(self.kv_cache_spec(num_blocks), self.backend, self.device)
        dev = self.device
        common = CommonAttentionMetadata(
            query_start_loc=torch.tensor([0, num_tokens], device=dev),
            seq_lens=torch.tensor([num_tokens], device=dev), block_table=torch.arange(num_blocks, device=dev)[None],
            slot_mapping=torch.arange(num_tokens, device=dev), num_decodes=0, num_decode_tokens=0, block_size=bs, query_lens_cpu=[num_tokens],
            seq_lens_cpu=[num_tokens])
        if self.lora is not None:
            self.lora.set_step(np.zeros(num_tokens, dtype=np.int64), {})
        positions = torch.arange(num_tokens, device=dev) % self.config.model.max_model_len
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        hidden = self.model(ids, positions, pool.layers, self.backend.build_metadata(common))
        rows = min(sched.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:rows]).float()
        logits.log_softmax(dim=-1).sort(dim=-1)  # the sampler's widest temporaries: logprobs, top-p's sort
        del pool, common, hidden, logits

    def init_kv_cache(self, num_blocks: int) -> KVCacheSpec:
        spec = self.kv_cache_spec(num_blocks)
        with self.startup.phase("kv cache"):
            proposer = self._make_proposer(num_blocks)
            self.runner = ModelRunner(self.model, self.backend, spec, self.config.scheduler.max_num_seqs,
                                      self.config.model.max_model_len, self.device, proposer, self.lora,
                                      samples=self.is_driver, logprobs_mode=self.config.model.logprobs_mode)
        transfer = self.config.kv_transfer
        if transfer is not None and transfer.kv_connector:
            connector = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, spec,
                                                            tp_rank=self.shard.rank)
            if self.shard.size > 1:
                connector.tp_all_reduce = self.shard.all_reduce
            connector.register_kv_caches(self.runner.kv_caches)
            self.runner.kv_connector = ConnectorStep(connector, self.runner.kv_caches, spec.num_blocks,
                                                     self.shard.all_reduce if self.shard.size > 1 else None)
        max_len = self.config.model.max_model_len
        if self._use_cuda_graphs():
            graphs = CudaGraphRunner(self.model, self.backend, self.runner.kv_caches,
                                     self.config.scheduler.max_num_seqs, -(-max_len // spec.block_size),
                                     spec.block_size, self.device)
            with self.startup.phase("warm-up"):  # capturing runs each graph's batch once
                graphs.capture()
            self.runner.cuda_graphs = graphs
        scales = ""
        if spec.quantized:
            # the capacity gained: tokens per byte against the same cache in the model's dtype
            plain = dataclasses.replace(spec, dtype=self.config.model.dtype, scale_dtype=None)
            scales = (f" + {spec.scale_size} B scale per block of {spec.block_size}; "
                      f"{plain.bytes_per_block / spec.bytes_per_block:.2f}x the tokens of a "
                      f"{dtype_name(plain.dtype)} cache")
        if self.shard.size > 1 and not spec.latent:  # a latent (MLA) cache is whole on every rank
            logger.info("tensor parallel rank %d of %d: this rank's KV cache holds %d of the model's %d KV heads "
                        "(the figures below are this rank's)", self.shard.rank, self.shard.size, spec.num_kv_heads,
                        self.config.model.hf_config.num_key_value_heads)
        per_token = (f"{spec.num_layers} layers x {spec.head_dim} latent x {spec.element_size} B" if spec.latent else
                     f"2 x {spec.num_layers} layers x {spec.num_kv_heads} kv_heads x ({spec.head_dim} head_dim x "
                     f"{spec.element_size} B{scales})")
        logger.info(
            "KV cache (%s): %d blocks x %d tokens = %d tokens, %d bytes (%.2f GiB); %g bytes/token "
            "= %s; max concurrency at max_model_len %d: %.2fx",
            dtype_name(spec.dtype), spec.num_blocks, spec.block_size, spec.num_tokens, spec.num_bytes,
            spec.num_bytes / 2**30, spec.bytes_per_token, per_token, max_len, spec.num_tokens / max_len)
        return spec

    def _use_cuda_graphs(self) -> bool:
        """CUDA, not --enforce-eager, a backend that can be captured, no LoRA (its per-step slot map is
        host-built, outside any graph) and no layer that reads its data on the host (MoE experts)."""
        return (self.device.type == "cuda" and not self.config.device.enforce_eager and self.lora is None
                and getattr(self.backend, "supports_cuda_graphs", False)
                and all(getattr(m, "supports_cuda_graphs", True) for m in self.model.modules()))

    def _make_proposer(self, num_blocks: int) -> Proposer | None:
        spec = self.config.speculative
        if spec is None or not self.is_driver:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        draft_spec = self.kv_cache_spec(num_blocks, self.draft_model)
        pool = KVPool.allocate(draft_spec, self.backend, self.device)
        return DraftModelProposer(self.draft_model, self.backend, pool.layers, draft_spec.block_size, self.device)

    def kv_connector_handshake_metadata(self) -> dict | None:
        """What the scheduler-side KV connector must know of this worker's (its side channel); None: none."""
        step = None if self.runner is None else self.runner.kv_connector
        return None if step is None else step.connector.get_handshake_metadata()

    def shutdown_kv_connector(self) -> None:
        step = None if self.runner is None else self.runner.kv_connector
        if step is not None:
            step.connector.shutdown()

    def step_cost_knee(self) -> int:
        """Step tokens up to which a step of this model costs more per token (layers/quant step_cost_knee; 0:
        no such knee): the engine core's step-cost model learns it through the executor."""
        return step_cost_knee(self.config.quantization, self.device.type)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(out)
