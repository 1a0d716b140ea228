"""The KV pool: the tensors every layer's cache is a view of, allocated once from a KVCacheSpec in the layout the
attention backend asks for (the worker owns it; kv_cache/ describes the layout and knows nothing of attention)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.kv_cache.layout import KVCacheSpec
from kvserve.kv_cache.quant import QuantizedKVCache
from kvserve.utils.lazy_zeros import lazy_zeros


@dataclass
class KVPool:
    values: torch.Tensor          # [num_layers, *backend.kv_cache_shape(...)] spec.dtype
    scales: torch.Tensor | None   # [num_layers, *backend.kv_cache_scale_shape(...)] spec.scale_dtype; None: unquantized
    layers: list                  # [num_layers] what each layer's attention gets: a view of `values`, or a
                                  # QuantizedKVCache of views of both

    @classmethod
    def allocate(cls, spec: KVCacheSpec, backend: AttentionBackend, device: torch.device) -> "KVPool":
        # One allocation (two for a quantized cache), viewed per layer (nano-vllm): no per-layer fragmentation.
        shape = backend.kv_cache_shape(spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        if device.type == "cpu":  # no memset up front: pages come zeroed from the OS as blocks are first written
            values = lazy_zeros((spec.num_layers, *shape), spec.dtype)
        else:
            values = torch.zeros((spec.num_layers, *shape), dtype=spec.dtype, device=device)
        if not spec.quantized:
            return cls(values, None, list(values.unbind(0)))
        scale_shape = backend.kv_cache_scale_shape(spec.num_blocks, spec.block_size, spec.num_kv_heads)
        scales = torch.ones((spec.num_layers, *scale_shape), dtype=spec.scale_dtype, device=device)
        return cls(values, scales, [QuantizedKVCache(v, s) for v, s in zip(values.unbind(0), scales.unbind(0))])

    @property
    def num_bytes(self) -> int:
        scale_bytes = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.values.numel() * self.values.element_size() + scale_bytes
