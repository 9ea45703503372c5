"""``save_pretrained`` of a parallelized ``transformers`` model: the full weights, written once.

A parallelized model's ``state_dict()`` holds DTensors (this rank's shards), which transformers'
``save_pretrained`` hands to safetensors as if they were plain tensors: it failed with "Attempted
to access the data pointer on an invalid python storage". :func:`parallelize` adds
:class:`SavePretrainedFull` to the parallel class of a model that has ``save_pretrained``, so the
call a training script ends with works unchanged: every rank calls it (the weights are gathered,
a collective), rank 0 (or the rank passing ``is_main_process=True``) writes them, and the
directory loads with ``from_pretrained`` on one device. Under a pipeline plan the stages' weights
travel to rank 0 over the pp axis (``state_dict._across_stages``).
"""

from __future__ import annotations

import torch.distributed as dist


class SavePretrainedFull:
    """Mixin placed before the model's own class: ``save_pretrained`` with gathered weights."""

    def save_pretrained(self, save_directory, *args, state_dict=None, is_main_process=None, **kwargs):
        """transformers' ``save_pretrained``, with ``state_dict`` defaulting to the full weights
        gathered to CPU (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``). Call
        it on every rank; ``is_main_process`` (default: rank 0) picks the one that writes."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        if is_main_process is None:
            is_main_process = rank == 0
        if state_dict is None:
            from ..checkpoints.state_dict import StateDictOptions, get_model_state_dict

            # Gathered on every rank, in the same order; only rank 0 keeps the tensors.
            full = get_model_state_dict(self, StateDictOptions(full_state_dict=True, cpu_offload=True))
            if is_main_process and rank != 0:
                raise ValueError(
                    f"save_pretrained(is_main_process=True) on rank {rank}: the gathered weights are "
                    "on rank 0; write from rank 0 (the default) or pass your own state_dict="
                )
            state_dict = full
        if not is_main_process:
            return None  # the other ranks only took part in the gathering
        return super().save_pretrained(save_directory, *args, state_dict=state_dict, is_main_process=True,
                                       **kwargs)
