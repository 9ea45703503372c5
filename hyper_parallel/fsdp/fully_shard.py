"""The FSDP2-style functional API: ``fully_shard(module, ...)``, called on each layer then on the root.

Each call is recorded on the module (nothing in its computation changes) and the module gains the
:class:`FullyShardedModule` methods (prefetch targets, ``unshard`` / ``reshard``).
:func:`collect_recorded_fully_shard` turns the recorded calls into the equivalent ``FullyShard``
plan entry (plan.py), which ``hp.parallelize(model, None, mesh)`` resolves (resolve.py).
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from .plan import FullyShard, MixedPrecisionPolicy, OffloadPolicy


_RECORD_ATTR = "_hp_fully_shard"
log = logging.getLogger(__name__)


class FullyShardedModule:
    """Methods ``hp.fully_shard`` adds to a unit module (FSDP2 / HSDPModule names).

    They record choices on the module; the parallelized root reads them when it compiles, and a
    change recompiles (once per setting)."""

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """When this unit's parameters are gathered in forward, also issue these units' gathers."""
        _check_units("set_modules_to_forward_prefetch", modules)
        self._hp_forward_prefetch = list(modules)

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """The same for backward (the units that run next in backward, i.e. earlier layers)."""
        _check_units("set_modules_to_backward_prefetch", modules)
        self._hp_backward_prefetch = list(modules)

    def unshard(self, async_op: bool = False):
        """Gather this unit's parameters for the next forward (see ParallelModule.unshard)."""
        root, fqn = self._parallel_root("unshard")
        return root._unshard_units(root._units(fqn, False, "unshard"), async_op)

    def reshard(self) -> None:
        """Free what :meth:`unshard` gathered for this unit and no forward used yet."""
        root, fqn = self._parallel_root("reshard")
        root._hp.gathered.pop(fqn, None)

    def _parallel_root(self, method: str):
        link = getattr(self, "_hp_parallel_root", None)
        root = link() if link is not None else None
        if root is None:
            raise RuntimeError(
                f"{method} needs the parallelized model: call hp.parallelize(model, None, mesh) on the "
                "root first (the unit's parameters are sharded only then)"
            )
        return root, self._hp_unit_fqn


def link_units_to_root(root: nn.Module) -> None:
    """Let each ``fully_shard`` unit of the parallelized ``root`` reach it (unshard/reshard)."""
    import weakref

    for fqn, module in root.named_modules():
        if isinstance(module, FullyShardedModule) and module is not root:
            module._hp_parallel_root = weakref.ref(root)
            module._hp_unit_fqn = fqn


def _check_units(method: str, modules) -> None:
    for m in modules:
        if not hasattr(m, _RECORD_ATTR):
            raise ValueError(
                f"{method}: {type(m).__name__} is not an FSDP unit; call hp.fully_shard on it first"
            )


def recorded_prefetch(model: nn.Module) -> dict:
    """{"forward"/"backward": {unit FQN: (unit FQNs to prefetch, ...)}} from the recorded calls."""
    fqn_of = {id(m): fqn for fqn, m in model.named_modules()}
    out: dict = {"forward": {}, "backward": {}}
    for fqn, module in model.named_modules():
        for phase in ("forward", "backward"):
            targets = getattr(module, f"_hp_{phase}_prefetch", None)
            if targets:
                out[phase][fqn] = tuple(fqn_of[id(t)] for t in targets)
    return out


def fully_shard(
    module: nn.Module,
    *,
    mesh=None,
    reshard_after_forward: bool | int = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    comm_fusion: bool = True,
    mesh_axes: tuple[str, ...] | None = None,
) -> nn.Module:
    """Mark ``module`` as an FSDP unit, the way FSDP2 is called (each layer, then the root).

    Nothing changes in the module's computation: the call is recorded and ``hp.parallelize(model,
    None, mesh)`` compiles it. Options given on the root apply to every unit unless a unit set its own
    ``reshard_after_forward``.
    """
    setattr(
        module,
        _RECORD_ATTR,
        {
            "reshard_after_forward": reshard_after_forward,
            "mixed_precision": mp_policy,
            "offload_policy": offload_policy,
            "comm_fusion": comm_fusion,
            "mesh_axes": mesh_axes,
            "mesh": mesh,
        },
    )
    if not isinstance(module, FullyShardedModule):
        cls = type(module)
        module.__class__ = type(f"FullyShard{cls.__name__}", (FullyShardedModule, cls), {})
        module.register_forward_pre_hook(_called_before_parallelize)
    return module


_warned: set[str] = set()


def _called_before_parallelize(module: nn.Module, args) -> None:
    """A unit called outside a parallelized model. Unlike FSDP2's, ``hp.fully_shard`` only marks
    units; nothing is sharded or synchronised until ``hp.parallelize``. With parameters on the meta
    device that call would fail deep inside the model: a ValueError says what to do; with real
    parameters it runs unsharded on this rank, which a warning says once."""
    from ..recompute import is_capturing

    if (is_capturing() or torch.compiler.is_compiling() or hasattr(module, "_hp")
            or getattr(module, "_hp_parallel_root", None) is not None):
        return
    name = type(module).__name__.removeprefix("FullyShard")
    if any(p.is_meta for p in module.parameters()):
        raise ValueError(
            f"{name} was marked with hp.fully_shard and is called before hp.parallelize, with its "
            "parameters on the meta device. hp.fully_shard only marks FSDP units (nothing is sharded "
            "yet, unlike FSDP2's): call model = hp.parallelize(model, None, mesh) first and call the "
            "module it returns; it materialises each rank's shards"
        )
    if name not in _warned:
        _warned.add(name)
        log.warning("%s was marked with hp.fully_shard but hp.parallelize has not run: this call runs the "
                    "whole model unsharded on this rank, with no gradient synchronisation. Call "
                    "hp.parallelize(model, None, mesh) and train the module it returns", name)


def collect_recorded_fully_shard(model: nn.Module) -> FullyShard | None:
    """The FullyShard entry equivalent to the ``fully_shard`` calls recorded on ``model``."""
    marked = [(fqn, getattr(m, _RECORD_ATTR)) for fqn, m in model.named_modules() if hasattr(m, _RECORD_ATTR)]
    if not marked:
        return None
    marked.sort(key=lambda item: -item[0].count(".") - (item[0] != ""))  # innermost first
    root_args = dict(marked[-1][1])
    per_unit_reshard = {fqn: args["reshard_after_forward"] for fqn, args in marked}
    spec = FullyShard(
        units=tuple(fqn for fqn, _ in marked),
        mesh_axes=root_args["mesh_axes"],
        reshard_after_forward=root_args["reshard_after_forward"],
        mixed_precision=root_args["mixed_precision"],
        offload_policy=root_args["offload_policy"],
        comm_fusion=root_args["comm_fusion"],
    )
    object.__setattr__(spec, "_per_unit_reshard", per_unit_reshard)
    return spec
