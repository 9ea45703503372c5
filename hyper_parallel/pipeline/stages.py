"""Hand-built pipeline stages: the seed's ``PipelineStage`` and schedule objects.

For users who cut the model themselves (each rank builds only its stage's module, torchtitan
style) instead of letting ``ParallelPlan.pipeline`` split the captured graph. The stage module is
usually one returned by ``hp.parallelize`` (tensor parallel / FSDP inside the stage, on the mesh
without the pp axis): its compiled program returns the gradients of the activations it receives,
so torch.distributed.pipelining's stage and schedule machinery runs it unchanged. These classes
keep HyperParallel's argument names (``stage_num``, ``micro_batch_num``) over torch's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed import pipelining
from torch.distributed.tensor import DTensor


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return (p.to_local() if isinstance(p, DTensor) else p).device
    return torch.device("cpu")


class PipelineStage(pipelining.PipelineStage):
    """Stage ``stage_index`` of ``stage_num``, running ``module`` on this rank. ``group``: the
    pipeline's process group (``mesh.get_group("pp")``; default: the world); ``device``: where
    activations live (default: the module's parameters' device)."""

    def __init__(self, module: nn.Module, stage_index: int, stage_num: int, *, device=None, group=None):
        hp_state = getattr(module, "_hp", None)
        if hp_state is not None and hp_state.pipeline is not None:
            raise ValueError(
                "PipelineStage takes one stage's module; this model has a ParallelPlan.pipeline already, "
                "so train it with pmodel.step(inputs, targets) instead"
            )
        if not (isinstance(stage_num, int) and stage_num >= 1 and isinstance(stage_index, int)
                and 0 <= stage_index < stage_num):
            raise ValueError(f"PipelineStage(stage_index={stage_index!r}, stage_num={stage_num!r}): need 0 <= "
                             "stage_index < stage_num")
        super().__init__(module, stage_index, stage_num, device or _device_of(module), group=group)


def _check_overlap(name: str, overlap_p2p: bool, overlap_b_f: bool) -> None:
    if overlap_p2p or overlap_b_f:
        raise ValueError(
            f"{name}(overlap_p2p=..., overlap_b_f=...) is not available for hand-built stages; the compiled "
            "pipeline (ParallelPlan.pipeline = hp.PipelinePlan(..., overlap_p2p=True)) overlaps receives"
        )


class ScheduleGPipe(pipelining.ScheduleGPipe):
    """All forwards, then all backwards, over ``micro_batch_num`` micro-batches; ``step(*inputs,
    target=...)`` as torch's schedules (the first stage gets the inputs, the last the target)."""

    def __init__(self, stage: PipelineStage, micro_batch_num: int, loss_fn=None):
        super().__init__(stage, micro_batch_num, loss_fn=loss_fn)


class Schedule1F1B(pipelining.Schedule1F1B):
    """One forward, one backward in the steady state (activation memory bounded by the depth)."""

    def __init__(self, stage: PipelineStage, micro_batch_num: int, loss_fn=None):
        super().__init__(stage, micro_batch_num, loss_fn=loss_fn)


class ScheduleInterleaved1F1B(pipelining.ScheduleInterleaved1F1B):
    """Several stages per rank (``stages``), Megatron's virtual pipeline."""

    def __init__(self, stages: list, micro_batch_num: int, *, overlap_p2p: bool = False, overlap_b_f: bool = False,
                 loss_fn=None):
        _check_overlap("ScheduleInterleaved1F1B", overlap_p2p, overlap_b_f)
        super().__init__(stages, micro_batch_num, loss_fn=loss_fn)
