"""A tiny multi-layer perceptron: the smallest model worth parallelizing, for fast tests.

``MLP(16, 32, 8, num_layers=2)`` is ``layers.0`` (Linear 16->32), ReLU, ``layers.1`` (Linear 32->8).
The ReLUs are functional, so the only submodules are the Linear layers ``layers.{i}``, which makes
plans short: ``{"layers.0": "colwise", "layers.1": "rowwise"}`` is Megatron-style TP.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP"]


class MLP(nn.Module):
    """``num_layers`` Linear layers (with bias) with a ReLU between consecutive ones.

    ``forward(x, target=None)``: with ``target`` returns the mean-squared-error loss (a scalar,
    mean over all elements), otherwise the output of shape ``(..., out_features)``. Weights use
    PyTorch's default Linear init, so ``torch.manual_seed(seed); MLP()`` is deterministic.
    """

    def __init__(self, in_features: int = 16, hidden: int = 32, out_features: int = 8, num_layers: int = 2) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"MLP: num_layers={num_layers} must be at least 1.")
        sizes = [in_features] + [hidden] * (num_layers - 1) + [out_features]
        self.layers = nn.ModuleList(nn.Linear(sizes[i], sizes[i + 1]) for i in range(num_layers))

    def forward(self, x: torch.Tensor, target: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Return the MSE loss against ``target`` if given, else the network output."""
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        if target is None:
            return x
        return F.mse_loss(x, target)
