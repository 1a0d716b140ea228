"""A replicated linear layer loaded through a linear method, for the quantized-method tests."""
from __future__ import annotations

import torch

from kvserve.layers.linear import ReplicatedLinear


def linear_layer(w: torch.Tensor, method, bias: torch.Tensor | None = None, loaded=None) -> ReplicatedLinear:
    """`w` (or `loaded`, a packed form of it) and `bias` loaded into a ReplicatedLinear using `method`."""
    layer = ReplicatedLinear(w.shape[1], w.shape[0], bias is not None, method)
    layer.weight_loader("weight", w if loaded is None else loaded)
    if bias is not None:
        layer.weight_loader("bias", bias)
    layer.process_weights_after_loading()
    return layer
