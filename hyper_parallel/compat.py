"""Every private-torch import of hyper_parallel lives here.

A torch upgrade that moves or renames one of these is fixed in this file only. Anything imported
here is an implementation detail of torch that the compiler relies on: the joint-graph export with
descriptors, DTensor's sharding-strategy registry (our rule database), the fx partitioner, and the
fake process-group store used to simulate large meshes.
"""

from __future__ import annotations

import torch

# --- capture: joint forward+backward graph with input/output descriptors -------------------------
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors  # noqa: F401
from torch._functorch._aot_autograd.descriptors import (  # noqa: F401
    BufferAOTInput,
    GradAOTOutput,
    ParamAOTInput,
    PlainAOTInput,
    PlainAOTOutput,
    TangentAOTInput,
)
from torch._guards import detect_fake_mode  # noqa: F401
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: F401

# --- partitioning the joint graph into forward and backward programs -----------------------------
from torch._functorch.partitioners import default_partition  # noqa: F401

# --- DTensor internals: specs, schemas and the sharding-strategy registry ------------------------
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: F401
from torch.distributed.tensor._op_schema import (  # noqa: F401
    OpSchema,
    OpSpec,
    OpStrategy,
    OutputSharding,
    RuntimeSchemaInfo,
)
from torch.distributed.tensor._redistribute import redistribute_local_tensor  # noqa: F401
from torch.distributed.tensor._ops.utils import register_op_strategy  # noqa: F401


def sharding_propagator():
    """DTensor's global sharding propagator: the registry of ~1,100 aten op strategies."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


def fake_store():
    """A store for torch's ``fake`` process-group backend (meshes of any size in one process)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def group_name_of(mesh, axis_index: int) -> str:
    """The registered process-group name of one mesh axis, as functional collectives expect."""
    return mesh.get_group(axis_index).group_name
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy  # noqa: F401,E402
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: F401,E402


def dtensor_from_spec(local: torch.Tensor, spec) -> "torch.distributed.tensor.DTensor":
    """Wrap a local shard as a DTensor of ``spec`` without autograd or a consistency check."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=False)


def decompositions_for(ops) -> dict:
    """torch's own decompositions (``torch._decomp``) for the given aten ops, where it has one."""
    from torch._decomp import get_decompositions

    return get_decompositions(list(ops))
