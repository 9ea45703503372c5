"""Capture: AOTAutograd's export of the joint forward+backward graph with input/output descriptors,
and module reparametrization for capture on fake tensors.

Private names: ``torch._functorch.aot_autograd.aot_export_joint_with_descriptors`` and the
descriptor classes of ``torch._functorch._aot_autograd.descriptors`` (which parameter, buffer,
tangent or gradient each placeholder and output of the joint graph is: compile/capture.py reads
the slots from them), and ``torch.nn.utils.stateless._reparametrize_module`` (the module runs on
fake parameters while captured, without being changed).
"""

from __future__ import annotations

from torch._functorch.aot_autograd import aot_export_joint_with_descriptors  # noqa: F401
from torch._functorch._aot_autograd.descriptors import (  # noqa: F401
    BufferAOTInput,
    GradAOTOutput,
    InputMutationAOTOutput,  # a value forward writes into an input (BatchNorm's running statistics)
    ParamAOTInput,
    PlainAOTInput,
    PlainAOTOutput,
    TangentAOTInput,
)
from torch.nn.utils.stateless import _reparametrize_module as reparametrize_module  # noqa: F401

__all__ = [
    "aot_export_joint_with_descriptors",
    "BufferAOTInput",
    "GradAOTOutput",
    "InputMutationAOTOutput",
    "ParamAOTInput",
    "PlainAOTInput",
    "PlainAOTOutput",
    "TangentAOTInput",
    "reparametrize_module",
]
