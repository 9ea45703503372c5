"""Mixture-of-experts support: the ``ExpertParallel`` plan entry and the expert regions the compiler
builds from it (plan resolution in resolve.py, capture ops in region.py, layouts in propagation.py,
dispatch/combine lowering in lowering.py; docs/architecture.md §2.10)."""

from .style import ExpertParallel, ExpertTensorParallel, ExpertWeightTensorParallel

__all__ = ["ExpertParallel", "ExpertTensorParallel", "ExpertWeightTensorParallel"]
