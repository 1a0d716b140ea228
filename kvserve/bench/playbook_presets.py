"""Sizes of the playbook's workloads: `quick` (under 10 minutes on 2 cores with the built-in model), `full`
(under 45), and `tiny` (seconds on a tiny test checkpoint: every row runs, no figure means anything)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    name: str
    # static vs continuous batching
    varied_requests: int
    varied_prompt: int
    varied_max_output: int
    batch_seqs: int
    """max_num_seqs of both sides (the static batch size): several batches' worth of requests, or static
    batching admits them all at once and loses nothing."""
    # PagedAttention: paged vs contiguous at a fixed KV memory
    paged_requests: int
    paged_prompt: int
    paged_output: int
    paged_max_model_len: int
    paged_slabs: int
    """The KV pool holds this many max_model_len slabs (the contiguous side's concurrency)."""
    # chunked prefill
    short_requests: int
    short_prompt: int
    short_output: int
    long_requests: int
    long_prompt: int
    long_arrival_s: float
    # prefix caching: agent and RAG
    agent_sessions: int
    agent_steps: int
    agent_system: int
    agent_step: int
    agent_output: int
    rag_requests: int
    rag_docs: int
    rag_doc_len: int
    rag_question: int
    rag_output: int
    # prompt caching
    prompt_cache_len: int
    prompt_cache_pairs: int
    # speculative decoding
    spec_requests: int
    spec_prompt: int
    spec_output: int
    spec_concurrency: int
    # multi-LoRA
    lora_adapters: int
    lora_requests: int
    lora_output: int
    lora_rank: int
    # MoE layer (bench moe's shape flags)
    moe_hidden: int
    moe_intermediate: int
    moe_experts: int
    moe_top_k: int
    moe_batches: str
    moe_repeat: int


PRESETS = {
    "tiny": Preset("tiny", varied_requests=6, varied_prompt=8, varied_max_output=24, batch_seqs=3,
                   paged_requests=6, paged_prompt=8, paged_output=6, paged_max_model_len=64, paged_slabs=2,
                   short_requests=3, short_prompt=8, short_output=8, long_requests=1, long_prompt=48,
                   long_arrival_s=0.0,
                   agent_sessions=2, agent_steps=3, agent_system=32, agent_step=16, agent_output=4,
                   rag_requests=4, rag_docs=2, rag_doc_len=48, rag_question=8, rag_output=4,
                   prompt_cache_len=64, prompt_cache_pairs=1,
                   spec_requests=2, spec_prompt=16, spec_output=8, spec_concurrency=2,
                   lora_adapters=2, lora_requests=4, lora_output=4, lora_rank=4,
                   moe_hidden=64, moe_intermediate=32, moe_experts=8, moe_top_k=2, moe_batches="4", moe_repeat=2),
    "quick": Preset("quick", varied_requests=48, varied_prompt=64, varied_max_output=256, batch_seqs=8,
                    paged_requests=32, paged_prompt=64, paged_output=64, paged_max_model_len=2048, paged_slabs=4,
                    short_requests=8, short_prompt=32, short_output=96, long_requests=2, long_prompt=1024,
                    long_arrival_s=1.0,
                    agent_sessions=4, agent_steps=5, agent_system=512, agent_step=96, agent_output=16,
                    rag_requests=16, rag_docs=2, rag_doc_len=768, rag_question=32, rag_output=16,
                    prompt_cache_len=1536, prompt_cache_pairs=2,
                    spec_requests=4, spec_prompt=96, spec_output=64, spec_concurrency=4,
                    lora_adapters=4, lora_requests=16, lora_output=32, lora_rank=16,
                    moe_hidden=1024, moe_intermediate=384, moe_experts=64, moe_top_k=8, moe_batches="1,16",
                    moe_repeat=5),
    "full": Preset("full", varied_requests=128, varied_prompt=128, varied_max_output=512, batch_seqs=16,
                   paged_requests=96, paged_prompt=128, paged_output=128, paged_max_model_len=4096, paged_slabs=4,
                   short_requests=16, short_prompt=64, short_output=192, long_requests=2, long_prompt=2000,
                   long_arrival_s=2.0,
                   agent_sessions=8, agent_steps=8, agent_system=1024, agent_step=128, agent_output=32,
                   rag_requests=48, rag_docs=4, rag_doc_len=1024, rag_question=48, rag_output=32,
                   prompt_cache_len=3072, prompt_cache_pairs=3,
                   spec_requests=16, spec_prompt=128, spec_output=128, spec_concurrency=8,
                   lora_adapters=8, lora_requests=64, lora_output=64, lora_rank=16,
                   moe_hidden=2048, moe_intermediate=768, moe_experts=128, moe_top_k=8, moe_batches="1,16,64",
                   moe_repeat=10),
}
