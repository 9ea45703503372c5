"""hyper_parallel: a graph compiler that parallelizes PyTorch training.

Write an ordinary single-device model, a declarative plan and a device mesh; ``parallelize`` returns
the same model compiled into a per-rank program whose collectives are explicit graph nodes, with the
loss and gradients one device would compute.
"""

from torch.distributed.tensor import Partial, Replicate, Shard

from . import models  # example models (hp.models.LlamaForCausalLM); transformers is imported lazily

from .api import ParallelModule, parallelize
from .fsdp import CPUOffloadPolicy, FullyShard, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from .init import init_empty_weights, init_on_device, manual_seed
from .layout import Layout, TensorLayout
from .distributed.mesh import init_device_mesh
from .custom_rules import register_sharding
from .distributed.dtensor import (
    distribute_tensor, from_local, full_tensor, get_current_mesh, get_device_num_along_axis, is_partial,
    redistribute, reduce_partial, to_local,
)
from .distributed.platform import Platform, get_platform
from .distributed.process_group import (
    destroy_process_group, get_backend, get_group_local_rank, get_process_group_ranks, init_process_group,
    mark_created_groups, split_group,
)
from .analysis.metrics import StepMeter, StepMetrics
from .optim import AdamW, ChainedOptimizer, Muon, get_hyper_lr_scheduler, get_hyper_optimizer
from .cp import AsyncContextParallel, ContextParallel, shard_sequence
from .moe import ExpertParallel, ExpertTensorParallel, ExpertWeightTensorParallel
from .distributed.parallel_dims import ParallelDims
from .pipeline import (
    BatchDimSpec, CustomSchedule, MetaStep, MetaStepType, PipelinePlan, PipelineStage, Schedule1F1B, ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from .plan import ParallelPlan, parallelize_module, shard_module
from .recompute import CheckpointPolicy, checkpoint, checkpoint_wrapper, swap, swap_wrapper
from .checkpoints.io import CheckpointError, load_checkpoint, save_checkpoint
from .tools.planner import auto_plan
from .errors import InternalError
from .checkpoints.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from .tp.styles import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

def _version() -> str:
    """The installed distribution's version (pyproject.toml), or "0+unknown" from a bare checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hyper_parallel")
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _version()

__all__ = [
    "__version__",
    "auto_plan",
    "register_sharding",
    "BatchDimSpec",
    "CustomSchedule",
    "AdamW",
    "ChainedOptimizer",
    "Muon",
    "get_hyper_lr_scheduler",
    "get_hyper_optimizer",
    "distribute_tensor",
    "from_local",
    "full_tensor",
    "get_current_mesh",
    "get_device_num_along_axis",
    "is_partial",
    "redistribute",
    "reduce_partial",
    "to_local",
    "Platform",
    "get_platform",
    "destroy_process_group",
    "get_backend",
    "get_group_local_rank",
    "get_process_group_ranks",
    "init_process_group",
    "mark_created_groups",
    "split_group",
    "StepMeter",
    "StepMetrics",
    "CheckpointError",
    "AsyncContextParallel",
    "ContextParallel",
    "shard_sequence",
    "ExpertParallel",
    "ExpertTensorParallel",
    "ExpertWeightTensorParallel",
    "CheckpointPolicy",
    "InternalError",
    "checkpoint",
    "checkpoint_wrapper",
    "swap",
    "swap_wrapper",
    "CPUOffloadPolicy",
    "FullyShard",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "fully_shard",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "load_checkpoint",
    "save_checkpoint",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "ColwiseParallel",
    "Layout",
    "ParallelDims",
    "ParallelModule",
    "ParallelPlan",
    "PipelinePlan",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "MetaStep",
    "MetaStepType",
    "ParallelStyle",
    "Partial",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "Replicate",
    "RowwiseParallel",
    "SequenceParallel",
    "StateDictOptions",
    "Shard",
    "TensorLayout",
    "init_device_mesh",
    "init_empty_weights",
    "init_on_device",
    "manual_seed",
    "parallelize",
    "parallelize_module",
    "shard_module",
]
