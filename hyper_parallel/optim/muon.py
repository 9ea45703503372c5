"""Muon: momentum SGD whose update of each weight matrix is orthogonalised, on sharded parameters.

Per 2-D parameter ``W`` (shape ``A x B``) and step, with gradient ``G`` (Keller Jordan's Muon, as
``torch.optim.Muon`` also implements it)::

    M <- momentum * M + (1 - momentum) * G                  (momentum buffer, an EMA)
    U <- (1 - momentum) * G + momentum * M   if nesterov, else M
    O <- NewtonSchulz(U)                                    (~ U's orthogonal factor)
    W <- W * (1 - lr * weight_decay)                        (decoupled weight decay)
    W <- W - lr * scale(A, B) * O

``NewtonSchulz`` normalises ``U`` by its Frobenius norm and runs ``ns_steps`` quintic iterations
``X <- a X + (b X X^T + c (X X^T)^2) X`` with ``(a, b, c) = (3.4445, -4.7750, 2.0315)`` on the wide
orientation of the matrix. Singular values not much smaller than the largest end up in roughly
``[0.7, 1.2]`` rather than exactly 1 (tiny ones grow less), which does not hurt training. It runs
in ``ns_dtype``: float32 by default (sharded and single-device runs then agree to float rounding);
bfloat16 is what Keller Jordan's code and ``torch.optim.Muon`` use (faster on GPUs; with it this
class takes torch's steps exactly).

``scale`` is ``adjust_lr_fn``: ``"original"`` (default: Keller Jordan's ``sqrt(max(1, A / B))``,
the scale the default ``lr=0.02`` comes with) or ``"match_rms_adamw"`` (Moonlight's
``0.2 * sqrt(max(A, B))``, which lets Muon reuse AdamW's learning rate and weight decay).

Sharded parameters: the momentum step is elementwise, so it runs on each rank's local shard and the
buffer is a DTensor placed like its parameter. Newton–Schulz needs the whole matrix; each matrix is
orthogonalised once, on one owner rank of its shard group, and every rank gets its slice of the
result back (:mod:`hyper_parallel.optim.whole_matrix`: two ``all_to_all_single`` per step for all
matrices of a mesh). The result equals single-device Muon. The collectives of the last step are in
:attr:`Muon.last_step_collectives` (:meth:`Muon.comm_report` sums them).

Muon is for the hidden layers' 2-D weights; embeddings, the output head, norms and biases belong to
AdamW (:func:`hyper_parallel.optim.get_hyper_optimizer` builds that pairing). Other shapes are
refused with a ``ValueError`` naming the parameter.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from .. import compat
from .whole_matrix import Collective, WholeMatrixExchange

__all__ = ["NS_COEFFICIENTS", "Muon", "muon_lr_scale", "newton_schulz"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}
_ADJUST = ("original", "match_rms_adamw")


def newton_schulz(matrix: torch.Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = 1e-7, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximately orthogonalise a 2-D ``matrix`` (its ``U V^T`` factor) in ``dtype``.

    The quintic Newton–Schulz iteration on the Frobenius-normalised matrix (so its spectral norm is
    at most 1), transposed so that ``X X^T`` is the smaller Gram matrix. Returns ``dtype``."""
    if matrix.dim() != 2:
        raise ValueError(f"newton_schulz takes a 2-D matrix, got shape {tuple(matrix.shape)}")
    a, b, c = coefficients
    x = matrix.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G G
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b G + c G G) X
    return x.T if tall else x


def muon_lr_scale(shape: tuple[int, ...], adjust_lr_fn: str | None = "original") -> float:
    """The factor Muon multiplies the learning rate by for a ``shape`` (A x B) matrix."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be one of {_ADJUST}, got {adjust_lr_fn!r}")


def _dtype_name(dtype: Any) -> str:
    """``ns_dtype`` is kept in the param group as a name (state dicts hold plain values)."""
    for name, value in _DTYPES.items():
        if dtype in (name, value):
            return name
    raise ValueError(f"ns_dtype must be one of {sorted(_DTYPES)} (or the torch dtype), got {dtype!r}")


def _local(t: torch.Tensor) -> torch.Tensor:
    return compat.local_of(t) if isinstance(t, DTensor) else t


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    """The gradient's local shard, laid out like the parameter's."""
    grad = p.grad
    if isinstance(p, DTensor) and isinstance(grad, DTensor):
        if tuple(grad.placements) != tuple(p.placements):
            grad = grad.redistribute(p.device_mesh, p.placements)
        return compat.local_of(grad)
    if isinstance(grad, DTensor):  # a plain parameter with a DTensor gradient
        return grad.full_tensor()
    return grad


class Muon(torch.optim.Optimizer):
    """Muon (momentum + Newton–Schulz orthogonalised updates) for 2-D parameters; see the module
    docstring for the update and how sharded (DTensor) parameters are handled.

    Args: ``params`` (2-D tensors or param groups), ``lr`` (0.02), ``momentum`` (0.95), ``ns_steps``
    (5), ``nesterov`` (True), ``weight_decay`` (0.1, decoupled: ``W *= 1 - lr * weight_decay``).
    Keyword-only: ``ns_coefficients`` (3.4445, -4.7750, 2.0315), ``eps`` (1e-7, of the
    normalisation), ``adjust_lr_fn`` (``"original"`` or ``"match_rms_adamw"``), ``ns_dtype``
    (``torch.float32``; ``torch.bfloat16`` is faster on GPUs, at bf16 precision).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.02,
        momentum: float = 0.95,
        ns_steps: int = 5,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        *,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        adjust_lr_fn: str | None = "original",
        ns_dtype: Any = torch.float32,
    ) -> None:
        if not float(lr) >= 0.0:
            raise ValueError(f"Muon: lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: momentum must be in [0, 1), got {momentum}")
        if not isinstance(ns_steps, int) or not 1 <= ns_steps < 100:
            raise ValueError(f"Muon: ns_steps must be an int in [1, 100), got {ns_steps!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Muon: weight_decay must be >= 0, got {weight_decay}")
        if len(tuple(ns_coefficients)) != 3:
            raise ValueError(f"Muon: ns_coefficients must be three numbers (a, b, c), got {ns_coefficients!r}")
        if adjust_lr_fn not in (None, *_ADJUST):
            raise ValueError(f"Muon: adjust_lr_fn must be one of {_ADJUST}, got {adjust_lr_fn!r}")
        defaults = dict(lr=lr, momentum=momentum, ns_steps=ns_steps, nesterov=nesterov,
                        weight_decay=weight_decay, ns_coefficients=tuple(ns_coefficients), eps=eps,
                        adjust_lr_fn=adjust_lr_fn, ns_dtype=_dtype_name(ns_dtype))
        super().__init__(params, defaults)
        self._exchange = WholeMatrixExchange()
        #: The collectives the last :meth:`step` issued (:class:`~hyper_parallel.optim.whole_matrix.Collective`).
        self.last_step_collectives: list[Collective] = []

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, refusing parameters that are not 2-D (they belong to AdamW)."""
        if "ns_dtype" in param_group:
            param_group = {**param_group, "ns_dtype": _dtype_name(param_group["ns_dtype"])}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        names = group.get("param_names") or [None] * len(group["params"])
        bad = [(name or f"params[{i}] of param group {len(self.param_groups) - 1}", tuple(p.shape))
               for i, (p, name) in enumerate(zip(group["params"], names)) if p.dim() != 2]
        if bad:
            self.param_groups.pop()
            listed = ", ".join(f"{name} (shape {shape})" for name, shape in bad)
            raise ValueError(
                f"Muon orthogonalises 2-D weight matrices only; got {listed}. Give norms, biases and "
                "other non-2-D parameters to AdamW (get_hyper_optimizer does)."
            )

    def comm_report(self) -> dict[str, int]:
        """The last step's collectives summed: ``{"count", "send_bytes", "recv_bytes"}``."""
        records = self.last_step_collectives
        return {"count": len(records), "send_bytes": sum(r.send_bytes for r in records),
                "recv_bytes": sum(r.recv_bytes for r in records)}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Muon step over every parameter that has a gradient (``closure`` recomputes the loss)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params, updates, dtypes, settings = [], [], [], []
        for group in self.param_groups:
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse or torch.is_complex(p):
                    raise RuntimeError("Muon takes dense real parameters and gradients")
                grad = _local_grad(p)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)  # a DTensor placed like p
                buf = _local(state["momentum_buffer"])
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                params.append(p)
                updates.append(update)
                dtypes.append(_DTYPES[group["ns_dtype"]])
                settings.append(group)

        def orthogonalise(i: int, full: torch.Tensor) -> torch.Tensor:
            group = settings[i]
            return newton_schulz(full, group["ns_steps"], group["ns_coefficients"], group["eps"], dtypes[i])

        ortho, self.last_step_collectives = self._exchange(params, updates, dtypes, orthogonalise)
        for p, o, group in zip(params, ortho, settings):
            lr = float(group["lr"])
            local = _local(p)
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(o.to(local.dtype), alpha=-lr * muon_lr_scale(tuple(p.shape), group["adjust_lr_fn"]))
        return loss
