"""Every private-torch import of hyper_parallel lives here.

A torch upgrade that moves or renames one of these is fixed in this file only. Anything imported
here is an implementation detail of torch that the compiler relies on: the joint-graph export with
descriptors, DTensor's sharding-strategy registry (our rule database), DTensor's local redistribution,
and module reparametrization for capture on fake tensors.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.utils._pytree as pytree  # noqa: F401 - flatten/unflatten of call arguments and outputs
from torch._ops import OpOverload  # noqa: F401 - the type of every torch.ops.<ns>.<op>.<overload>

# --- capture: joint forward+backward graph with input/output descriptors -------------------------
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
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: F401
from torch.fx.experimental.symbolic_shapes import (  # noqa: F401
    GuardOnDataDependentSymNode,
    ShapeEnv,
)

try:  # torch 2.13
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch 2.11/2.12 (the lent GPU machines' image) had it as size_hint
    from torch.fx.experimental.symbolic_shapes import size_hint as optimization_hint
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException  # noqa: F401

# Raised when code traced on data-dependent sizes branches on them or makes a value-sized output.
DATA_DEPENDENT_ERRORS = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)
from torch.nn.utils.stateless import _reparametrize_module as reparametrize_module  # noqa: F401


@contextlib.contextmanager
def torch_checkpoint_calls_marked(mark_region):
    """While active, ``torch.utils.checkpoint.checkpoint`` (either variant, however the caller
    imported it: transformers' ``gradient_checkpointing_enable`` binds it in a partial) runs the
    checkpointed function eagerly inside ``mark_region(selective, offload)``, a context manager
    factory; ``selective`` is True when the caller passed a ``context_fn`` (torch's selective
    checkpointing), ``offload`` when the call sits inside ``torch.autograd.graph.save_on_cpu``
    (transformers' ``activation_checkpointing_enable(offload=True)``: the inputs it saves go to host).

    ``checkpoint`` looks up ``CheckpointFunction`` (reentrant) and
    ``_checkpoint_without_reentrant_generator`` (non-reentrant: a generator resumed before and after
    the function runs) in its module at every call, so those two are what is replaced. Traced
    as-is, the non-reentrant one keeps every activation (no recompute in the joint graph) and the
    reentrant one runs the function under no_grad, which breaks capture."""
    from torch.utils import checkpoint as tc

    class _Reentrant:
        @staticmethod
        def apply(function, _preserve_rng_state, *args):
            with mark_region(False, _saved_tensors_go_to_host()):
                return function(*args)

    def _non_reentrant(_function, _preserve_rng_state=True, context_fn=tc.noop_context_fn, *_rest, **_kwargs):
        with mark_region(context_fn is not tc.noop_context_fn, _saved_tensors_go_to_host()):
            yield

    saved = tc.CheckpointFunction, tc._checkpoint_without_reentrant_generator
    tc.CheckpointFunction, tc._checkpoint_without_reentrant_generator = _Reentrant, _non_reentrant
    try:
        yield
    finally:
        tc.CheckpointFunction, tc._checkpoint_without_reentrant_generator = saved


def _saved_tensors_go_to_host() -> bool:
    """Whether the innermost saved-tensor hooks are ``save_on_cpu``'s (read while tracing too)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return top is not None and "save_on_cpu" in getattr(top[0], "__qualname__", "")

# --- DTensor internals: specs, schemas and the sharding-strategy registry ------------------------
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: F401
from torch.distributed.tensor._op_schema import (  # noqa: F401
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
)
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy  # noqa: F401
from torch.distributed.tensor._redistribute import redistribute_local_tensor  # noqa: F401
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: F401
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: F401


def sharding_propagator():
    """DTensor's global sharding propagator: the registry of ~1,100 aten op strategies."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


def select_min_cost_strategy(strategy, op_schema):
    """DTensor's own choice among an OpStrategy's candidates (least redistribution cost)."""
    from torch.distributed.tensor._sharding_prop import _select_min_cost_strategy

    return _select_min_cost_strategy(strategy, op_schema)


def wrap_with_op_strategy(op_schema):
    """An OpSchema whose DTensorSpec arguments are turned into single-candidate OpStrategies."""
    return sharding_propagator()._wrap_with_op_strategy(op_schema)


@contextlib.contextmanager
def cached_sharding_decisions(uncached_ops=frozenset()):
    """While active, DTensor's dispatch under tracing reuses its sharding decisions and
    redistribution plans wherever the sizes involved are plain integers.

    Why: lowering runs every op of the joint graph through DTensor's dispatch under ``make_fx``.
    Tracing makes DTensor bypass its caches (a schema with symbolic sizes is not hashable), so every
    op re-ran the full strategy search, each candidate priced by a shortest-path search over
    redistributions: three quarters of a small tp x cp compile. The decision for a schema of
    concrete sizes does not depend on tracing, so a cached one is the one DTensor would compute:
    op decisions come from the per-schema cache eager DTensor uses (propagation filled it for many
    of the same schemas; repeated layers repeat them), redistribution plans from a table kept for
    the duration. A schema with a symbolic size or a tensor argument, and ``uncached_ops`` (ops
    whose strategies differ between scopes), are decided afresh as before."""
    from torch.distributed.tensor import _redistribute

    propagator = sharding_propagator()
    fresh, cached = propagator.propagate_op_sharding_non_cached, propagator.propagate_op_sharding
    fresh_plan = _redistribute._gen_transform_infos_non_cached
    plans: dict = {}

    def decide(op_schema):
        if op_schema.op in uncached_ops or not _concrete(op_schema):
            return fresh(op_schema)
        return cached(op_schema)

    def plan(src_spec, dst_spec, use_graph_based_transform=None):
        if not (_concrete_spec(src_spec) and _concrete_spec(dst_spec)):
            return fresh_plan(src_spec, dst_spec, use_graph_based_transform)
        key = (src_spec, dst_spec, use_graph_based_transform)
        if key not in plans:
            plans[key] = fresh_plan(src_spec, dst_spec, use_graph_based_transform)
        return list(plans[key])

    shadowed = propagator.__dict__.get("propagate_op_sharding_non_cached")  # set by an enclosing use
    propagator.propagate_op_sharding_non_cached = decide  # shadows the method on this instance
    _redistribute._gen_transform_infos_non_cached = plan  # looked up by name at every call
    try:
        yield
    finally:
        if shadowed is None:
            del propagator.propagate_op_sharding_non_cached
        else:
            propagator.propagate_op_sharding_non_cached = shadowed
        _redistribute._gen_transform_infos_non_cached = fresh_plan


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor)


def _concrete(op_schema) -> bool:
    """Whether every size in ``op_schema`` is a plain number (it hashes by value)."""
    for leaf in pytree.tree_leaves((op_schema.args_schema, op_schema.kwargs_schema)):
        if isinstance(leaf, DTensorSpec):
            if not _concrete_spec(leaf):
                return False
        elif isinstance(leaf, _SYMBOLIC):
            return False
    return True


def _concrete_spec(spec) -> bool:
    meta = spec.tensor_meta
    return meta is not None and not any(isinstance(v, _SYMBOLIC) for v in (*meta.shape, *meta.stride))


def respec(spec, placements=None, *, mesh=None, tensor_meta=None) -> DTensorSpec:
    """``spec`` with other placements, mesh or tensor meta, reading ``_StridedShard`` as it does.

    A DTensorSpec reads a ``_StridedShard`` in one of two ways (its
    ``use_strided_shard_as_shard_order``): as the order in which mesh axes shard one dim (the
    default for a spec built from placements alone) or as a strided shard of its own (what DTensor's
    view rules produce, e.g. flattening ``[batch, heads]`` with heads sharded). A spec rebuilt from
    placements alone silently switches to the first reading, and DTensor's rules then match the
    two as different shardings (an HF GPT-2 attention backward ``bmm`` fell back to replicated).
    Every spec rebuilt from another keeps its reading here; a spec made fresh from plan placements
    gets DTensor's default."""
    placements = spec.placements if placements is None else tuple(placements)
    as_order = spec.use_strided_shard_as_shard_order
    order = spec.shard_order if not as_order and placements == spec.placements else None
    return DTensorSpec(spec.mesh if mesh is None else mesh, placements,
                       tensor_meta=spec.tensor_meta if tensor_meta is None else tensor_meta,
                       shard_order=order, use_strided_shard_as_shard_order=as_order)


def foreach_mul_(tensors: list, scalar: float) -> None:
    """``tensors[i] *= scalar`` for all of them in one call (``torch._foreach_mul_``)."""
    torch._foreach_mul_(tensors, scalar)


def dtensor_from_spec(local: torch.Tensor, spec) -> "torch.distributed.tensor.DTensor":
    """Wrap a local shard as a DTensor of ``spec`` without autograd or a consistency check."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=False)


def decompositions_for(ops) -> dict:
    """torch's own decompositions (``torch._decomp``) for the given aten ops, where it has one."""
    from torch._decomp import get_decompositions

    return get_decompositions(list(ops))


def spec_of(dt) -> DTensorSpec:
    """A DTensor's spec (mesh, placements, global tensor meta)."""
    return dt._spec


def local_of(dt) -> torch.Tensor:
    """A DTensor's local shard, without going through autograd (``to_local`` is differentiable)."""
    return dt._local_tensor


def clear_propagation_caches() -> None:
    """Forget DTensor's cached sharding decisions per op schema (Python LRU and the C++ dispatch
    cache): needed whenever the strategies an op has change."""
    sharding_propagator().propagate_op_sharding.cache_clear()
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()


def clear_sharding_caches() -> None:
    """Forget DTensor's cached sharding decisions (Python LRU and the C++ dispatch cache).

    DTensor keys those caches on a mesh's shape and axis names, not on its process groups, so a
    decision cached for one mesh can hand a later mesh of the same shape the first one's (possibly
    destroyed) groups. Called whenever a mesh is created, and by :func:`sharding_caches_for` when
    a compile lowers onto another mesh than the previous compile did.

    Also DTensor's redistribution planners and transform plans: torch keys the planner cache on a
    weak reference to the mesh but the planner holds the mesh itself, so every mesh a compile
    lowered through stays alive, and with it its process groups: destroying a gloo group then
    leaves its threads running (a test worker kept over a hundred)."""
    clear_propagation_caches()
    from torch.distributed.tensor import _collective_utils, _redistribute

    getattr(_redistribute, "clear_redistribute_planner_cache", lambda: None)()
    topology = getattr(_collective_utils, "MeshTopoInfo", None)  # cached per mesh, by its hash
    for cached in (getattr(_redistribute, "_gen_transform_infos", None), getattr(topology, "build_from_mesh", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


_LAST_LOWERED_MESH = None  # a weak reference to the mesh the previous compile lowered onto


def sharding_caches_for(mesh) -> None:
    """Make DTensor's caches safe for a compile that lowers onto ``mesh``: cleared unless the
    previous compile lowered onto this very mesh. Two equal meshes (the same ranks, shape and axis
    names) may both be alive, created before either compiled; a decision cached for the other one
    would run this compile's collectives on that mesh's process groups, which its labels, passes
    and SPMD check do not know. Reusing the caches for the same mesh keeps repeated compiles fast."""
    import weakref

    global _LAST_LOWERED_MESH
    if _LAST_LOWERED_MESH is None or _LAST_LOWERED_MESH() is not mesh:
        clear_sharding_caches()
        _LAST_LOWERED_MESH = weakref.ref(mesh)


def unflatten_mesh_axis(mesh, axis: str, sizes: tuple[int, ...], names: tuple[str, ...]):
    """``mesh`` with ``axis`` split row-major into axes ``names`` of ``sizes`` (``DeviceMesh._unflatten``),
    creating the new axes' process groups. Collective: every rank of the mesh calls it."""
    return mesh._unflatten(axis, tuple(sizes), tuple(names))


def wait_collective(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind an async functional-collective result (waits for it); other tensors
    are returned as they are. DTensor's ``redistribute(async_op=True)`` gives such results."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def flatten_mesh(mesh, axes: tuple[str, ...], name: str):
    """The axes ``axes`` of ``mesh`` joined into one 1-D axis called ``name`` (``DeviceMesh._flatten``),
    registered on the root mesh and creating its process group. Collective: every rank calls it."""
    return mesh[tuple(axes)]._flatten(name)


def mesh_root_dim_names(mesh) -> tuple[str, ...]:
    """The axis names of the mesh ``mesh`` was sliced from (itself when it is a root)."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    return tuple(root.mesh_dim_names or ())


def flattened_mesh_over(mesh, axes: tuple[str, ...]):
    """The mesh already flattened from ``mesh``'s root over exactly the ranks of ``mesh``'s axes
    ``axes`` (in mesh order), or None: the one DTensor's redistribution would find and use to run a
    collective over those axes as one (it compares layouts, so an alias of another name counts)."""
    from torch.distributed.tensor._redistribute import _get_flattened_mesh_by_layout_impl

    names = mesh.mesh_dim_names
    return _get_flattened_mesh_by_layout_impl(mesh, tuple(names.index(a) for a in axes))


def flattened_meshes(mesh) -> dict[str, "torch.distributed.device_mesh.DeviceMesh"]:
    """``{alias: 1-D mesh}`` for every mesh ``DeviceMesh._flatten`` made from ``mesh``'s root
    (``flatten_mesh`` above; ParallelDims' ``dp`` / ``fsdp`` / ``loss``). Empty on a torch that
    keeps no such record."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    return dict(getattr(root, "_flatten_mapping", {}))


def resolve_process_group(name: str):
    """The ProcessGroup registered under ``name`` (a functional collective's group argument), or
    None when there is none."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._resolve_process_group(name)
    except Exception:  # unknown name, or a torch without the registry
        return None


def fake_store():
    """A store for torch's ``fake`` process-group backend (one process plays a rank of a large
    world; collectives are not executed)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def op_overload_name(target) -> str:
    """``"aten.mm.default"`` for an aten/custom op overload, else the callable's name."""
    if isinstance(target, torch._ops.OpOverload):
        # name() is "aten::mm" for the default overload and "aten::add.Tensor" for the others.
        name = target.name().replace("::", ".")
        return f"{name}.default" if target._overloadname == "default" else name
    return getattr(target, "__name__", str(target))


def is_mutating_op(target) -> bool:
    """Whether an op overload writes into one of its arguments."""
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def is_random_op(target) -> bool:
    """Whether an op overload draws random numbers (torch's ``nondeterministic_seeded`` tag)."""
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


# --- memory estimator and tracker (memory.py, testing/memory_tracker.py) -------------------------
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402,F401


def storage_key(t: torch.Tensor):
    """A hashable identity of a tensor's storage, equal for every view of it (held weakly)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (no autograd), any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def use_boxed_calling_convention(gm: torch.fx.GraphModule) -> None:
    """Make ``gm`` take one list of arguments and clear it on entry (aot_autograd's "boxed"
    convention), so each argument can be freed inside the graph after its last use instead of
    living until the call returns."""
    gm.graph.set_codegen(torch.fx.graph._BoxedCodeGen())
    gm.recompile()


# record_function's own enter/exit ops, as graph nodes (runtime/profiled.py): the handle enter returns
# is what exit takes.
RECORD_FUNCTION_ENTER = torch.ops.profiler._record_function_enter_new.default
RECORD_FUNCTION_EXIT = torch.ops.profiler._record_function_exit._RecordFunction


def current_mesh():
    """The mesh of the innermost ``with mesh:`` block (torch's current mesh), or None."""
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.get_current_mesh() if _mesh_resources.mesh_stack else None


def split_by_placement(placement, tensor: torch.Tensor, num_chunks: int) -> list[torch.Tensor]:
    """The pieces a ``Shard`` / ``_StridedShard`` placement cuts ``tensor`` into over ``num_chunks``
    ranks, as ``distribute_tensor`` cuts it (no padding, views where possible)."""
    pieces, _ = placement._split_tensor(tensor, num_chunks, with_padding=False, contiguous=False)
    return pieces


def allocation_events(prof) -> list[tuple[int, int, int, str, tuple[str, ...]]]:
    """Every allocator event a finished ``torch.profiler.profile(profile_memory=True)`` recorded, in
    time order: (time ns, bytes (negative: a free), address, device type, names of the ops it
    happened in, outermost first). These come from the allocators themselves, so they include
    memory that no dispatcher op returns (Inductor-generated code's buffers, ops' internal
    workspaces)."""
    from torch._C._profiler import _EventType

    events, stack = [], [(e, ()) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, within = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            events.append((event.start_time_ns, fields.alloc_size, fields.ptr, fields.device.type, within))
        else:
            stack.extend((child, within + (event.name,)) for child in event.children)
    return sorted(events, key=lambda e: e[:3])


def profiler_enabled() -> bool:
    """Whether a torch.profiler (or autograd profiler) is recording on this thread."""
    return torch.autograd.profiler._is_profiler_enabled


def graph_task_keeps_graph() -> bool:
    """Inside a backward: whether autograd keeps the graph's saved tensors for another backward
    (``retain_graph=True``), so a backward program must not write into them."""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy whose graph may be rewritten without touching ``gm`` (node meta copied shallowly),
    with ``gm``'s code generator, so its calling convention (boxed or not) too."""
    graph = torch.fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def is_boxed_call(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` uses the boxed calling convention (frees each argument after its last use)."""
    return bool(getattr(gm, "_boxed_call", False))


# --- torch.compile backend (backend.py): what Dynamo knows while it calls a backend -------------
from torch._dynamo.exc import ShortenTraceback  # noqa: E402,F401


def dynamo_translator():
    """The Dynamo instruction translator of the frame being compiled (None outside a backend call):
    its ``f_code``, ``f_locals``, value stack and output graph."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        return InstructionTranslator.current_tx()
    except AttributeError:  # thread-local not set: no frame is being compiled
        return None


def dynamo_compile_reason(tx) -> tuple[str, bool, list]:
    """Why Dynamo compiles the current graph: (reason text, whether it is a graph break, the user
    frames (``traceback.FrameSummary``) where it happened)."""
    reason = tx.output.compile_subgraph_reason
    return str(reason.reason), bool(reason.graph_break), list(reason.user_stack or ())


def dynamo_return_tensors(tx) -> list[tuple[tuple, str]]:
    """The tensors of the value the frame returns (the top of the translator's stack while Dynamo
    compiles at ``return``): one (path, graph node name) per tensor, where a path is the keys and
    indices that reach it (``("loss",)``, ``(0, 1)``, ``()`` for a bare tensor). Tuples, lists,
    dicts and dict subclasses (HF ``ModelOutput``) are walked; constants are skipped (Dynamo
    rebuilds them itself). Raises ``TypeError`` naming any other kind of value."""
    from torch._dynamo.variables import (
        BaseListVariable, ConstDictVariable, TensorVariable, UserDefinedDictVariable,
    )

    out: list[tuple[tuple, str]] = []

    def walk(vt, path):
        if isinstance(vt, TensorVariable):
            out.append((path, vt.as_proxy().node.name))
        elif isinstance(vt, UserDefinedDictVariable):
            walk(vt._base_vt, path)
        elif isinstance(vt, ConstDictVariable):
            for key, value in vt.items.items():
                walk(value, path + (key.vt.as_python_constant(),))
        elif isinstance(vt, BaseListVariable):
            for i, value in enumerate(vt.items):
                walk(value, path + (i,))
        elif not vt.is_python_constant():
            where = "".join(f"[{k!r}]" for k in path) or "the return value"
            raise TypeError(f"{where} is a {vt.python_type().__name__}")

    walk(tx.stack[-1], ())
    return out


def dynamo_guard_identity(local_name: str, index: int | None = None) -> None:
    """Make the graph being compiled valid only for the very object now bound to the frame's local
    ``local_name`` (item ``index`` of it when given: a wrapper's ``args``), an ``ID_MATCH`` guard;
    Dynamo also counts recompilations per such object."""
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._dynamo.source import GetItemSource, LocalSource

    source = LocalSource(local_name)
    if index is not None:
        source = GetItemSource(source, index)
    install_guard(source.make_guard(GuardBuilder.ID_MATCH))


def is_dynamo_entry_frame(frame) -> bool:
    """Whether a Python frame is the wrapper through which ``torch.compile``'d code is entered."""
    code = frame.f_code
    return code.co_name == "compile_wrapper" and code.co_filename.endswith(
        ("_dynamo/eval_frame.py", "_dynamo\\eval_frame.py")
    )


def count_as_compiled_frame() -> None:
    """Tell ``torch.compile(fullgraph=True)`` that this call ran compiled code: it raises when a call
    ran no compiled frame, and the parallel module's program runs outside Dynamo (backend.py)."""
    try:
        from torch._C._dynamo.eval_frame import set_fullgraph_compiled_frame_count
    except ImportError:  # torch < 2.13 (the GPU machines' 2.11) keeps no such count: nothing to tell
        return
    count = set_fullgraph_compiled_frame_count(-1)  # -1: not counting (no fullgraph call active)
    set_fullgraph_compiled_frame_count(count + 1 if count >= 0 else count)


def set_group_timeout(group, timeout) -> None:
    """Set how long collectives of an existing process group wait (gloo and NCCL)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def print_native_stacks_on_fatal_signal() -> None:
    """On SIGSEGV, SIGABRT, SIGBUS, SIGILL or SIGFPE, print every thread's C++ stack to stderr
    (c10's fatal-signal handler) before the handlers installed earlier (faulthandler's Python
    stacks) run. For worker processes, where a native crash (a gloo worker thread, glibc's heap
    checks) otherwise leaves only the Python stack of the thread that was waiting."""
    set_print = getattr(torch._C, "_set_print_stack_traces_on_fatal_signal", None)
    if set_print is not None:
        set_print(True)


def unwaited_collectives() -> int:
    """How many functional collectives this process has issued and not waited for (torch's work
    registry: a collective stays there until its ``wait_tensor``, even once its output is freed)."""
    from torch._C._distributed_c10d import _get_work_registry_size

    return _get_work_registry_size()


# --- data-dependent sizes (expert regions' all-to-all splits) -------------------------------------


def set_size_hint(size, hint: int) -> None:
    """Record the value estimates (memory, cost model) assume for an unbacked symbolic ``size``."""
    if isinstance(size, torch.SymInt) and size.node.expr.is_symbol:
        size.node.shape_env.var_to_hint_override[size.node.expr] = int(hint)


def size_hint(size) -> int:
    """A concrete int for ``size``: itself, or the hinted value of a data-dependent symbolic size."""
    if isinstance(size, torch.SymInt):
        return int(optimization_hint(size, fallback=0))
    return int(size)


@contextlib.contextmanager
def real_tensors():
    """Real tensors inside: no fake-tensor mode or proxy tracing that an enclosing compile step has
    active applies (a value the compiler computes for itself, such as a constant mask's)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        yield


def eager_strided_shard_sizes() -> None:
    """Compute ``_StridedShard``'s local sizes and offsets eagerly (idempotent).

    DTensor derives them from ``torch.arange(size)`` split and read back with ``tolist()``: integers
    in, integers out. Under lowering's ``make_fx`` over fake tensors every one of those ops is traced
    and each element read back goes through the fake-tensor dispatcher, so a sequence-sharded model
    (the flatten of ``[batch, sequence]`` gives a strided shard) took ~50 s to lower on a 2-D mesh
    instead of ~2. With plain-int sizes the computation runs outside fake mode and tracing instead;
    the result is the same integers, remembered per (placement, size, chunks, rank, mode): a long
    sequence's ``arange`` costs milliseconds, and one compile asks the same question hundreds of
    times (a third of a 1M-token context-parallel compile went there)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    original = StridedShard.local_shard_size_and_offset
    if getattr(original, "_hp_eager", False):
        return

    known: dict = {}

    def local_shard_size_and_offset(self, curr_local_size, *args, **kwargs):
        if type(curr_local_size) is not int:
            return original(self, curr_local_size, *args, **kwargs)
        key = (self.dim, self.split_factor, curr_local_size, args, tuple(sorted(kwargs.items())))
        try:
            size, offset = known[key]
        except (KeyError, TypeError):  # TypeError: an argument that is not hashable
            with unset_fake_temporarily(), disable_proxy_modes_tracing():
                size, offset = original(self, curr_local_size, *args, **kwargs)
            try:
                known[key] = (size, offset)
            except TypeError:
                return size, offset
        return size, list(offset) if isinstance(offset, list) else offset

    local_shard_size_and_offset._hp_eager = True
    local_shard_size_and_offset.__doc__ = original.__doc__
    StridedShard.local_shard_size_and_offset = local_shard_size_and_offset


# --- Inductor: kernels for the compute regions of a per-rank program (codegen/inductor.py) ------
def inductor_compile(gm: torch.fx.GraphModule, example_inputs: list):
    """Inductor's compiled form of ``gm``, an aten graph of functional ops already past autograd
    (no second trace, no decomposition of what our capture kept): a callable taking its inputs as
    one list. Random ops fall back to eager kernels (the same draws as eager).

    Inductor lowers only the op forms its decomposition table leaves (``arange.start_step``, not
    ``arange``): the graph is first re-traced through that table on fake copies of the inputs, as
    torch.compile's own autograd step would have done. The tracing context with a shape
    environment is what Inductor's on-disk graph cache needs to serve later processes."""
    from torch._guards import TracingContext, tracing
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    fakes = [fake_mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
             for x in example_inputs]
    with fake_mode:
        decomposed = make_fx(gm, decomposition_table=select_decomp_table())(*fakes)
    with config.patch(fallback_random=True), tracing(TracingContext(fake_mode)):
        return compile_fx_inner(decomposed, fakes)


def inductor_source(compiled) -> str | None:
    """The Python module Inductor generated for a compiled graph (kernels and wrapper), if kept."""
    return getattr(compiled, "source_code", None)


def inductor_cache_dir() -> str:
    """Inductor's on-disk cache directory (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def renumber_node_names(graph: torch.fx.Graph, base_of) -> None:
    """Name ``graph``'s nodes as a new graph built in their order names them: ``base_of(node)``
    numbered by a fresh namespace (fx keeps its names in the graph's private namespace)."""
    namespace = torch.fx.graph._Namespace()
    for node in graph.nodes:
        node.name = namespace.create_name(base_of(node), node)
    graph._graph_namespace = namespace


def lazy_graph_module(root, graph: torch.fx.Graph, class_name: str = "GraphModule") -> torch.fx.GraphModule:
    """A GraphModule that generates and compiles its Python code when first called or read, not
    when built (nor at each ``recompile``): a large graph that passes rewrite, or that is only
    dumped, skips code generation it does not need."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph, class_name=class_name)


def fake_empty(like: torch.Tensor, shape, dtype=None, device=None) -> torch.Tensor:
    """An empty contiguous FakeTensor in ``like``'s fake mode, of ``like``'s dtype and device unless
    given: the ``val`` of a node a pass adds. Built directly around a meta tensor, about 20× faster
    than ``torch.empty`` under the mode (a dispatch per value; passes add thousands at 70B scale);
    symbolic sizes take the dispatching way."""
    from torch._subclasses.fake_tensor import FakeTensor

    dtype, device = dtype or like.dtype, device or like.device
    if any(not isinstance(s, int) for s in shape):
        with like.fake_mode:
            return torch.empty(shape, dtype=dtype, device=device)
    return FakeTensor(like.fake_mode, torch.empty(shape, dtype=dtype, device="meta"), torch.device(device))


def create_node_unchecked(graph: torch.fx.Graph, op: str, target, args: tuple, kwargs: dict, name: str,
                          type_expr=None) -> torch.fx.Node:
    """``graph.create_node(...)`` without its walk of the arguments looking for raw SymInts (it only
    warns): for copies, whose arguments are nodes and the constants a built graph already held. The
    walk is about 40% of the cost of a node; a 32-layer compile copies tens of thousands."""
    new = graph.create_node(op, target, (), {}, name, type_expr)
    new._update_args_kwargs(args, kwargs)  # what create_node does with them, less the walk
    return new


def copy_node(graph: torch.fx.Graph, node: torch.fx.Node, arg_transform) -> torch.fx.Node:
    """``graph.node_copy(node, arg_transform)`` through :func:`create_node_unchecked`; ``meta`` is
    shared, not copied (callers that change it assign a new dict)."""
    args = torch.fx.node.map_arg(node.args, arg_transform)
    kwargs = torch.fx.node.map_arg(node.kwargs, arg_transform)
    new = create_node_unchecked(graph, node.op, node.target, args, kwargs, node.name, node.type)
    new.meta = node.meta
    return new
