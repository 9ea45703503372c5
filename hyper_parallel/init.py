"""Building models without memory and materialising only this rank's shards.

A user builds the model under :func:`init_empty_weights` (every parameter and buffer on the meta
device, no memory, no random numbers drawn) and ``parallelize`` calls :func:`distribute_parameters`,
which gives every rank DTensor parameters holding only its own shards, with exactly the values a
single-device model built with the same seed would hold::

    hp.manual_seed(0)                       # same seed on every rank
    with hp.init_empty_weights():
        model = LlamaForCausalLM(cfg)       # meta: no memory
    pmodel = hp.parallelize(model, plan, mesh)
    # parameters == shards of (torch.manual_seed(0); LlamaForCausalLM(cfg)), bit for bit

How the values are reproduced (the *replay*): a model's constructor initialises its parameters by
drawing from the global CPU generator in a fixed order, so every rank re-runs those draws in the same
order, one module at a time, and keeps only its slice of each result. The replay is a schedule of
steps (``_schedule``):

1. *reset* steps. Modules are visited in registration order (``named_modules()``), which is the
   order their constructors ran. Each module with parameters or buffers of its own gets them
   materialised on CPU (``to_empty``, one module at a time) and runs its own ``reset_parameters()``
   — the ``nn.Module`` convention that ``nn.Linear``, ``nn.Embedding``, the norms ... follow in
   ``__init__``. This also recomputes non-persistent buffers that ``__init__`` computed (e.g. the
   rotary ``inv_freq``, see :class:`~hyper_parallel.models.llama.LlamaRotaryEmbedding`). A tensor
   tied to one initialised earlier (``lm_head.weight = embed_tokens.weight``) gets a scratch tensor:
   the constructor built and initialised the module's own weight before tying, so its draws must be
   consumed and the values dropped.
2. *hook* steps, for the model init hook a constructor runs after building its modules. Known
   hooks: a root ``init_weights()`` (:class:`~hyper_parallel.models.LlamaForCausalLM`, torchtitan
   style; assumed to run at the end of construction), which visits ``modules()`` and
   re-initialises the tensors not on the meta device; and transformers' ``post_init``, which each
   ``PreTrainedModel`` (nested ones included) runs at the end of its own constructor, applying its
   ``_init_weights`` children-first to the modules no nested model initialised, before tying. The
   hook is called once per module with only that module's tensors materialised (everything else
   on meta, where init ops are no-ops and draw nothing), so the draws happen in single-device
   order. A tensor the hook leaves unwritten keeps its construction value: it is rebuilt from the
   generator state saved before the module's reset step and the hook re-run on top.

A tensor's value is final after its last step. It is then split with
``distribute_tensor(t, mesh, placements, src_data_rank=None)`` (local slicing, no communication),
the shard gets its own compact storage, and the full tensor is dropped.

Memory: full tensors live in one reusable CPU buffer sized for the module owning the most bytes
directly (for the models here: one parameter, the embedding), so a rank holds its own shards plus
that buffer: ``peak <= final local bytes + largest module's bytes``, counted in :class:`InitStats`
and matching the process's RSS growth (a buffer reused, rather than a malloc/free per tensor,
avoids heap fragmentation that would otherwise keep freed memory resident). On an accelerator mesh,
one full tensor is also copied to the device transiently (as ``distribute_tensor`` does). The model
is never whole on any rank.

Assumptions, documented rather than guessed: a module's ``reset_parameters()`` initialises its own
(direct) parameters and buffers, and a constructor creates and initialises a module's own tensors
in registration order; an init hook that writes a tensor writes all of it; values come from the
CPU generator (what a model built on CPU holds). The replay draws from the global CPU generator as
it is when :func:`distribute_parameters` runs (building on meta draws nothing, so
``manual_seed(s)`` before ``init_empty_weights()`` works) and leaves it where single-device
construction would have. Ranks must have equal generator states: this is checked (a tiny object
all-gather over each mesh axis) and a mismatch is a ``ValueError``. Real (non-meta) tensors keep
their values (their draws are still replayed on scratch tensors so later meta tensors match).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = [
    "InitStats",
    "distribute_parameters",
    "init_empty_weights",
    "init_on_device",
    "manual_seed",
]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Context managers and seeding
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def init_on_device(device: Any) -> Iterator[torch.device]:
    """Create tensors (module parameters and buffers included) on ``device`` inside the block.

    ``device`` is anything ``torch.device`` accepts (``"cpu"``, ``"cuda:0"``, ``"meta"``,
    ``torch.device(...)``). Uses torch's own device context manager, so every factory call in a
    constructor (``torch.empty``, ``torch.arange`` ...) lands on ``device``; an explicit ``device=``
    argument still wins. Yields the ``torch.device``.
    """
    dev = torch.device(device)
    with dev:
        yield dev


@contextlib.contextmanager
def init_empty_weights() -> Iterator[torch.device]:
    """Build modules with every parameter and buffer on the meta device: no memory, no RNG draws.

    ``parallelize`` (through :func:`distribute_parameters`) then materialises only each rank's
    shards, with the values the same constructor would have produced on CPU from the generator
    state at that point. Seed with :func:`manual_seed` (same seed on every rank) first.
    """
    with init_on_device("meta") as dev:
        yield dev


def manual_seed(seed: int) -> None:
    """Seed torch's CPU generator and every accelerator's (CUDA, XPU, MPS, NPU) with ``seed``.

    Call it on every rank with the same seed (SPMD), as :func:`distribute_parameters` replays the
    model's initialisation from this state on each rank and checks that the states agree.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"manual_seed: seed must be an int, got {type(seed).__name__} {seed!r}")
    # torch.manual_seed covers CPU, CUDA (all devices), MPS, XPU and the privateuse1 backend,
    # which is where torch_npu registers NPU.
    torch.manual_seed(seed)
    npu = getattr(torch, "npu", None)
    if npu is not None and hasattr(npu, "manual_seed_all"):
        npu.manual_seed_all(seed)


# ---------------------------------------------------------------------------------------------
# distribute_parameters
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class InitStats:
    """What one :func:`distribute_parameters` call held on this rank (pass one as ``stats=``).

    Bytes are those this code path allocated and kept alive (full tensors being initialised, scratch
    tensors of the replay, the local shards), counted by storage size, on any device.

    * ``peak_bytes`` / ``final_bytes``: the maximum, and what is left (the local shards).
    * ``total_bytes``: the whole model (distinct tensors, global shapes); ``largest_tensor_bytes``:
      its largest parameter or buffer; ``largest_module_bytes``: the most one module owns directly
      (64-byte aligned), the size of the reusable buffer full tensors are initialised in. So
      ``peak_bytes <= final_bytes + largest_module_bytes`` (on an accelerator mesh, plus one full
      tensor's device copy).
    * ``num_materialised``: meta tensors initialised; ``num_replayed``: scratch tensors used only to
      consume random numbers; ``num_real``: tensors that were already real (distributed as given).
    * ``init_hook``: the model init hook that was replayed ("" if none).
    """

    peak_bytes: int = 0
    final_bytes: int = 0
    current_bytes: int = 0
    total_bytes: int = 0
    largest_tensor_bytes: int = 0
    largest_module_bytes: int = 0
    num_materialised: int = 0
    num_replayed: int = 0
    num_real: int = 0
    init_hook: str = ""

    def _alloc(self, nbytes: int) -> None:
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclasses.dataclass(eq=False)
class _Entry:
    """One distinct tensor of the model and every place it is registered (tied aliases)."""

    tensor: torch.Tensor
    is_param: bool
    fqns: list = dataclasses.field(default_factory=list)
    slots: list = dataclasses.field(default_factory=list)  # (module, name)
    placements: tuple = ()
    placeholder: Optional[torch.Tensor] = None
    result: Optional[torch.Tensor] = None

    @property
    def kind(self) -> str:
        return "parameter" if self.is_param else "buffer"

    def set_slots(self, value: torch.Tensor) -> None:
        for module, name in self.slots:
            _table(module, self.is_param)[name] = value


def _table(module: nn.Module, is_param: bool) -> dict:
    return module._parameters if is_param else module._buffers


def _direct_tensors(module: nn.Module) -> list:
    return [t for is_param in (True, False) for t in _table(module, is_param).values() if t is not None]


def _collect(model: nn.Module):
    """Distinct tensors (by identity, registration order), and modules in registration order."""
    entries: dict[int, _Entry] = {}
    modules: dict[int, tuple[str, nn.Module]] = {}
    slots_seen: set = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        modules.setdefault(id(module), (prefix, module))
        for is_param in (True, False):
            for name, t in _table(module, is_param).items():
                if t is None:
                    continue
                entry = entries.get(id(t))
                if entry is None:
                    entry = entries[id(t)] = _Entry(t, is_param)
                entry.fqns.append(f"{prefix}.{name}" if prefix else name)
                if (id(module), name, is_param) not in slots_seen:
                    slots_seen.add((id(module), name, is_param))
                    entry.slots.append((module, name))
    return list(entries.values()), list(modules.values())


def _resolve_placements(entry: _Entry, param_placements: dict) -> tuple:
    found = [(f, tuple(param_placements[f])) for f in entry.fqns if f in param_placements]
    if not found:
        raise ValueError(
            f"distribute_parameters: no placements for {entry.kind} '{entry.fqns[0]}' "
            f"(shape {tuple(entry.tensor.shape)}); param_placements must map every parameter and "
            "buffer FQN to one placement per mesh axis (ResolvedPlan.param_placements does)."
        )
    first_fqn, first = found[0]
    for fqn, placements in found[1:]:
        if placements != first:
            raise ValueError(
                f"distribute_parameters: tied {entry.kind} '{first_fqn}' and '{fqn}' are one tensor "
                f"but have different placements {first} and {placements}; give every alias of a "
                "tied tensor the same placements."
            )
    return first


def _module_label(fqn: str, module: nn.Module) -> str:
    return f"'{fqn}' ({type(module).__name__})" if fqn else f"<root> ({type(module).__name__})"


def _has_reset(module: nn.Module) -> bool:
    return callable(getattr(module, "reset_parameters", None))


@dataclasses.dataclass
class _Step:
    """One step of the replayed construction: ``reset`` (the module's own ``reset_parameters()``,
    as its constructor ran it) or ``hook`` (a model init hook applied to this module)."""

    kind: str  # "reset" | "hook"
    fqn: str
    module: nn.Module
    call: Optional[Callable[[], None]] = None  # hook steps


@dataclasses.dataclass
class _Schedule:
    steps: list
    hook_name: str = ""
    ties_visible: bool = True  # hooks see tied aliases as the shared tensor (tie before init)


def _is_hf_model(module: nn.Module) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
        for c in type(module).__mro__
    )


def _schedule(model: nn.Module, modules) -> _Schedule:
    """The order in which single-device construction initialised the model's tensors.

    * Every module: ``reset_parameters()`` in registration (pre-)order, as the constructors ran.
    * A root ``init_weights()`` (LlamaForCausalLM, torchtitan style), assumed to run at the end of
      construction: once more per module in ``modules()`` order (the order it visits them).
    * transformers ``PreTrainedModel``: each (sub-)model runs ``post_init`` at the end of its own
      constructor, applying its ``_init_weights`` children-first to the modules not initialised
      yet (a nested sub-model's modules were initialised by its own post_init); weights are tied
      after that, so its hook sees a tied alias's own tensor.
    """
    fqn_of = {id(m): fqn for fqn, m in modules}
    if _is_hf_model(model):
        steps: list = []
        visited: set = set()

        def unit(owner: nn.Module) -> None:
            members: list = []

            def construct(m: nn.Module) -> None:
                if id(m) in visited:
                    return
                if m is not owner and _is_hf_model(m):
                    unit(m)
                    return
                visited.add(id(m))
                members.append(m)
                steps.append(_Step("reset", fqn_of[id(m)], m))
                for child in m.children():
                    construct(child)

            construct(owner)
            member_ids = {id(m) for m in members}

            def post(m: nn.Module) -> None:
                if id(m) not in member_ids:
                    return
                member_ids.discard(id(m))
                for child in m.children():
                    post(child)
                steps.append(_Step("hook", fqn_of[id(m)], m, lambda m=m: owner._init_weights(m)))

            post(owner)

        unit(model)
        return _Schedule(steps, f"{type(model).__name__}._init_weights (transformers post_init)", False)
    steps = [_Step("reset", fqn, m) for fqn, m in modules]
    init_weights = getattr(model, "init_weights", None)
    if callable(init_weights):
        steps += [_Step("hook", fqn, m, init_weights) for fqn, m in modules]
        return _Schedule(steps, f"{type(model).__name__}.init_weights", True)
    return _Schedule(steps)


def _fill_sentinel(t: torch.Tensor) -> None:
    # Marks values no initialiser wrote: writes through ``.data`` bypass the version counter, so
    # "untouched" is "version unchanged and the sentinel still there".
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(torch.iinfo(t.dtype).min)


def _has_sentinel(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool or t.numel() == 0:
        return False
    return bool((t == torch.iinfo(t.dtype).min).all())


def _untouched(t: torch.Tensor, version: int) -> bool:
    return t._version == version and _has_sentinel(t)


def _check_rng_consistent(mesh) -> None:
    if not (dist.is_available() and dist.is_initialized()) or mesh is None:
        return
    state = torch.get_rng_state()
    digest = hashlib.sha1(bytes(state.tolist())).hexdigest()[:16]
    for axis in range(mesh.ndim):
        group = mesh.get_group(axis)
        if dist.get_world_size(group) == 1:
            continue
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, digest, group=group)
        if len(set(gathered)) > 1:
            names = mesh.mesh_dim_names or ()
            axis_name = names[axis] if axis < len(names) else axis
            raise ValueError(
                "distribute_parameters: the model has parameters on the meta device, which every "
                "rank initialises by replaying the constructor's random draws, but the ranks' CPU "
                f"generator states differ along mesh axis {axis_name!r} ({gathered}); call "
                "hp.manual_seed(seed) with the same seed on every rank right before building or "
                "parallelizing the model (and draw nothing rank-dependent from the global RNG in "
                "between)."
            )


_ALIGN = 64


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage region a tensor of ``t``'s shape and strides covers."""
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()


def _arena_bytes(tensors) -> int:
    """Room for ``tensors`` taken from an arena in any order (each start is aligned)."""
    return sum(-(-_span_bytes(t) // _ALIGN) * _ALIGN for t in tensors)


class _Arena:
    """One host buffer, reused for the full tensors of the module being initialised.

    Allocating and freeing a full tensor per module through malloc fragments the heap (glibc keeps
    the freed holes resident), so the process's RSS ends up far above the bytes actually alive; one
    buffer sized for the largest module keeps RSS equal to what :class:`InitStats` counts.
    """

    def __init__(self, nbytes: int, stats: InitStats) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.nbytes = nbytes
        self.offset = 0
        stats._alloc(nbytes)

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A CPU tensor with ``like``'s dtype, shape and strides in the buffer (own version counter)."""
        start = -(-self.offset // _ALIGN) * _ALIGN
        end = start + _span_bytes(like)
        assert end <= self.nbytes, (
            f"init arena: {end} bytes needed, {self.nbytes} held; it is sized for the largest module's own "
            "tensors, and one step takes only the tensors of one module"
        )
        self.offset = end
        t = torch.empty(0, dtype=like.dtype)
        t.set_(self.buffer.untyped_storage(), start // like.element_size(), like.shape, like.stride())
        return t

    def reset(self) -> None:
        self.offset = 0


class _Replay:
    """Materialises and distributes a model with meta tensors one module at a time (see module doc).

    While it runs, every slot of the model holds a meta placeholder (the original meta tensor, or a
    meta twin of a real one) except the tensors of the module being initialised, so init code that
    walks the whole model only touches that module. Results are installed by the caller at the end.
    """

    def __init__(self, entries, schedule: _Schedule, mesh, stats: InitStats):
        self.entries = entries
        self.schedule = schedule
        self.mesh = mesh
        self.stats = stats
        self.arena: Optional[_Arena] = None
        self.hooked_modules = {id(s.module) for s in schedule.steps if s.kind == "hook"}
        self.pre_state: dict[int, torch.Tensor] = {}  # module id -> CPU generator state before its reset
        self.constructed: set = set()  # entries whose construction (first reset) was replayed
        self.hooked: set = set()  # entries whose final value was produced by a hook step
        self.slot_entry: dict[tuple, _Entry] = {}
        for entry in entries:
            for module, name in entry.slots:
                self.slot_entry[(id(module), name, entry.is_param)] = entry

    # -- helpers ---------------------------------------------------------------------------------

    def _direct(self, module: nn.Module) -> list:
        return [
            (name, self.slot_entry[(id(module), name, is_param)])
            for is_param in (True, False)
            for name, t in _table(module, is_param).items()
            if t is not None
        ]

    def _empty(self, entry: _Entry, sentinel: bool) -> torch.Tensor:
        t = self.arena.take(entry.tensor)
        if sentinel:
            _fill_sentinel(t)
        if entry.is_param:
            t = nn.Parameter(t, requires_grad=entry.tensor.requires_grad)
        return t

    def _scratch(self, module: nn.Module, aliases) -> list:
        """Give ``module`` its own throw-away tensor in each tied-alias slot (draws only)."""
        out = []
        for name, entry in aliases:
            t = self._empty(entry, sentinel=False)
            _table(module, entry.is_param)[name] = t
            out.append((name, entry, t))
        return out

    def _drop_scratch(self, module: nn.Module, scratch) -> None:
        for name, entry, _ in scratch:
            self.stats.num_replayed += 1
            _table(module, entry.is_param)[name] = entry.placeholder

    def _drop(self, entry: _Entry) -> None:
        entry.set_slots(entry.placeholder)
        self.stats.num_replayed += 1

    # -- the steps -------------------------------------------------------------------------------

    def run(self) -> None:
        for entry in self.entries:
            if entry.tensor.is_meta:
                entry.placeholder = entry.tensor
            else:
                meta = torch.empty_like(entry.tensor, device="meta")
                entry.placeholder = (
                    nn.Parameter(meta, requires_grad=entry.tensor.requires_grad) if entry.is_param else meta
                )
            entry.set_slots(entry.placeholder)
        self.arena = _Arena(self.stats.largest_module_bytes, self.stats)
        try:
            with torch.no_grad():
                for step in self.schedule.steps:
                    self.arena.reset()  # the previous step's tensors are sharded or dropped
                    if step.kind == "reset":
                        self._reset_step(step.fqn, step.module)
                    else:
                        self._hook_step(step.fqn, step.module, step.call)
        finally:
            self.stats._alloc(-self.arena.nbytes)
            self.arena = None
        for entry in self.entries:
            if not entry.tensor.is_meta:
                entry.result = _distribute_real(entry, self.mesh, self.stats)

    def _reset_step(self, fqn: str, module: nn.Module) -> None:
        direct = self._direct(module)
        if not direct or not _has_reset(module):
            return  # _check_initialisable: real tensors only, or a hook step covers them
        self.pre_state[id(module)] = torch.get_rng_state()
        final = id(module) not in self.hooked_modules
        owned = [(n, e) for n, e in direct if e not in self.constructed]
        aliases = [(n, e) for n, e in direct if e in self.constructed]
        temps = []
        for name, entry in owned:
            self.constructed.add(entry)
            keep = final and entry.tensor.is_meta
            t = self._empty(entry, sentinel=keep)
            entry.set_slots(t)
            temps.append((name, entry, t, keep, t._version))
        # A tied alias had its own tensor while its constructor ran (tying comes after).
        scratch = self._scratch(module, aliases)
        module.reset_parameters()
        self._drop_scratch(module, scratch)
        for name, entry, t, keep, version in temps:
            if not keep:
                self._drop(entry)
                continue
            entry.set_slots(entry.placeholder)
            if _untouched(t, version):
                raise ValueError(
                    f"distribute_parameters: {_module_label(fqn, module)}.reset_parameters() did not "
                    f"initialise its {entry.kind} '{name}' (on the meta device; no model init hook "
                    "covers the module); make reset_parameters() set every parameter and buffer the "
                    "module owns (e.g. recompute a non-persistent buffer), or build the model on a "
                    "real device."
                )
            self._finish(entry, t)

    def _hook_step(self, fqn: str, module: nn.Module, call: Callable[[], None]) -> None:
        direct = self._direct(module)
        todo = [(n, e) for n, e in direct if e not in self.hooked]
        aliases = [(n, e) for n, e in direct if e in self.hooked]
        ties_visible = self.schedule.ties_visible
        if not todo and (ties_visible or not aliases):
            return
        start_state = torch.get_rng_state()
        # With reset_parameters() an unwritten tensor is rebuilt below (version counter unchanged:
        # always correct), so only modules without one need the sentinel fill to detect it.
        can_rebuild = id(module) in self.pre_state
        temps = []
        for name, entry in todo:
            self.hooked.add(entry)
            t = self._empty(entry, sentinel=entry.tensor.is_meta and not can_rebuild)
            entry.set_slots(t)
            temps.append((name, entry, t, t._version))
        # Hooks that run before tying (transformers) see the alias's own tensor; ours see the tie.
        scratch = [] if ties_visible else self._scratch(module, aliases)
        call()
        untouched = [
            (n, e, t) for n, e, t, v in temps
            if e.tensor.is_meta and (t._version == v if can_rebuild else _untouched(t, v))
        ]
        if untouched and can_rebuild:
            # The hook left (part of) a tensor as construction made it: rebuild the construction
            # values from the module's saved generator state, then re-run the hook from its state.
            torch.set_rng_state(start_state)
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(self.pre_state[id(module)])
                construction_scratch = self._scratch(module, aliases) if ties_visible else []
                module.reset_parameters()
                self._drop_scratch(module, construction_scratch)
            call()
            untouched = []
        if untouched:
            names = ", ".join(f"'{n}'" for n, _, _ in untouched)
            raise ValueError(
                f"distribute_parameters: {_module_label(fqn, module)} has {names} on the meta device, "
                f"no reset_parameters(), and the model init hook {self.schedule.hook_name} did not initialise "
                f"{'it' if len(untouched) == 1 else 'them'}; define reset_parameters() on "
                f"{type(module).__name__} initialising its own parameters and buffers, or make the "
                "hook cover this module, or build the model on a real device."
            )
        self._drop_scratch(module, scratch)
        for name, entry, t, _ in temps:
            if entry.tensor.is_meta:
                entry.set_slots(entry.placeholder)
                self._finish(entry, t)
            else:
                self._drop(entry)

    def _finish(self, entry: _Entry, full: torch.Tensor) -> None:
        """Split ``full`` into this rank's shard, keep only the shard, drop ``full``."""
        self.stats.num_materialised += 1
        entry.result = _wrap(entry, _shard_locally(entry.placements, full, self.mesh, self.stats))


def _shard_locally(placements, full: torch.Tensor, mesh, stats: InitStats) -> DTensor:
    """This rank's shard of ``full`` (a tensor in the arena) as a DTensor with its own compact
    storage, split locally (no communication). Accounts the bytes it allocates."""
    data = full.detach()
    moved = mesh.device_type != data.device.type
    if moved:  # distribute_tensor would make the same copy of the full tensor
        data = data.to(mesh.device_type)
        stats._alloc(_nbytes(data))
    dt = distribute_tensor(data, mesh, placements, src_data_rank=None)
    local = dt.to_local()
    storage = local.untyped_storage()
    if storage.nbytes() > _nbytes(local) or storage.data_ptr() == full.untyped_storage().data_ptr():
        # A view into the arena or into a larger tensor: copy the shard out.
        local = local.clone(memory_format=torch.contiguous_format)
        dt = DTensor.from_local(local, mesh, dt.placements, run_check=False, shape=dt.shape, stride=dt.stride())
    if moved and local.untyped_storage().data_ptr() == data.untyped_storage().data_ptr():
        return dt  # replicated on the device: the copy made above is the shard
    stats._alloc(local.untyped_storage().nbytes())
    if moved:
        stats._alloc(-_nbytes(data))
    return dt


def _shard_without_data(t: torch.Tensor, placements, mesh) -> DTensor:
    """This rank's shard of a meta tensor, as a meta DTensor: shapes only (``distribute_tensor``
    would also slice and pad, ~10 ms per tensor, minutes for a 1000-rank 80-layer model)."""
    if not t.is_meta:
        return distribute_tensor(t.detach(), mesh, placements, src_data_rank=None)
    from . import compat

    local_shape, _ = compat.compute_local_shape_and_global_offset(t.shape, mesh, placements)
    local = torch.empty(local_shape, dtype=t.dtype, device="meta")
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())


def _wrap(entry: _Entry, dt: torch.Tensor) -> torch.Tensor:
    if entry.is_param:
        return nn.Parameter(dt, requires_grad=entry.tensor.requires_grad)
    return dt


def _distribute_real(entry: _Entry, mesh, stats: InitStats) -> torch.Tensor:
    stats.num_real += 1
    dt = distribute_tensor(entry.tensor.detach(), mesh, entry.placements)
    local = dt.to_local()
    if local.untyped_storage().data_ptr() != entry.tensor.untyped_storage().data_ptr():
        stats._alloc(local.untyped_storage().nbytes())
    return _wrap(entry, dt)


def _install(entry: _Entry) -> None:
    for module, name in entry.slots:
        if entry.is_param:
            module.register_parameter(name, entry.result)
        else:
            module.register_buffer(name, entry.result, persistent=name not in module._non_persistent_buffers_set)


def _check_initialisable(schedule: _Schedule) -> None:
    hooked = {id(s.module) for s in schedule.steps if s.kind == "hook"}
    for step in schedule.steps:
        module = step.module
        if step.kind != "reset" or _has_reset(module) or id(module) in hooked:
            continue  # modules a hook covers are checked after the hook ran on them
        meta = [
            name
            for is_param in (True, False)
            for name, t in _table(module, is_param).items()
            if t is not None and t.is_meta
        ]
        if meta:
            names = ", ".join(f"'{n}'" for n in meta)
            raise ValueError(
                f"distribute_parameters: module {_module_label(step.fqn, module)} has {names} on the "
                f"meta device but no way to initialise {'it' if len(meta) == 1 else 'them'}: it "
                "defines no reset_parameters() and the model has no known init hook (a root "
                "init_weights(), or transformers' _init_weights). Fix: give "
                f"{type(module).__name__} a reset_parameters() that initialises its own parameters "
                "and buffers as its __init__ does, or build the model on a real device "
                "(hp.init_on_device('cpu') instead of hp.init_empty_weights())."
            )


def distribute_parameters(
    model: nn.Module,
    param_placements: dict[str, tuple],
    mesh,
    *,
    stats: Optional[InitStats] = None,
    materialize: bool = True,
) -> None:
    """Replace every parameter and buffer of ``model`` (in place) by a DTensor on ``mesh``.

    ``param_placements`` maps each parameter/buffer FQN (tied aliases may be listed or not) to one
    torch placement per mesh axis (``Replicate()``, ``Shard(d)``, ``_StridedShard(d, split_factor=k)``).
    Parameters stay ``nn.Parameter`` (same ``requires_grad``); buffers keep their persistence. A
    tensor registered under several FQNs (tied weights) becomes one DTensor Parameter object under
    all of them.

    * Real tensors are distributed as ``distribute_tensor(t, mesh, placements)`` (rank 0's values
      are the source, as in torch).
    * Meta tensors (a model built under :func:`init_empty_weights`) are initialised by replaying
      the model's construction module by module and split locally, so each rank only ever holds its
      shards plus one module's full tensors; the values equal the single-device model built from
      the same generator state (see the module docstring for the replay and its assumptions).

    Raises ``ValueError`` naming the parameter/module and a fix when a FQN has no placements, tied
    aliases disagree, a meta module cannot be initialised (no ``reset_parameters()`` and no init
    hook, or an initialiser leaves a tensor unset), or the ranks' generator states differ. On error
    the model is left as it was. ``stats``, if given, is filled with the bytes this call held.

    ``materialize=False`` (planning, ``hyper_parallel.explain``): meta tensors stay on the meta
    device; each becomes a DTensor whose local tensor is its meta shard (right shapes, dtypes and
    placements, no memory, no initialisation, no communication). Real tensors are split locally.
    """
    stats = stats if stats is not None else InitStats()
    entries, modules = _collect(model)
    for entry in entries:
        entry.placements = _resolve_placements(entry, param_placements)
    if not materialize:
        for entry in entries:
            entry.result = _wrap(entry, _shard_without_data(entry.tensor, entry.placements, mesh))
            _install(entry)
        return
    stats.total_bytes = sum(_nbytes(e.tensor) for e in entries)
    stats.largest_tensor_bytes = max((_nbytes(e.tensor) for e in entries), default=0)
    stats.largest_module_bytes = max((_arena_bytes(_direct_tensors(m)) for _, m in modules), default=0)
    if not any(e.tensor.is_meta for e in entries):
        for entry in entries:
            entry.result = _distribute_real(entry, mesh, stats)
            _install(entry)
        stats.final_bytes = stats.current_bytes
        return
    schedule = _schedule(model, modules)
    stats.init_hook = schedule.hook_name
    _check_initialisable(schedule)
    _check_rng_consistent(mesh)
    replay = _Replay(entries, schedule, mesh, stats)
    done = False
    try:
        replay.run()
        done = True
    finally:
        if not done:
            for entry in entries:
                entry.set_slots(entry.tensor)
    for entry in entries:
        _install(entry)
    stats.final_bytes = stats.current_bytes
    log.debug(
        "distribute_parameters: %d materialised, %d replayed, %d real, peak %.1f MB, final %.1f MB",
        stats.num_materialised, stats.num_replayed, stats.num_real,
        stats.peak_bytes / 2**20, stats.final_bytes / 2**20,
    )
