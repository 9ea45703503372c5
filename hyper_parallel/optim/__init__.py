"""Optimizers and learning-rate schedules for parallelized models.

The parameters of a parallelized model are DTensors (local shards plus a layout); the optimizers and
schedules here work on them under every plan, as torch.optim's do, and add what the reference API
has beyond torch: Muon, chained optimizers over disjoint parameter groups, and the schedules its
training scripts use.
"""

from .lr_scheduler import HyperLRScheduler, get_hyper_lr_scheduler
from .chained import ChainedOptimizer
from .factory import AdamW, get_hyper_optimizer, split_muon_adamw_params
from .muon import Muon

__all__ = ["HyperLRScheduler", "get_hyper_lr_scheduler"]
__all__ += ["AdamW", "ChainedOptimizer", "Muon", "get_hyper_optimizer", "split_muon_adamw_params"]
