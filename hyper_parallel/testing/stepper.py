"""The parity stepper: the loop every single-device parity test runs, written once.

A parity test trains a parallelized model next to an untouched single-device copy and checks after
every step that the loss and every parameter gradient agree (docs/architecture.md §4.1,
docs/testing.md). :class:`ParityStepper` is that loop on one rank of a worker pool: per step it
takes the global batch from a batch source, runs the parallel model on this rank's slice and the
reference on the whole batch (each possibly over several micro-batches, gradients accumulated),
compares the loss and every gradient (DTensor gradients gathered whole) with the caller's
tolerances, or against a bf16 one-device reference, or within a bound of float64 gradients, then
steps both optimizers. Any difference raises on the rank that sees it, naming the step and the
parameter.

What a test checks besides parity stays in the test: hooks run its code before the step, around
each parallel micro-batch (a ``no_sync()``, a collective counter), after the backwards, before the
optimizer step (gradient clipping) and after it, and every hook gets the step's
:class:`StepRecord` (batches, losses, outputs). :meth:`ParityStepper.step` runs one step, with
comparison settings overridable for that step; code between two calls runs between two steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ContextManager, Iterable

import torch

from hyper_parallel.testing.batches import global_batch, local_batch, model_loss
from hyper_parallel.testing.bf16 import (
    assert_bf16_gradients_near_exact, assert_gradients_near_exact, assert_matches_bf16_reference, bf16_copy,
    float64_gradients,
)

Batch = dict
Hook = Callable[["StepRecord"], Any]

__all__ = ["ParityStepper", "StepRecord", "batches", "call", "chunks", "sgd", "strided", "whole"]


def batches(model: str = "llama", batch: int = 4, seq_len: int = 16,
            ignore_fraction: float = 0.0) -> Callable[[int], Batch]:
    """The usual batch source: step ``s`` gets ``global_batch(model, batch, seq_len, seed=s + 1,
    ignore_fraction=...)``; ``ignore_fraction`` > 0 pads labels with -100 (ranks count different
    numbers of tokens)."""
    return lambda step: global_batch(model, batch, seq_len, seed=step + 1, ignore_fraction=ignore_fraction)


def sgd(lr: float = 0.1, **kwargs) -> Callable[[Iterable], torch.optim.Optimizer]:
    """An optimizer factory: ``torch.optim.SGD(params, lr=lr, **kwargs)``."""
    return lambda params: torch.optim.SGD(params, lr=lr, **kwargs)


def chunks(batch: Batch, n: int) -> list[Batch]:
    """``n`` micro-batches of consecutive rows (``tensor.chunk(n)``)."""
    return [{k: v.chunk(n)[i] for k, v in batch.items()} for i in range(n)]


def strided(batch: Batch, n: int) -> list[Batch]:
    """``n`` micro-batches of every n-th row (micro-batch ``i``: rows ``i, i + n, ...``)."""
    return [{k: v[i::n] for k, v in batch.items()} for i in range(n)]


def call(model, batch: Batch) -> Any:
    """The default forward: ``model(**batch)``."""
    return model(**batch)


def whole(t):
    """A DTensor gathered whole (``full_tensor()``); anything else as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _default_loss(output, batch) -> torch.Tensor:
    return model_loss(output)


@dataclasses.dataclass
class StepRecord:
    """One step of a :class:`ParityStepper`, handed to every hook and returned by ``step()``.

    ``micro`` / ``local``: the parallel model's global micro-batches and this rank's slices of them
    (one each without accumulation); ``ref_micro``: the reference's. ``losses`` / ``ref_losses``:
    each micro-batch's loss as it was backpropagated (scaled by the number of micro-batches),
    detached; ``loss`` / ``ref_loss``: their sums, the step's loss. ``output`` / ``ref_output``: what
    the last micro-batch's forward returned. ``compute``: the bf16 copy the reference computed with
    (``bf16_reference=True``). The last three are dropped from a record when the next step has run."""

    step: int
    batch: Batch
    micro: list
    local: list
    ref_micro: list = dataclasses.field(default_factory=list)
    losses: list = dataclasses.field(default_factory=list)
    ref_losses: list = dataclasses.field(default_factory=list)
    loss: torch.Tensor | None = None
    ref_loss: torch.Tensor | None = None
    output: Any = None
    ref_output: Any = None
    compute: torch.nn.Module | None = None


# Settings ParityStepper.step(step, **overrides) may change for one step.
_OVERRIDABLE = ("rtol", "atol", "loss_rtol", "loss_atol", "check_loss", "micro_losses", "grads", "forward_context")
_DEFAULT = object()


def _total(values: list) -> torch.Tensor:
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


class ParityStepper:
    """Train ``parallel`` next to ``reference`` (one device) and assert, every step, that the loss
    and every gradient agree. Runs on every rank; see the module docstring.

    Models and data:
      ``reference``, ``parallel``: any modules (``parallel``'s parameters are compared by name with
      the reference's; DTensor gradients gathered whole). ``batch(step)``: the step's global batch
      (default :func:`batches`: ``global_batch("llama", 4, 16, seed=step + 1)``). ``local(batch)``:
      this rank's slice (default ``local_batch(batch, mesh)`` when ``mesh`` is given, else the batch
      itself).
      ``forward(model, batch)`` (default ``model(**batch)``) and ``loss(output, batch)`` (default the
      output's loss: :func:`~hyper_parallel.testing.batches.model_loss`) for the parallel model;
      ``ref_forward`` / ``ref_loss`` for the reference (default: the same, or a plain call when
      ``backward_in_forward``). ``backward_in_forward``: ``forward`` runs the backward itself and
      returns the loss (a pipeline's ``step()``). ``forward_context()``: a context manager around each
      forward and loss, not the backward (``lambda: torch.autocast(...)``).
    Gradient accumulation:
      ``micro_batches`` (parallel) and ``reference_micro_batches`` (default: the same micro-batches;
      1: the whole batch once) split the global batch with ``split(batch, n)`` (default
      :func:`chunks`; :func:`strided`); each micro-batch's loss is divided by that side's number of
      micro-batches (``scale_micro_losses``; False when the loss normalises itself, e.g. by a token
      count of the whole step) and backpropagated; the step's loss is their sum.
    Optimizer:
      ``optimizer(params)`` builds each side's (default :func:`sgd`, lr 0.1), before the first step
      or, with ``lazy_optimizer``, the parallel one at the first optimizer step (after the first
      call); both step and zero their gradients after the comparison. ``None``: no optimizer, the
      gradients are zeroed (``zero_grad(set_to_none=True)``) after each step.
    Comparison (each may be overridden for one step: ``step(s, rtol=..., grads=None)``):
      the loss with ``assert_close(rtol=loss_rtol, atol=loss_atol)`` (default: ``rtol`` / ``atol``;
      1e-2 each under ``bf16_reference``; ``check_loss=False`` skips it; ``micro_losses``: each
      micro-batch's loss instead of the sum). ``grads``: ``"close"`` every gradient with
      ``assert_close(rtol, atol)`` (``None``: its defaults; a frozen parameter must have none on
      either side); ``"near_exact"`` each gradient no further from the exact one (float64 at the
      reference's weights, the step's micro-batches replayed outside autocast) than a few times the
      reference's own error (:func:`~hyper_parallel.testing.bf16.assert_gradients_near_exact`: for
      bf16 autocast); ``"bf16"`` (default under ``bf16_reference``)
      :func:`~hyper_parallel.testing.bf16.assert_matches_bf16_reference`, loss included;
      ``"bf16_near_exact"`` :func:`~hyper_parallel.testing.bf16.assert_bf16_gradients_near_exact`
      at the parallel model's weights (Inductor's rounding); a callable ``grads(record)`` checks
      them itself; ``None`` compares none.
    bf16 reference:
      ``bf16_reference=True``: ``reference`` is the fp32 master; each step a bf16 copy of it
      (``record.compute``) runs forward and backward on the whole batch, the parallel gradients must
      be fp32, ``"close"`` compares them with the copy's (cast to fp32), and the master takes the
      optimizer step with the copy's gradients cast to fp32: FSDP2's mixed precision on one device.
    Hooks (each called with the step's :class:`StepRecord`):
      ``before_step`` before any forward; ``micro_context(record, i)`` returns a context manager (or
      None) around the parallel model's forward and backward of micro-batch ``i``; ``after_backward``
      after both backwards, before the comparison; ``before_optimizer`` after it; ``after_step`` after
      the optimizer step. ``what`` prefixes every message.
    """

    def __init__(self, reference: torch.nn.Module, parallel: torch.nn.Module, *, mesh=None,
                 batch: Callable[[int], Batch] | None = None, local: Callable[[Batch], Batch] | None = None,
                 optimizer: Callable[[Iterable], Any] | None = sgd(), lazy_optimizer: bool = False,
                 forward: Callable = call, loss: Callable = _default_loss, ref_forward: Callable | None = None,
                 ref_loss: Callable | None = None, backward_in_forward: bool = False,
                 forward_context: Callable[[], ContextManager] | None = None,
                 micro_batches: int = 1, reference_micro_batches: int | None = None,
                 split: Callable[[Batch, int], list] = chunks, scale_micro_losses: bool = True,
                 rtol: float | None = None, atol: float | None = None, loss_rtol: float | None = None,
                 loss_atol: float | None = None, check_loss: bool = True, micro_losses: bool = False,
                 grads: Any = _DEFAULT, bf16_reference: bool = False,
                 before_step: Hook | None = None, micro_context: Callable | None = None,
                 after_backward: Hook | None = None, before_optimizer: Hook | None = None,
                 after_step: Hook | None = None, what: str = ""):
        self.reference, self.parallel = reference, parallel
        self.batch = batch if batch is not None else batches()
        if local is None:
            local = (lambda b: local_batch(b, mesh)) if mesh is not None else (lambda b: b)
        self.local = local
        self.forward, self.loss = forward, loss
        self.ref_forward = ref_forward if ref_forward is not None else (call if backward_in_forward else forward)
        self.ref_loss = ref_loss if ref_loss is not None else loss
        self.backward_in_forward = backward_in_forward
        self.micro_batches, self.reference_micro_batches = micro_batches, reference_micro_batches
        self.split, self.scale_micro_losses = split, scale_micro_losses
        self.bf16_reference = bf16_reference
        if bf16_reference and reference_micro_batches not in (None, 1):
            raise ValueError("bf16_reference: the bf16 copy runs the whole batch (reference_micro_batches=1)")
        self.hooks = {"before_step": before_step, "after_backward": after_backward,
                      "before_optimizer": before_optimizer, "after_step": after_step}
        self.micro_context = micro_context
        self.what = what
        self.settings = {"rtol": rtol, "atol": atol, "loss_rtol": loss_rtol, "loss_atol": loss_atol,
                         "check_loss": check_loss, "micro_losses": micro_losses,
                         "grads": ("bf16" if bf16_reference else "close") if grads is _DEFAULT else grads,
                         "forward_context": forward_context}
        self._make_optimizer = optimizer
        self.ref_optimizer = optimizer(reference.parameters()) if optimizer is not None else None
        self.optimizer = optimizer(parallel.parameters()) if optimizer is not None and not lazy_optimizer else None
        self.records: list[StepRecord] = []
        self.current: StepRecord | None = None

    # --- running ---------------------------------------------------------------------------------

    def run(self, steps: int) -> list[StepRecord]:
        """Steps ``0 .. steps - 1`` (after any already run: their numbers continue)."""
        return [self.step() for _ in range(steps)]

    def step(self, step: int | None = None, **overrides) -> StepRecord:
        """One step: batch ``batch(step)`` (default: the number of steps run so far), both models'
        forwards and backwards, the comparison (``overrides``: any of rtol, atol, loss_rtol,
        loss_atol, check_loss, micro_losses, grads, forward_context, for this step), the optimizer
        step; the hooks between."""
        unknown = set(overrides) - set(_OVERRIDABLE)
        if unknown:
            raise TypeError(f"ParityStepper.step() cannot override {sorted(unknown)}; it can: {list(_OVERRIDABLE)}")
        settings = {**self.settings, **overrides}
        step = len(self.records) if step is None else step
        full = self.batch(step)
        micro = self.split(full, self.micro_batches) if self.micro_batches > 1 else [full]
        rec = StepRecord(step=step, batch=full, micro=micro, local=[self.local(b) for b in micro])
        self.current = rec
        self._hook("before_step", rec)
        self._parallel_step(rec, settings)
        self._reference_step(rec, settings)
        self._hook("after_backward", rec)
        self.compare(rec, **overrides)
        self._hook("before_optimizer", rec)
        self._optimizer_step(rec)
        self._hook("after_step", rec)
        if self.records:  # only the last step keeps its outputs and its bf16 copy
            self.records[-1].output = self.records[-1].ref_output = self.records[-1].compute = None
        self.records.append(rec)
        return rec

    @property
    def losses(self) -> list[float]:
        """The parallel model's loss of every step run."""
        return [r.loss.item() for r in self.records]

    @property
    def ref_losses(self) -> list[float]:
        return [r.ref_loss.item() for r in self.records]

    def _hook(self, name: str, rec: StepRecord) -> None:
        if self.hooks[name] is not None:
            self.hooks[name](rec)

    def _forward_context(self, settings) -> ContextManager:
        make = settings["forward_context"]
        return make() if make is not None else contextlib.nullcontext()

    def _run_micro(self, model, forward, loss_fn, batch, n, settings, backward: bool):
        with self._forward_context(settings):
            out = forward(model, batch)
            loss = loss_fn(out, batch)
            if self.scale_micro_losses and n > 1:
                loss = loss / n
        if backward:
            loss.backward()
        return out, loss.detach()

    def _parallel_step(self, rec: StepRecord, settings) -> None:
        n = len(rec.local)
        for i, batch in enumerate(rec.local):
            context = self.micro_context(rec, i) if self.micro_context is not None else None
            with context if context is not None else contextlib.nullcontext():
                rec.output, loss = self._run_micro(self.parallel, self.forward, self.loss, batch, n, settings,
                                                   backward=not self.backward_in_forward)
            rec.losses.append(loss)
        rec.loss = _total(rec.losses)

    def _reference_micro(self, rec: StepRecord) -> list:
        n = self.reference_micro_batches
        if n is None:
            return rec.micro
        return self.split(rec.batch, n) if n > 1 else [rec.batch]

    def _reference_step(self, rec: StepRecord, settings) -> None:
        model = self.reference
        if self.bf16_reference:
            rec.compute = model = bf16_copy(self.reference)
            rec.ref_micro = [rec.batch]
        else:
            rec.ref_micro = self._reference_micro(rec)
        for batch in rec.ref_micro:
            rec.ref_output, loss = self._run_micro(model, self.ref_forward, self.ref_loss, batch, len(rec.ref_micro),
                                                   settings, backward=True)
            rec.ref_losses.append(loss)
        rec.ref_loss = _total(rec.ref_losses)

    def _optimizer_step(self, rec: StepRecord) -> None:
        if self._make_optimizer is None:
            for model in (self.parallel, self.reference):
                model.zero_grad(set_to_none=True)
            return
        if self.bf16_reference:  # the master's fp32 step from its bf16 copy's gradients
            for p, c in zip(self.reference.parameters(), rec.compute.parameters()):
                p.grad = None if c.grad is None else c.grad.float()
        if self.optimizer is None:
            self.optimizer = self._make_optimizer(self.parallel.parameters())
        for opt in (self.optimizer, self.ref_optimizer):
            opt.step()
        for opt in (self.optimizer, self.ref_optimizer):
            opt.zero_grad()

    # --- comparing ---------------------------------------------------------------------------------

    def compare(self, rec: StepRecord, **overrides) -> None:
        """The step's comparison (called by :meth:`step`): the loss, then the gradients."""
        settings = {**self.settings, **overrides}
        what = f"{self.what} step {rec.step}" if self.what else f"step {rec.step}"
        grads = settings["grads"]
        if grads == "bf16":  # loss and gradients, the bf16 device's bound
            assert_matches_bf16_reference(self.parallel, rec.loss, rec.compute, rec.ref_loss, rec.batch, f"{what} ")
            return
        if settings["check_loss"]:
            self._compare_losses(rec, settings, what)
        if grads is None:
            return
        if callable(grads):
            grads(rec)
        elif grads == "close":
            self._compare_grads(settings, what, rec)
        elif grads == "near_exact":
            device = {n: p.grad for n, p in self.reference.named_parameters()}
            assert_gradients_near_exact(self.parallel, float64_gradients(self.reference, self._replay(rec)), device,
                                        f"{what} ")
        elif grads == "bf16_near_exact":
            assert_bf16_gradients_near_exact(self.parallel, self.reference, rec.batch, f"{what} ")
        else:
            raise ValueError(f"grads={grads!r}: one of 'close', 'near_exact', 'bf16', 'bf16_near_exact', "
                             "a callable or None")

    def _replay(self, rec: StepRecord) -> Callable[[torch.nn.Module], None]:
        """The reference's forwards and backwards of the step, for a float64 copy."""
        def run(model):
            for batch in rec.ref_micro:
                loss = self.ref_loss(self.ref_forward(model, batch), batch)
                if self.scale_micro_losses and len(rec.ref_micro) > 1:
                    loss = loss / len(rec.ref_micro)
                loss.backward()
        return run

    def _loss_tolerance(self, settings) -> dict:
        rtol, atol = settings["loss_rtol"], settings["loss_atol"]
        if rtol is None and atol is None:
            rtol, atol = (1e-2, 1e-2) if self.bf16_reference else (settings["rtol"], settings["atol"])
        return {} if rtol is None and atol is None else {"rtol": rtol, "atol": atol}

    def _compare_losses(self, rec: StepRecord, settings, what: str) -> None:
        tol = self._loss_tolerance(settings)
        pairs = [("loss", rec.loss, rec.ref_loss)]
        if settings["micro_losses"]:
            if len(rec.losses) != len(rec.ref_losses):
                raise ValueError("micro_losses: the two sides run different numbers of micro-batches")
            pairs = [(f"micro-batch {i} loss", a, b) for i, (a, b) in enumerate(zip(rec.losses, rec.ref_losses))]
        for label, got, want in pairs:
            if self.bf16_reference:
                want = want.to(got.dtype)
            torch.testing.assert_close(got, want, **tol, msg=lambda m, label=label: f"{what} {label}: {m}")

    def _compare_grads(self, settings, what: str, rec: StepRecord) -> None:
        tol = {} if settings["rtol"] is None and settings["atol"] is None else \
            {"rtol": settings["rtol"], "atol": settings["atol"]}
        source = rec.compute if self.bf16_reference else self.reference
        ref_params = dict(source.named_parameters())
        for name, p in self.parallel.named_parameters():
            ref = ref_params[name]
            if not p.requires_grad:
                assert p.grad is None and ref.grad is None, f"{what} frozen {name} got a gradient"
                continue
            assert p.grad is not None, f"{what} {name} got no gradient"
            assert ref.grad is not None, f"{what} {name} got no gradient on the reference"
            want = whole(ref.grad)
            if self.bf16_reference:
                assert p.grad.dtype == torch.float32, f"{what} grad of {name} is {p.grad.dtype}, not fp32"
                want = want.float()
            torch.testing.assert_close(whole(p.grad), want, **tol,
                                       msg=lambda m, name=name: f"{what} grad of {name}: {m}")
