"""The FSDP2-style functional API: ``fully_shard(module, ...)``, called on each layer then on the root.

Each call is recorded on the module (nothing in its computation changes) and the module gains the
:class:`FullyShardedModule` methods (prefetch targets, ``unshard`` / ``reshard``, the FSDP2
switches on this unit). At ``parallelize``, :func:`link_units_to_root` connects the units to the
parallelized root and installs the mixed-precision casts at the units' boundaries.
:func:`collect_recorded_fully_shard` turns the recorded calls into the equivalent ``FullyShard``
plan entry (plan.py), which ``hp.parallelize(model, None, mesh)`` resolves (resolve.py).
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from ..compat import pytree
from .plan import FullyShard, MixedPrecisionPolicy, OffloadPolicy


_RECORD_ATTR = "_hp_fully_shard"
log = logging.getLogger(__name__)


class FullyShardedModule:
    """Methods ``hp.fully_shard`` adds to a unit module (FSDP2 / HSDPModule names).

    The prefetch targets are recorded on the module; ``unshard`` / ``reshard`` and the switches
    (``set_requires_gradient_sync`` ...) act on this unit in the parallelized root's state, so they
    need ``hp.parallelize`` first. The root reads them when it compiles, and a change recompiles
    (once per setting)."""

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
        root._hp.gathered.drop(fqn)

    # The FSDP2 switches, on this unit (and with ``recurse=True`` the units inside it), as FSDP2.
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """See ParallelModule.set_requires_gradient_sync; every unit must agree at the next forward."""
        self._set_unit_flag("set_requires_gradient_sync", "gradient_sync", requires_gradient_sync, recurse)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """See ParallelModule.set_requires_all_reduce; every unit must agree at the next forward."""
        self._set_unit_flag("set_requires_all_reduce", "all_reduce", requires_all_reduce, recurse)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """This unit's (and with ``recurse`` the units inside it) reshard_after_forward."""
        self._set_unit_flag("set_reshard_after_forward", "reshard_after_forward", reshard_after_forward, recurse)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: backward keeps this unit's gathered parameters for the next forward."""
        self._set_unit_flag("set_reshard_after_backward", "reshard_after_backward", reshard_after_backward, recurse)

    def set_reduce_op_type(self, reduce_op_type: str, *, recurse: bool = True) -> None:
        """"avg" or "sum" for this unit's gradients (see ParallelModule.set_reduce_op_type)."""
        if reduce_op_type not in ("avg", "sum"):
            raise ValueError(f"set_reduce_op_type takes 'avg' or 'sum', got {reduce_op_type!r}")
        root, _ = self._parallel_root("set_reduce_op_type")
        root._set_flag("reduce_op", reduce_op_type, self._units_here(root, "set_reduce_op_type", recurse))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """This unit's gradients: the data-parallel ranks' gradients summed, divided by ``factor``
        (FSDP2's custom divide factor; not recursive, as in FSDP2)."""
        from .methods import _check_factor

        root, _ = self._parallel_root("set_reduce_scatter_divide_factor")
        root._set_flag("divide_factor", _check_factor(factor),
                       self._units_here(root, "set_reduce_scatter_divide_factor", False))

    def set_gradient_divide_factor(self, factor: float) -> None:
        """FSDP2's newer name of :meth:`set_reduce_scatter_divide_factor`."""
        self.set_reduce_scatter_divide_factor(factor)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted, as on the root (compiled backwards never leave a reduction in flight)."""
        root, _ = self._parallel_root("set_is_last_backward")
        root.set_is_last_backward(is_last_backward)

    def _set_unit_flag(self, method: str, field: str, value, recurse: bool) -> None:
        from .methods import _check_bool

        _check_bool(method, value)
        root, _ = self._parallel_root(method)
        root._set_flag(field, value, self._units_here(root, method, recurse))

    def _units_here(self, root, method: str, recurse: bool) -> list[str]:
        return root._flag_units(method, recurse, self._hp_module_fqn)

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
    """Let each ``fully_shard`` unit of the parallelized ``root`` reach it (unshard/reshard and the
    switches), and install the mixed-precision casts at the units' boundaries (``install_casts``)."""
    import weakref

    fsdp = root._hp.resolved.fsdp
    unit_of_module = {m: u.module_fqn for u in fsdp.units for m in u.modules} if fsdp is not None else {}
    for fqn, module in root.named_modules():
        if isinstance(module, FullyShardedModule) and module is not root:
            module._hp_parallel_root = weakref.ref(root)
            module._hp_unit_fqn = unit_of_module.get(fqn, fqn)
            module._hp_module_fqn = fqn
    if fsdp is not None:
        install_casts(root, fsdp)


def install_casts(root: nn.Module, fsdp) -> None:
    """Forward hooks on each unit module whose policy casts (``cast_forward_inputs`` with a
    ``param_dtype``, ``output_dtype``), as FSDP2's: floating-point inputs to ``param_dtype``,
    floating-point outputs to ``output_dtype``. They act only while the compiler captures the
    model, so the casts are ops of the compiled program (on the root too: capture calls it)."""
    modules = dict(root.named_modules())
    for unit in fsdp.units:
        policy = unit.mixed_precision
        if policy is None or not policy.casts:
            continue
        for fqn in unit.modules:
            module = modules[fqn]
            if policy.cast_forward_inputs and policy.param_dtype is not None:
                module.register_forward_pre_hook(_cast_hook(policy.param_dtype, inputs=True), with_kwargs=True)
            if policy.output_dtype is not None:
                module.register_forward_hook(_cast_hook(policy.output_dtype, inputs=False))


def _cast_hook(dtype: torch.dtype, inputs: bool):
    from ..recompute import is_capturing

    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and torch.is_floating_point(x) else x

    def pre_hook(module, args, kwargs):
        if is_capturing():
            return pytree.tree_map(cast, (args, kwargs))
        return None

    def post_hook(module, args, output):
        if is_capturing():
            return pytree.tree_map(cast, output)
        return None

    return pre_hook if inputs else post_hook


def _check_units(method: str, modules) -> None:
    for m in modules:
        if not hasattr(m, _RECORD_ATTR):
            raise ValueError(
                f"{method}: {type(m).__name__} is not an FSDP unit; call hp.fully_shard on it first"
            )


def recorded_prefetch(model: nn.Module) -> dict:
    """{"forward"/"backward": {unit FQN: (unit FQNs to prefetch, ...)}} from the recorded calls."""
    def unit_of(module, fqn):
        return "" if module is model else getattr(module, "_hp_unit_fqn", fqn)

    fqn_of = {id(m): unit_of(m, fqn) for fqn, m in model.named_modules()}
    out: dict = {"forward": {}, "backward": {}}
    for fqn, module in model.named_modules():
        for phase in ("forward", "backward"):
            targets = getattr(module, f"_hp_{phase}_prefetch", None)
            if targets:
                out[phase][unit_of(module, fqn)] = tuple(fqn_of[id(t)] for t in targets)
    return out


# Options of other fully_shard APIs that are not taken here, with the reason and what to do.
_NOT_TAKEN = {
    "device": "the device is the mesh's: parallelize places every shard on the device its mesh computes on",
    "dp_mesh_dims": "name the data-parallel axes with mesh_axes=(replicate, shard) or pass the sub-mesh "
                    "mesh=full_mesh['dp_shard'] (HSDP: full_mesh['dp_replicate', 'dp_shard'])",
    "comm_fusion_zero_copy": "fused collectives always copy into one flat buffer here; leave it out "
                             "(comm_fusion=False gives one collective per parameter)",
}


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh=None,
    reshard_after_forward: bool | int | None = True,
    shard_placement_fn=None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params=None,
    comm_fusion: bool = True,
    mesh_axes: tuple[str, ...] | None = None,
    mixed_precision: MixedPrecisionPolicy | None = None,
    **others,
) -> nn.Module | list[nn.Module]:
    """Mark ``module`` as an FSDP unit, the way FSDP2 is called (each layer, then the root).

    Nothing changes in the module's computation: the call is recorded and ``hp.parallelize(model,
    None, mesh)`` compiles it (docs/fsdp.md, "fully_shard options"). ``module`` may be a list of
    modules: one unit over all of them (one all-gather, one reduce-scatter). ``mesh``: the
    data-parallel (sub-)mesh of parallelize's mesh to shard over (1-D: FSDP; 2-D: HSDP, replicate
    over dim 0 and shard over dim 1). ``reshard_after_forward``: True, False, an int (the group
    size to reshard to) or None (FSDP2's default: False for the root, True for the others).
    ``shard_placement_fn(param)``: ``Shard(dim)`` to store a parameter sharded on another dim, or
    None. ``mp_policy`` (or ``mixed_precision``, the other spelling): this unit's
    MixedPrecisionPolicy. ``offload_policy``: this unit's OffloadPolicy. ``ignored_params``: a set
    of parameters left out of FSDP (stored replicated, gradients all-reduced as data parallelism).
    ``comm_fusion``: one fused collective per unit (False: one per parameter). ``mesh_axes``: the
    mesh axes by name instead of ``mesh``. A unit's call that leaves ``mp_policy``,
    ``offload_policy`` or ``shard_placement_fn`` unset takes the root call's.
    """
    for name in others:
        if name in _NOT_TAKEN:
            raise TypeError(f"hp.fully_shard does not take {name}=: {_NOT_TAKEN[name]}")
        raise TypeError(
            f"hp.fully_shard got an unexpected keyword argument {name!r}; it takes mesh, "
            "reshard_after_forward, shard_placement_fn, mp_policy (or mixed_precision), offload_policy, "
            "ignored_params, comm_fusion and mesh_axes"
        )
    modules = _unit_modules(module)
    what = f"hp.fully_shard({type(modules[0]).__name__.removeprefix('FullyShard')}{', ...' if len(modules) > 1 else ''})"
    if mixed_precision is not None and mp_policy is not None and mixed_precision != mp_policy:
        raise ValueError(
            f"{what}: mp_policy={mp_policy} and mixed_precision={mixed_precision} differ; they are "
            "two spellings of one option (FSDP2's and HyperParallel's): pass one"
        )
    policy = mp_policy if mp_policy is not None else mixed_precision
    if policy is not None and not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(f"{what}: mp_policy must be an hp.MixedPrecisionPolicy, got {policy!r}")
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"{what}: offload_policy must be an hp.OffloadPolicy or hp.CPUOffloadPolicy, got {offload_policy!r}")
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(f"{what}: shard_placement_fn must be a callable (parameter -> Shard(dim) or None)")
    if not isinstance(comm_fusion, bool):
        raise TypeError(f"{what}: comm_fusion must be True or False, got {comm_fusion!r}")
    ignored = _ignored_set(ignored_params, what)
    record = {
        "modules": tuple(modules),
        "reshard_after_forward": reshard_after_forward,
        "mixed_precision": policy,
        "offload_policy": offload_policy,
        "shard_placement_fn": shard_placement_fn,
        "ignored_params": ignored,
        "comm_fusion": comm_fusion,
        "mesh_axes": mesh_axes,
        "mesh": mesh,
    }
    for m in modules:
        setattr(m, _RECORD_ATTR, record)
        if not isinstance(m, FullyShardedModule):
            cls = type(m)
            m.__class__ = type(f"FullyShard{cls.__name__}", (FullyShardedModule, cls), {})
            m.register_forward_pre_hook(_called_before_parallelize)
    return module


def _unit_modules(module) -> list[nn.Module]:
    """The module(s) of one ``fully_shard`` call; of a list, those no other one contains (FSDP2)."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(
            f"hp.fully_shard does not take a {type(module).__name__}, which has no forward (as FSDP2): pass "
            "its modules, one call each, or as a list for one unit over all of them: hp.fully_shard(list(container))"
        )
    if isinstance(module, nn.Module):
        return [module]
    if not isinstance(module, (list, tuple)) or not module or not all(isinstance(m, nn.Module) for m in module):
        raise TypeError(f"hp.fully_shard takes an nn.Module or a non-empty list of them, got {module!r}")
    modules = list(dict.fromkeys(module))
    inner = {id(s) for m in modules for s in m.modules() if s is not m}
    return [m for m in modules if id(m) not in inner]


def _ignored_set(ignored_params, what: str) -> frozenset:
    if ignored_params is None:
        return frozenset(), ()
    params = list(ignored_params) if not isinstance(ignored_params, torch.Tensor) else [ignored_params]
    for p in params:
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"{what}: ignored_params must be a set of nn.Parameter, got a {type(p).__name__}")
    return frozenset(id(p) for p in params), tuple(params)


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
    """The FullyShard entry equivalent to the ``fully_shard`` calls recorded on ``model``.

    Each call is one unit, named by its (first) module's FQN; the root call's options are the
    entry's, and each call's own are kept per unit (``_per_unit``: reshard_after_forward,
    mixed_precision, offload_policy, shard_placement_fn, ignored parameter FQNs, mesh), which
    resolve.py reads."""
    fqn_of = {id(m): fqn for fqn, m in model.named_modules()}
    records: dict[int, dict] = {}
    for _, m in model.named_modules():
        if hasattr(m, _RECORD_ATTR):
            record = getattr(m, _RECORD_ATTR)
            records.setdefault(id(record), record)
    if not records:
        return None
    marked = []
    for record in records.values():
        missing = [type(m).__name__ for m in record["modules"] if id(m) not in fqn_of]
        if missing:
            raise ValueError(
                f"hp.fully_shard was called on a list of modules, some of which ({missing}) are not "
                f"submodules of {type(model).__name__}: every module of a unit must be part of the model"
            )
        marked.append((tuple(fqn_of[id(m)] for m in record["modules"]), record))
    marked.sort(key=lambda item: -item[0][0].count(".") - (item[0][0] != ""))  # innermost first
    root_args = marked[-1][1]
    for key in ("comm_fusion", "mesh_axes"):
        values = {repr(args[key]) for _, args in marked}
        if len(values) > 1:
            raise ValueError(
                f"hp.fully_shard calls give different {key} values ({sorted(values)}); here it applies to "
                "the whole model: pass the same value to every call (or only to the root)"
            )
    param_fqns: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        param_fqns.setdefault(id(p), []).append(fqn)
    per_unit = {}
    for fqns, args in marked:
        ignored_ids, ignored_params = args["ignored_params"]
        strangers = [tuple(p.shape) for p in ignored_params if id(p) not in param_fqns]
        if strangers:
            raise ValueError(
                f"hp.fully_shard({fqns[0] or '<root>'}): ignored_params holds parameters of shapes {strangers} "
                f"that are not parameters of {type(model).__name__}"
            )
        per_unit[fqns[0]] = {
            "reshard_after_forward": args["reshard_after_forward"],
            "mixed_precision": args["mixed_precision"] or root_args["mixed_precision"],
            "offload_policy": args["offload_policy"] or root_args["offload_policy"],
            "shard_placement_fn": args["shard_placement_fn"] or root_args["shard_placement_fn"],
            "ignored_params": tuple(f for i in ignored_ids for f in param_fqns[i]),
            "mesh": args["mesh"],
        }
    spec = FullyShard(
        units=tuple(fqns[0] if len(fqns) == 1 else fqns for fqns, _ in marked),
        mesh_axes=root_args["mesh_axes"],
        reshard_after_forward=True,
        mixed_precision=root_args["mixed_precision"],
        offload_policy=root_args["offload_policy"],
        comm_fusion=root_args["comm_fusion"],
    )
    object.__setattr__(spec, "_per_unit", per_unit)
    return spec
