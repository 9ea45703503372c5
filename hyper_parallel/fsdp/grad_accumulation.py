"""Gradients kept between micro-steps of FSDP/HSDP gradient accumulation.

``set_requires_gradient_sync(False)`` compiles programs that leave FSDP gradients unsharded and
unreduced; HSDP's ``set_requires_all_reduce(False)`` compiles programs that reduce-scatter them but
skip the replicate all-reduce. Those gradients are not final, so autograd gets ``None`` for them and
this holder keeps them. The next program takes them as inputs and adds them to its own gradients in
the graph (propagation/accumulation.py), so the step that syncs reduces the whole sum once, with the
same fused, scheduled collectives as any step. No collective runs from here.

Forward hands the pending gradients to the program (``take``); backward stores what the program
returns (``keep``). Should two forwards run before their backwards, the second finds nothing pending
and its gradients are added here instead, so nothing is counted twice.
"""

from __future__ import annotations

import torch


class GradientAccumulator:
    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}  # parameter FQN -> pending local gradient
        self.layout: str | None = None  # their fsdp.plan.GRADIENT_LAYOUTS name

    @property
    def pending(self) -> str | None:
        """The layout of the pending gradients, or None when there are none."""
        return self.layout if self.buffers else None

    def take(self, fqn: str) -> torch.Tensor:
        """Hand ``fqn``'s pending gradient to a program (which adds it to its own)."""
        return self.buffers.pop(fqn)

    def keep_hook(self, primal_params: list[str | None], layout: str):
        """A backward gradient hook that stores this step's (partial) FSDP gradients and gives
        autograd ``None`` for them. ``primal_params``: per primal, its FSDP parameter FQN or None."""

        def keep(grads: list) -> list:
            if self.buffers and self.layout != layout:
                raise RuntimeError(
                    f"gradient accumulation: gradients of {sorted(self.buffers)[:3]} pending in layout "
                    f"{self.layout!r} meet new ones in "
                    f"{layout!r}; run each micro-step's backward before the next forward when changing "
                    "set_requires_gradient_sync / set_requires_all_reduce"
                )
            out = list(grads)
            for i, fqn in enumerate(primal_params):
                if fqn is None or grads[i] is None:
                    continue
                pending = self.buffers.get(fqn)
                self.buffers[fqn] = grads[i] if pending is None else pending + grads[i]
                out[i] = None
            self.layout = layout
            return out

        return keep
