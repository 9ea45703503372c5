"""A tiny convolutional network with BatchNorm: the model for buffers updated in forward.

``ConvNet()`` is ``blocks.{i}`` = ``Sequential(Conv2d(3x3, padding 1, no bias), BatchNorm2d, ReLU)``
(so ``blocks.{i}.1`` is the BatchNorm), then a global average pool and the linear ``head``. In
training mode each BatchNorm normalises with the batch statistics and updates its
``running_mean`` / ``running_var`` / ``num_batches_tracked`` buffers in forward; in eval mode it
normalises with the running statistics and updates nothing. ``track_running_stats=False`` keeps no
buffers and always uses the batch statistics.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ConvNet"]


class ConvNet(nn.Module):
    """``num_blocks`` Conv2d+BatchNorm2d+ReLU blocks, global average pool, linear head.

    ``forward(x, labels=None)``: ``x`` of shape ``(batch, in_channels, H, W)``; with ``labels``
    (class indices, shape ``(batch,)``) returns ``{"loss": cross-entropy (mean), "logits": ...}``,
    otherwise the logits ``(batch, num_classes)``. Default inits, so ``torch.manual_seed(seed);
    ConvNet()`` is deterministic.
    """

    def __init__(
        self,
        in_channels: int = 3,
        channels: int = 8,
        num_blocks: int = 2,
        num_classes: int = 10,
        track_running_stats: bool = True,
        momentum: Optional[float] = 0.1,
    ) -> None:
        super().__init__()
        if num_blocks < 1:
            raise ValueError(f"ConvNet: num_blocks={num_blocks} must be at least 1.")
        sizes = [in_channels] + [channels] * num_blocks
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(sizes[i], sizes[i + 1], kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(sizes[i + 1], momentum=momentum, track_running_stats=track_running_stats),
                nn.ReLU(),
            )
            for i in range(num_blocks)
        )
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None):
        """Logits, or ``{"loss", "logits"}`` when ``labels`` are given."""
        for block in self.blocks:
            x = block(x)
        logits = self.head(x.mean(dim=(2, 3)))
        if labels is None:
            return logits
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}
