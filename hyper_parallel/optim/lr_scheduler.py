"""Learning-rate schedules for training runs: linear warmup, then constant / linear / cosine decay or
WSD (warmup-stable-decay), as Megatron-LM's OptimizerParamScheduler computes them.

The scheduler only reads and writes ``optimizer.param_groups``, so it drives a plain torch optimizer
and any chained optimizer whose ``param_groups`` gathers the groups of several optimizers alike;
every group gets the same learning rate. It is a ``torch.optim.lr_scheduler.LRScheduler`` (``step()``,
``get_last_lr()``, ``state_dict()``/``load_state_dict()``), and its state is plain Python values, so a
run saved mid-way and resumed continues with the same learning rates.

Step ``s`` is the number of ``step()`` calls so far (0 right after construction). With ``W`` warmup
steps, ``D = int(total_steps * lr_decay_ratio)`` decay steps and ``lr_start -> lr -> lr_min``:

* ``s <= W`` (when ``W > 0``): ``lr_start + (lr - lr_start) * s / W``;
* ``constant``: ``lr`` after the warmup;
* ``s > D``: ``lr_min``;
* otherwise ``lr_min + c * (lr - lr_min)``, with ``t = (s - W) / (D - W)`` and ``c = 1 - t`` (linear)
  or ``(1 + cos(pi * t)) / 2`` (cosine); for ``WSD``, ``c = 1`` until step ``D - wsd_decay_steps``,
  then ``t`` runs from 0 to 1 over the last ``wsd_decay_steps`` steps and ``c`` is ``1 - t`` (linear),
  ``(1 + cos(pi * t)) / 2`` (cosine), ``2 * 0.5**t - 1`` (exponential) or ``1 - sqrt(t)`` (minus_sqrt).
"""

import logging
import math
from typing import Any, Optional

import torch
from torch.optim.lr_scheduler import LRScheduler

logger = logging.getLogger(__name__)

DECAY_STYLES = ("constant", "linear", "cosine", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")

# What a checkpoint records besides the step count; on load either these or the constructor's win.
_CONFIG_KEYS = ("lr", "lr_min", "lr_start", "total_steps", "warmup_steps", "decay_steps", "decay_style",
                "wsd_decay_steps", "lr_wsd_decay_style")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class HyperLRScheduler(LRScheduler):
    """Warmup + decay learning-rate schedule over every group of ``optimizer.param_groups``.

    Takes the arguments of :func:`get_hyper_lr_scheduler` (see there). ``optimizer`` needs only a
    ``param_groups`` list of dicts, so it need not be a ``torch.optim.Optimizer``; the torch base
    class's constructor (which insists on one) is therefore not called, but the attributes torch
    code reads (``optimizer``, ``base_lrs``, ``last_epoch``, ``_last_lr``, ``_step_count``) are kept.
    """

    def __init__(self, optimizer: Any, total_steps: int, warmup_steps: int = 0,
                 warmup_ratio: Optional[float] = 0.0, decay_style: str = "cosine", lr: float = 1e-4,
                 lr_min: float = 1e-7, lr_start: float = 0.0, lr_decay_ratio: float = 1.0,
                 wsd_decay_steps: Optional[int] = None, lr_wsd_decay_style: str = "exponential",
                 override_opt_param_scheduler: bool = False) -> None:
        if not isinstance(getattr(optimizer, "param_groups", None), list):
            raise TypeError(f"optimizer: {type(optimizer).__name__} has no param_groups list; pass a torch "
                            "optimizer or a chained optimizer that exposes its groups as param_groups")
        if not _is_int(total_steps) or total_steps < 1:
            raise ValueError(f"total_steps must be a positive int (the run's steps), got {total_steps!r}")
        if not _is_int(warmup_steps) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        warmup_ratio = 0.0 if warmup_ratio is None else warmup_ratio
        if not 0.0 <= warmup_ratio <= 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1] (a share of total_steps), got {warmup_ratio!r}")
        if warmup_steps > 0 and warmup_ratio > 0:
            raise ValueError(f"give either warmup_steps ({warmup_steps}) or warmup_ratio ({warmup_ratio}), "
                             "not both; set the other to 0")
        if decay_style not in DECAY_STYLES:
            raise ValueError(f"decay_style {decay_style!r} is unknown; use one of {', '.join(DECAY_STYLES)}")
        if lr_wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(f"lr_wsd_decay_style {lr_wsd_decay_style!r} is unknown; "
                             f"use one of {', '.join(WSD_DECAY_STYLES)}")
        if lr < 0 or lr_min < 0 or lr_start < 0:
            raise ValueError(f"lr ({lr}), lr_min ({lr_min}) and lr_start ({lr_start}) must all be >= 0")
        if lr_min > lr:
            raise ValueError(f"lr_min ({lr_min}) is larger than the peak lr ({lr}); lower lr_min or raise lr")
        decay_steps = int(total_steps * lr_decay_ratio)
        if not lr_decay_ratio > 0 or decay_steps < 1:
            raise ValueError(f"lr_decay_ratio ({lr_decay_ratio}) must be > 0 and leave at least one decay "
                             f"step (int(total_steps * lr_decay_ratio) = {decay_steps})")
        if warmup_ratio > 0:
            warmup_steps = int(total_steps * warmup_ratio)
        if warmup_steps > decay_steps:
            raise ValueError(f"warmup_steps ({warmup_steps}) exceeds the decay length int(total_steps * "
                             f"lr_decay_ratio) = {decay_steps}; lower warmup_steps/warmup_ratio or raise "
                             "total_steps/lr_decay_ratio")
        if decay_style == "WSD":
            room = decay_steps - warmup_steps
            if wsd_decay_steps is None:
                raise ValueError("decay_style='WSD' needs wsd_decay_steps (the length of the final decay "
                                 f"phase, 1..{room} here)")
            if not _is_int(wsd_decay_steps) or not 1 <= wsd_decay_steps <= room:
                raise ValueError(f"wsd_decay_steps ({wsd_decay_steps!r}) must be an int in [1, {room}]: the "
                                 "decay phase has to fit between the end of warmup and "
                                 "int(total_steps * lr_decay_ratio)")
        self.optimizer = optimizer
        self.lr, self.lr_min, self.lr_start = float(lr), float(lr_min), float(lr_start)
        self.total_steps, self.warmup_steps, self.decay_steps = total_steps, warmup_steps, decay_steps
        self.decay_style, self.wsd_decay_steps = decay_style, wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.base_lrs = [self.lr] * len(optimizer.param_groups)
        self.last_epoch = 0
        self._step_count = 1
        self._apply()

    def lr_at(self, step: int) -> float:
        """The learning rate this schedule gives at ``step`` (0 = before the first ``step()`` call)."""
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.lr_start + (self.lr - self.lr_start) * step / self.warmup_steps
        if self.decay_style == "constant":
            return self.lr
        if step > self.decay_steps:
            return self.lr_min
        if self.decay_style == "WSD":
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if step <= anneal_start:
                coeff = 1.0
            else:
                t = (step - anneal_start) / self.wsd_decay_steps
                style = self.lr_wsd_decay_style
                if style == "linear":
                    coeff = 1.0 - t
                elif style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * t) + 1.0)
                elif style == "exponential":
                    coeff = 2.0 * 0.5**t - 1.0
                else:  # minus_sqrt
                    coeff = 1.0 - math.sqrt(t)
        else:
            t = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
            coeff = 1.0 - t if self.decay_style == "linear" else 0.5 * (math.cos(math.pi * t) + 1.0)
        return self.lr_min + coeff * (self.lr - self.lr_min)

    def get_lr(self) -> list[float]:
        """The learning rate of every param group at the current step."""
        return [self.lr_at(self.last_epoch)] * len(self.optimizer.param_groups)

    def _apply(self) -> None:
        values = self.get_lr()
        for group, value in zip(self.optimizer.param_groups, values):
            if isinstance(group["lr"], torch.Tensor):  # capturable / fused optimizers keep lr as a tensor
                group["lr"].fill_(value)
            else:
                group["lr"] = value
        self._last_lr = values

    def step(self, epoch: Optional[int] = None) -> None:
        """Advance one step (call it after ``optimizer.step()``) and set every group's lr; ``epoch``, as in
        torch, jumps to that step instead."""
        self._step_count += 1
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """The step count and the schedule's settings, as plain Python values."""
        state = {key: getattr(self, key) for key in _CONFIG_KEYS}
        state.update(last_epoch=self.last_epoch, _step_count=self._step_count)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` and set every group's lr for the restored step.

        The step count always comes from the checkpoint. The settings (lr, warmup, decay, ...) come from
        the checkpoint too, unless this scheduler was built with ``override_opt_param_scheduler=True``:
        then its own constructor arguments win, so a resumed run can change its schedule.
        """
        for key in _CONFIG_KEYS:
            if key not in state_dict:
                continue
            ours, saved = getattr(self, key), state_dict[key]
            if ours != saved:
                winner = "constructor" if self.override_opt_param_scheduler else "checkpoint"
                logger.info("lr scheduler %s: constructor %r, checkpoint %r; using the %s's value",
                            key, ours, saved, winner)
            if not self.override_opt_param_scheduler:
                setattr(self, key, saved)
        self.last_epoch = state_dict["last_epoch"]
        self._step_count = state_dict.get("_step_count", self.last_epoch + 1)
        self._apply()


def get_hyper_lr_scheduler(optimizer: Any, total_steps: int, warmup_steps: int = 0,
                           warmup_ratio: Optional[float] = 0.0, decay_style: str = "cosine",
                           lr: float = 1e-4, lr_min: float = 1e-7, lr_start: float = 0.0,
                           lr_decay_ratio: float = 1.0, wsd_decay_steps: Optional[int] = None,
                           lr_wsd_decay_style: str = "exponential",
                           override_opt_param_scheduler: bool = False) -> HyperLRScheduler:
    """Build the learning-rate schedule of a training run and set its first lr on every param group.

    Args:
        optimizer: a torch optimizer, or a chained optimizer exposing all its groups as ``param_groups``.
        total_steps: number of training steps (``step()`` calls) of the run.
        warmup_steps: steps of linear warmup from ``lr_start`` to ``lr``.
        warmup_ratio: warmup as a fraction of ``total_steps`` (instead of ``warmup_steps``).
        decay_style: ``"constant"``, ``"linear"``, ``"cosine"`` or ``"WSD"`` (warmup-stable-decay).
        lr: peak learning rate, reached at the end of warmup; every group gets the same lr.
        lr_min: learning rate at the end of the decay, and after it.
        lr_start: learning rate at step 0 of the warmup.
        lr_decay_ratio: the decay ends after ``int(total_steps * lr_decay_ratio)`` steps; ``lr_min`` after.
        wsd_decay_steps: for ``"WSD"``, the length of the final decay phase (needed).
        lr_wsd_decay_style: shape of WSD's decay: ``"linear"``, ``"cosine"``, ``"exponential"`` or
            ``"minus_sqrt"``.
        override_opt_param_scheduler: on ``load_state_dict``, keep these arguments instead of the
            settings stored in the checkpoint (the step count is restored either way).

    Returns:
        a :class:`HyperLRScheduler`; call its ``step()`` after every ``optimizer.step()``.
    """
    return HyperLRScheduler(optimizer, total_steps, warmup_steps=warmup_steps, warmup_ratio=warmup_ratio,
                            decay_style=decay_style, lr=lr, lr_min=lr_min, lr_start=lr_start,
                            lr_decay_ratio=lr_decay_ratio, wsd_decay_steps=wsd_decay_steps,
                            lr_wsd_decay_style=lr_wsd_decay_style,
                            override_opt_param_scheduler=override_opt_param_scheduler)
