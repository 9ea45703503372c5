"""State dicts and checkpoints of parallelized models: get/set with a sharded or full view, and
save/load through ``torch.distributed.checkpoint`` (DCP), which reshards on load.

After :func:`hyper_parallel.parallelize` every parameter and buffer is a DTensor holding this rank's
shard, so the *sharded* state dict is simply ``model.state_dict()``: the single-device model's keys
with DTensor values. The functions here add the views users need around it:

* :func:`get_model_state_dict` — sharded DTensors (default) or full plain tensors on every rank /
  on rank 0 only (``cpu_offload``), optionally without frozen parameters.
* :func:`set_model_state_dict` — the load path (``load_model_state_dict`` is the same function).
  Accepts, per key, a DTensor (redistributed to the parameter's placements), a full plain tensor
  (sliced locally to this rank's shard, no communication; or broadcast from rank 0 with
  ``broadcast_from_rank0``) or a plain tensor of this rank's local shard shape. Values are copied
  *into* the existing parameters, so optimizers keep referencing the same tensors.
* :func:`get_optimizer_state_dict` / :func:`set_optimizer_state_dict` — optimizer state keyed by
  parameter FQN, built on ``torch.distributed.checkpoint.state_dict``; state tensors are DTensors
  placed like their parameters.
* :func:`save_checkpoint` / :func:`load_checkpoint` — DCP save/load of the sharded state dicts, so a
  checkpoint written on N ranks loads on M ranks with another mesh or plan; atomic and checksummed
  (in :mod:`hyper_parallel.checkpoints.io`, which builds on this module).
"""

from __future__ import annotations

import contextlib

import dataclasses
from typing import Any, Mapping, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import state_dict as torch_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = [
    "IncompatibleKeys",
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "load_model_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
]


@dataclasses.dataclass(frozen=True)
class StateDictOptions:
    """How state dicts are produced and consumed.

    - ``full_state_dict``: get returns full (unsharded) plain tensors instead of DTensors; set
      expects full tensors (it also accepts DTensors and local shards regardless of this flag).
    - ``cpu_offload``: get moves tensors to CPU; with ``full_state_dict`` only rank 0 gets the
      tensors and every other rank an empty dict (the gather still runs on all ranks).
    - ``ignore_frozen_params``: get leaves out parameters with ``requires_grad=False``; set does not
      require them.
    - ``broadcast_from_rank0``: set reads the values on rank 0 only and broadcasts them (other ranks
      may pass an empty dict); needs ``full_state_dict=True``.
    - ``strict``: set raises ``ValueError`` naming missing / unexpected keys.
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    broadcast_from_rank0: bool = False
    strict: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, bool):
                raise TypeError(f"StateDictOptions.{field.name} must be a bool, got {value!r}")
        if self.broadcast_from_rank0 and not self.full_state_dict:
            raise ValueError(
                "StateDictOptions(broadcast_from_rank0=True) needs full_state_dict=True: rank 0 holds "
                "full tensors that are broadcast and sharded on every rank"
            )

    def to_torch(self) -> torch_state_dict.StateDictOptions:
        """The equivalent ``torch.distributed.checkpoint.state_dict.StateDictOptions``."""
        return torch_state_dict.StateDictOptions(
            full_state_dict=self.full_state_dict,
            cpu_offload=self.cpu_offload,
            ignore_frozen_params=self.ignore_frozen_params,
            broadcast_from_rank0=self.broadcast_from_rank0,
            strict=self.strict,
        )


class IncompatibleKeys(NamedTuple):
    """What :func:`set_model_state_dict` did not load (only non-empty when ``strict=False``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _options(options) -> StateDictOptions:
    if options is None:
        return StateDictOptions()
    if isinstance(options, StateDictOptions):
        return options
    if isinstance(options, torch_state_dict.StateDictOptions):  # torch's class: same meaning
        return StateDictOptions(
            full_state_dict=options.full_state_dict,
            cpu_offload=options.cpu_offload,
            ignore_frozen_params=options.ignore_frozen_params,
            broadcast_from_rank0=options.broadcast_from_rank0,
            strict=options.strict,
        )
    raise TypeError(f"options must be a hyper_parallel.StateDictOptions or None, got {type(options).__name__}")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _frozen_keys(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """State-dict key -> the live parameter / buffer tensor it loads into."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    return targets


def _describe(t: torch.Tensor) -> str:
    if isinstance(t, DTensor):
        return f"placements {tuple(t.placements)} on mesh {t.device_mesh.mesh_dim_names}"
    return "a plain tensor"


# --------------------------------------------------------------------------------------------
# Model state dict
# --------------------------------------------------------------------------------------------


def get_model_state_dict(model: nn.Module, options: Optional[StateDictOptions] = None) -> dict[str, Any]:
    """The model's state dict with the single-device model's keys.

    ===============  ===========  ======================================================
    full_state_dict  cpu_offload  values
    ===============  ===========  ======================================================
    False            False        DTensors (this rank's shards, sharing their storage)
    False            True         DTensors whose local shards are copies on CPU
    True             False        full plain tensors on every rank
    True             True         full plain tensors on CPU on rank 0; ``{}`` elsewhere
    ===============  ===========  ======================================================

    With ``full_state_dict`` every rank must call this (each DTensor is all-gathered). Without
    ``cpu_offload`` values may share storage with the parameters (as ``model.state_dict()``'s do:
    the sharded DTensors always, full tensors of replicated parameters too); with it they are
    copies, a snapshot unaffected by later training steps.
    """
    options = _options(options)
    state = model.state_dict()
    if options.ignore_frozen_params:
        for key in _frozen_keys(model):
            state.pop(key, None)
    if options.full_state_dict:
        pipeline = getattr(getattr(model, "_hp", None), "pipeline", None)
        # Offloaded, only rank 0 keeps the result; under a pipeline it collects it from one rank
        # per stage, those on its pp line (_across_stages).
        keep = not options.cpu_offload or (_on_rank0_pp_line(model) if pipeline is not None else _rank() == 0)
        full: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, DTensor):
                value = value.full_tensor()  # a collective: every rank runs it, in the same order
            if keep:
                full[key] = _to_cpu(value) if options.cpu_offload else value
        return _across_stages(model, full, options) if pipeline is not None else full
    if options.cpu_offload:
        return {key: _offload_shard(value) for key, value in state.items()}
    return state


def _across_stages(model: nn.Module, stage_state: dict[str, Any], options: StateDictOptions) -> dict[str, Any]:
    """Under a pipeline plan a rank holds only its stages' entries (gathered whole over its stage
    mesh already): the pp ranks exchange them over the pp axis. With ``cpu_offload`` only global
    rank 0 keeps the result, so only the pp line through it sends (one rank per stage); without it
    every pp line exchanges, and every rank gets every entry, in pp rank order."""
    group = model._hp.pipeline.pp_group
    if options.cpu_offload:
        if not _on_rank0_pp_line(model):
            return {}
        parts = [None] * dist.get_world_size(group) if _rank() == 0 else None
        dist.gather_object(stage_state, parts, group_dst=0, group=group)
        return {k: v for part in parts for k, v in part.items()} if _rank() == 0 else {}
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, stage_state, group=group)
    return {k: v for part in parts for k, v in part.items()}


def _on_rank0_pp_line(model: nn.Module) -> bool:
    """Whether this rank's stage-mesh coordinates are all 0, as global rank 0's are."""
    return not any(model._hp.mesh.get_coordinate() or ())


def _to_cpu(value: Any) -> Any:
    # Always a copy, also when the tensor is already on CPU: an offloaded state dict is a snapshot
    # that later training steps (which update the parameters in place) must not change.
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def _offload_shard(value: Any) -> Any:
    if isinstance(value, DTensor):
        return DTensor.from_local(
            _to_cpu(value.to_local()), value.device_mesh, value.placements,
            run_check=False, shape=value.shape, stride=value.stride(),
        )
    return _to_cpu(value)


def set_model_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any], options: Optional[StateDictOptions] = None,
) -> IncompatibleKeys:
    """Load ``state_dict`` into the model's parameters and buffers in place.

    Each value may be a DTensor (redistributed to the parameter's placements when they differ), a
    full plain tensor (sliced to this rank's shard locally, without communication), or a plain
    tensor of this rank's local shard shape (taken as the shard). With ``broadcast_from_rank0``
    only rank 0's dict is read (full tensors) and broadcast; other ranks may pass ``{}``.

    Everything is validated before anything is copied, so a bad dict leaves the model untouched.
    Raises ``ValueError`` naming missing/unexpected keys (``strict``) or a key whose shape fits
    neither the full nor the local shape; ``TypeError`` for a value that is not a tensor.
    Returns the missing and unexpected keys (empty when ``strict``).
    """
    options = _options(options)
    if options.broadcast_from_rank0 and dist.is_initialized() and dist.get_world_size() > 1:
        return _set_broadcast(model, state_dict, options)
    targets = _targets(model)
    missing, unexpected = _check_keys(model, state_dict.keys(), options)
    order = [k for k in model.state_dict() if k in state_dict and k in targets]
    for key in order:
        _check_value(key, state_dict[key], targets[key])
    with torch.no_grad():
        for key in order:  # model order: DTensor redistributions are collectives, same order on all ranks
            _copy_into(targets[key], _local_value(state_dict[key], targets[key]))
    return IncompatibleKeys(missing, unexpected)


load_model_state_dict = set_model_state_dict


def _check_keys(model: nn.Module, keys, options: StateDictOptions) -> tuple[list[str], list[str]]:
    expected = set(model.state_dict())
    optional = _frozen_keys(model) if options.ignore_frozen_params else set()
    missing = sorted(expected - set(keys) - optional)
    unexpected = sorted(set(keys) - expected)
    if options.strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected}")
        raise ValueError(
            f"set_model_state_dict for {type(model).__name__}: {'; '.join(parts)}. Keys are the "
            "single-device model's state_dict keys; pass StateDictOptions(strict=False) to load a subset."
        )
    return missing, unexpected


def _check_value(key: str, value: Any, target: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"set_model_state_dict: {key!r} is a {type(value).__name__}, expected a tensor")
    full_shape = tuple(target.shape)
    if isinstance(value, DTensor):
        if tuple(value.shape) != full_shape:
            raise ValueError(
                f"set_model_state_dict: {key!r} is a DTensor of global shape {tuple(value.shape)}, "
                f"but the parameter's global shape is {full_shape}"
            )
        return
    local_shape = tuple(target.to_local().shape) if isinstance(target, DTensor) else full_shape
    if tuple(value.shape) not in (full_shape, local_shape):
        expected = (
            f"the full shape {full_shape}"
            if local_shape == full_shape
            else f"the full shape {full_shape} or this rank's local shard shape {local_shape}"
        )
        raise ValueError(
            f"set_model_state_dict: {key!r} has shape {tuple(value.shape)}; expected {expected} "
            f"(the parameter has {_describe(target)})"
        )


def _local_value(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The tensor to copy into ``target``'s local storage (shape checked by _check_value)."""
    if not isinstance(target, DTensor):
        return value.full_tensor() if isinstance(value, DTensor) else value
    if isinstance(value, DTensor):
        if value.device_mesh == target.device_mesh:
            if tuple(value.placements) != tuple(target.placements):
                value = value.redistribute(target.device_mesh, target.placements)
            return value.to_local()
        value = value.full_tensor()  # another mesh: gather on it, then slice locally
    if tuple(value.shape) == tuple(target.shape):
        value = value.to(device=target.to_local().device)
        return distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None).to_local()
    return value  # this rank's local shard


def _copy_into(target: torch.Tensor, local: torch.Tensor) -> None:
    dst = target.to_local() if isinstance(target, DTensor) else target
    dst.copy_(local)


def _set_broadcast(model: nn.Module, state_dict: Mapping[str, Any], options: StateDictOptions) -> IncompatibleKeys:
    """broadcast_from_rank0: rank 0 validates and announces the keys, then broadcasts each tensor."""
    targets = _targets(model)
    order = [k for k in model.state_dict() if k in targets]
    header: dict[str, Any] = {"error": None, "keys": [], "missing": [], "unexpected": []}
    if _rank() == 0:
        try:
            header["missing"], header["unexpected"] = _check_keys(model, state_dict.keys(), options)
            header["keys"] = [k for k in order if k in state_dict]
            for key in header["keys"]:
                value = state_dict[key]
                if isinstance(value, DTensor):
                    raise ValueError(
                        f"set_model_state_dict(broadcast_from_rank0=True): {key!r} is a DTensor; rank 0 "
                        "must pass full plain tensors (or drop broadcast_from_rank0 to load DTensors)"
                    )
                _check_value(key, value, targets[key])
                if tuple(value.shape) != tuple(targets[key].shape):
                    raise ValueError(
                        f"set_model_state_dict(broadcast_from_rank0=True): {key!r} has shape "
                        f"{tuple(value.shape)}; expected the full shape {tuple(targets[key].shape)}"
                    )
        except (ValueError, TypeError) as exc:  # every rank raises it, so none waits in a broadcast
            header["error"] = (type(exc).__name__, str(exc))
    header = _broadcast_header(header)
    with torch.no_grad():
        for key in header["keys"]:
            target = targets[key]
            local = target.to_local() if isinstance(target, DTensor) else target
            if _rank() == 0:
                full = state_dict[key].detach().to(device=local.device, dtype=local.dtype).contiguous()
            else:
                full = torch.empty(tuple(target.shape), dtype=local.dtype, device=local.device)
            dist.broadcast(full, src=0)
            if isinstance(target, DTensor):
                full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
            local.copy_(full)
    return IncompatibleKeys(header["missing"], header["unexpected"])


# --------------------------------------------------------------------------------------------
# Optimizer state dict
# --------------------------------------------------------------------------------------------


def get_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, options: Optional[StateDictOptions] = None,
) -> dict[str, Any]:
    """``{"state": {fqn: {name: tensor}}, "param_groups": [{..., "params": [fqn, ...]}]}``.

    State tensors shaped like their parameter are DTensors placed like it (sharded default), or full
    plain tensors with ``full_state_dict`` (on rank 0 only with ``cpu_offload``). A fresh optimizer's
    state is initialised first (a zero-learning-rate step), so the dict is complete before step 1.
    """
    with _fresh_state_initialisable(optimizer):
        return torch_state_dict.get_optimizer_state_dict(model, optimizer, options=_options(options).to_torch())


def set_optimizer_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    options: Optional[StateDictOptions] = None,
) -> None:
    """Load an FQN-keyed optimizer state dict (as :func:`get_optimizer_state_dict` returns).

    Sharded (default): a DTensor state placed differently from its parameter is redistributed, and a
    plain tensor of the parameter's full shape is sliced locally (of its local shape: taken as the
    shard), so a state dict from another mesh or plan loads. ``full_state_dict`` (and
    ``broadcast_from_rank0``) follow ``torch.distributed.checkpoint.state_dict``.
    """
    options = _options(options)
    if options.full_state_dict and options.broadcast_from_rank0:
        # torch's broadcast path slices each full tensor by its own chunk arithmetic, which put the
        # parts of a strided shard (a fused projection split per part) in the wrong places: the
        # tensors are broadcast here and placed as the sharded path places them.
        state_dict = _broadcast_optimizer_state(model, state_dict)
        options = dataclasses.replace(options, full_state_dict=False, broadcast_from_rank0=False)
    elif not options.full_state_dict and "state" in state_dict:
        state_dict = dict(state_dict)
        state_dict["state"] = _place_optimizer_state(model, state_dict["state"])
    with _fresh_state_initialisable(optimizer):
        torch_state_dict.set_optimizer_state_dict(model, optimizer, state_dict, options=options.to_torch())


def _broadcast_header(header: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's ``header`` on every rank; the error rank 0 recorded in it (``"error"``: type name,
    message) raised on every rank, so none waits in a later broadcast."""
    box = [header]
    dist.broadcast_object_list(box, src=0)
    header = box[0]
    if header["error"] is not None:
        kind, message = header["error"]
        raise (TypeError if kind == "TypeError" else ValueError)(message)
    return header


def _broadcast_optimizer_state(model: nn.Module, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Rank 0's full optimizer state dict on every rank, each state tensor shaped like its parameter
    placed like it (broadcast one at a time, then sliced locally: no rank holds every full tensor
    at once); scalars (Adam's ``step``) travel with the structure."""
    header: dict[str, Any] = {"error": None}
    if _rank() == 0:
        try:
            if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state"), Mapping):
                raise ValueError("set_optimizer_state_dict(broadcast_from_rank0=True): rank 0 must pass the full "
                                 "state dict, {'state': {fqn: {name: tensor}}, 'param_groups': [...]}")
            header["param_groups"] = state_dict.get("param_groups")
            header["state"] = {fqn: {name: _broadcast_slot(fqn, name, value) for name, value in entry.items()}
                               for fqn, entry in state_dict["state"].items()}
        except (ValueError, TypeError) as exc:  # every rank raises it, so none waits in a broadcast
            header = {"error": (type(exc).__name__, str(exc))}
    header = _broadcast_header(header)
    params = dict(model.named_parameters())
    position = {fqn: i for i, fqn in enumerate(params)}
    state: dict[str, Any] = {}
    with torch.no_grad():
        for fqn in sorted(header["state"], key=lambda k: (position.get(k, len(position)), k)):
            param, entry = params.get(fqn), {}
            for name, (kind, shape, dtype, value) in header["state"][fqn].items():
                if kind == "value":
                    entry[name] = value
                    continue
                if kind == "scalar":
                    entry[name] = torch.tensor(value, dtype=dtype)
                    continue
                local = param.to_local() if isinstance(param, DTensor) else param
                device = local.device if local is not None else torch.device("cpu")
                if _rank() == 0:
                    full = state_dict["state"][fqn][name].detach().to(device=device).contiguous()
                else:
                    full = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(full, src=0)
                entry[name] = _place_like(full, param) if isinstance(param, DTensor) else full
            state[fqn] = entry
    return {"state": state, "param_groups": header["param_groups"]}


def _broadcast_slot(fqn: str, name: str, value: Any) -> tuple:
    """How one optimizer state value travels: ("tensor", shape, dtype, None), ("scalar", (), dtype,
    number) for a 0-dim tensor, or ("value", None, None, value)."""
    if isinstance(value, DTensor):
        raise ValueError(f"set_optimizer_state_dict(broadcast_from_rank0=True): state[{fqn!r}][{name!r}] is a "
                         "DTensor; rank 0 must pass full plain tensors (or drop broadcast_from_rank0)")
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return ("scalar", (), value.dtype, value.item())
        return ("tensor", tuple(value.shape), value.dtype, None)
    return ("value", None, None, value)


@contextlib.contextmanager
def _fresh_state_initialisable(optimizer: torch.optim.Optimizer):
    """Set gradients aside while torch initialises a fresh optimizer's state. torch's state-dict
    functions create the state of an optimizer that has none by a zero-learning-rate step, but skip
    it when any parameter has a gradient: the state dict would then have no state (saved without it,
    or loaded into nothing, silently). Gradients are put back afterwards."""
    if optimizer.state:
        yield
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    if all(g is None for g in grads):
        yield
        return
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def _place_optimizer_state(model: nn.Module, state: Mapping[str, Any]) -> dict[str, Any]:
    params = dict(model.named_parameters())
    position = {fqn: i for i, fqn in enumerate(params)}
    placed: dict[str, Any] = {}
    # Parameter order, not the dict's: redistributions are collectives, same order on every rank.
    for fqn in sorted(state, key=lambda k: position.get(k, len(position))):
        param, entry = params.get(fqn), state[fqn]
        if not isinstance(param, DTensor) or not isinstance(entry, Mapping):
            placed[fqn] = entry
            continue
        placed[fqn] = {name: _place_like(value, param) for name, value in entry.items()}
    return placed


def _place_like(value: Any, param: DTensor) -> Any:
    """A state tensor shaped like ``param`` as a DTensor with ``param``'s placements; else as is."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:  # scalars such as Adam's "step"
        return value
    shape = tuple(value.shape)
    is_full = shape == tuple(param.shape)
    is_local = not isinstance(value, DTensor) and shape == tuple(param.to_local().shape)
    if not (is_full or is_local):
        return value
    mesh, placements = param.device_mesh, tuple(param.placements)
    if isinstance(value, DTensor):
        if value.device_mesh == mesh:
            return value if tuple(value.placements) == placements else value.redistribute(mesh, placements)
        value = value.full_tensor()
    device = param.to_local().device
    if tuple(value.shape) == tuple(param.shape):
        return distribute_tensor(value.to(device=device), mesh, placements, src_data_rank=None)
    return DTensor.from_local(value.to(device=device), mesh, placements, run_check=False,
                              shape=param.shape, stride=param.stride())
