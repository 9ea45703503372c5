"""ParallelDims: one validated set of parallel degrees, and the device mesh they describe.

A training job chooses how many ranks go to each kind of parallelism: data parallelism replicated
(``dp_replicate``, the outer dimension of HSDP) and sharded (``dp_shard``, FSDP), context (``cp``,
with an optional Ulysses sub-degree ``ulysses_degree``), tensor (``tp``), pipeline (``pp``), expert
(``ep``) and expert-tensor (``etp``) parallelism. ``ParallelDims`` checks such a choice before any
model is built, so a misconfiguration is one readable ``ValueError`` rather than a crash deep in
compilation:

* inference: ``dp_shard=-1`` takes whatever ranks the other degrees leave;
* world size: ``dp_replicate * dp_shard * cp * tp * pp * ep`` must equal it (``ep`` is its own mesh
  axis, not carved out of the data-parallel ranks; its ranks take different batch rows, so the dense
  layers are data-parallel over it, as torchtitan borrows expert-parallel ranks from data parallelism);
* degree rules: ``etp`` is ``tp`` or ``1`` when experts are parallel; ``ulysses_degree`` divides ``cp``;
* the model (:meth:`ParallelDims.validate_model`): ``tp`` divides the attention and key/value heads
  and the FFN width, ``ep`` the experts, ``cp * tp`` the sequence length, and Ulysses the heads each
  tensor-parallel rank keeps.

:meth:`ParallelDims.build_mesh` then creates the mesh: one axis per enabled degree (degree > 1), in
the canonical order :data:`MESH_AXIS_ORDER` (pipeline outermost, tensor parallelism innermost so its
ranks are neighbours), plus flattened aliases for the groups a training loop needs as a whole:
``fsdp`` (the axis FSDP shards over), ``dp`` (all ranks that take different batch rows:
``dp_replicate``, ``dp_shard`` and ``ep``) and ``loss`` (the ranks a loss or token count is reduced
over: ``dp`` and ``cp``). The base axes follow the naming of the rest of
hyper_parallel (``dp*`` axes are data parallel, ``tp`` is the tensor-parallel axis), so the mesh
goes straight into :func:`hyper_parallel.parallelize`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any, Mapping, NamedTuple

__all__ = ["MESH_AXIS_ORDER", "FlattenedAxis", "ParallelDims"]

logger = logging.getLogger(__name__)

#: Order of the mesh axes, outermost first. Only axes whose degree is > 1 are created.
MESH_AXIS_ORDER = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")

# Degrees that multiply up to the world size (etp and ulysses_degree subdivide other axes).
_PRODUCT_FIELDS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
_DEGREE_FIELDS = _PRODUCT_FIELDS + ("etp",)
_CONFIG_FIELDS = _DEGREE_FIELDS + ("ulysses_degree", "dp")

# Model-config keys read by validate_model, first present wins.
_HEADS_KEYS = ("num_attention_heads",)
_KV_HEADS_KEYS = ("num_key_value_heads",)
_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_SEQ_LEN_KEYS = ("seq_len", "max_seq_len", "max_position_embeddings")
_FFN_KEYS = ("intermediate_size",)


class FlattenedAxis(NamedTuple):
    """A flattened mesh alias: the base axes it joins (outer first) and its number of ranks."""

    sources: tuple[str, ...]
    size: int


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _format_divisors(n: int, limit: int = 24) -> str:
    divs = _divisors(n)
    if len(divs) <= limit:
        return str(divs)
    return "[" + ", ".join(map(str, divs[:limit])) + f", ...] ({len(divs)} divisors)"


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"ParallelDims.{name} must be an int, got {value!r} ({type(value).__name__}); "
            f"use 1 to disable that kind of parallelism"
        )


def _default_world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    raise ValueError(
        "ParallelDims.world_size=None means 'the size of the default process group', but "
        "torch.distributed is not initialised; call torch.distributed.init_process_group() first, "
        "or pass world_size=N to plan for N ranks"
    )


def _config_getter(config: Any):
    """A ``key -> value or None`` reader over a dict, a config object, or a module with ``.config``."""
    if isinstance(config, Mapping):
        return config.get
    from torch import nn

    if isinstance(config, nn.Module):
        if getattr(config, "config", None) is None:
            raise TypeError(
                f"validate_model got a {type(config).__name__} module without a .config; pass its "
                "config (a dict or config object with num_attention_heads, ...) instead"
            )
        return _config_getter(config.config)
    return lambda key: getattr(config, key, None)


def _read_int(get, keys: tuple[str, ...]) -> tuple[str, int] | None:
    """The first of ``keys`` present (not None) in the config, as ``(key, value)``; None if absent."""
    for key in keys:
        value = get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TypeError(
                f"model config key {key!r} must be a positive int to check parallel degrees "
                f"against it, got {value!r}"
            )
        return key, value
    return None


@dataclass(frozen=True, repr=False)
class ParallelDims:
    """Validated parallel degrees and the mesh they describe.

    Args (all ints; 1 disables that kind of parallelism):
        dp_replicate: data-parallel replication degree (the outer dimension of HSDP; DDP alone).
        dp_shard: FSDP shard degree; ``-1`` infers it as
            ``world_size // (dp_replicate * cp * tp * pp * ep)``. Only ``dp_shard`` may be -1.
        cp: context-parallel degree (the sequence is split over ``cp`` ranks).
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree (number of stages); the outermost mesh axis.
        ep: expert-parallel degree, a mesh axis of its own that multiplies into the world size.
        etp: expert tensor-parallel degree; with ``ep > 1`` it must be ``tp`` or ``1``.
        ulysses_degree: Ulysses sub-degree of ``cp`` (``cp`` must be a multiple of it); ``None``
            means all of ``cp`` is Ulysses.
        world_size: number of ranks; ``None`` takes the size of the initialised default process
            group.
        model_config: optional (keyword only) model config to check the degrees against right away;
            see :meth:`validate_model`.
        seq_len: optional (keyword only) training sequence length for that check.

    Raises ``TypeError`` for a degree that is not an int and ``ValueError`` for any rule broken; each
    message names the field, its value and what to change.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    ulysses_degree: int | None = None
    world_size: int | None = None
    _: KW_ONLY
    model_config: InitVar[Any] = None
    seq_len: InitVar[int | None] = None
    _meshes: dict = field(default=None, init=False, repr=False, compare=False)

    # ------------------------------------------------------------------ construction and checks
    def __post_init__(self, model_config: Any, seq_len: int | None) -> None:
        for name in _DEGREE_FIELDS:
            _check_int(name, getattr(self, name))
        if self.ulysses_degree is not None:
            _check_int("ulysses_degree", self.ulysses_degree)
        world_size = self.world_size
        if world_size is None:
            world_size = _default_world_size()
            object.__setattr__(self, "world_size", world_size)
        _check_int("world_size", world_size)
        if world_size < 1:
            raise ValueError(f"ParallelDims.world_size={world_size} must be a positive number of ranks")
        self._check_degrees()
        self._infer_dp_shard()
        self._check_world_size()
        self._check_expert_tp()
        self._check_ulysses()
        if model_config is not None or seq_len is not None:
            self.validate_model(model_config if model_config is not None else {}, seq_len=seq_len)

    def _check_degrees(self) -> None:
        for name in _DEGREE_FIELDS:
            value = getattr(self, name)
            if name == "dp_shard" and value == -1:
                continue
            if value == -1:
                raise ValueError(
                    f"ParallelDims.{name}=-1: only dp_shard can be inferred (-1) from the world "
                    f"size; give {name} an explicit degree (1 disables it)"
                )
            if value < 1:
                allowed = "a positive int, or -1 to infer it" if name == "dp_shard" else "a positive int"
                raise ValueError(
                    f"ParallelDims.{name}={value} is invalid: it must be {allowed} "
                    f"(1 disables that kind of parallelism)"
                )
        if self.ulysses_degree is not None and self.ulysses_degree < 1:
            raise ValueError(
                f"ParallelDims.ulysses_degree={self.ulysses_degree} is invalid: it must be a positive "
                f"int dividing cp={self.cp}, or None for all-Ulysses context parallelism"
            )

    def _others_product(self) -> str:
        """``"dp_replicate*cp*tp*pp*ep = 1*1*4*1*1 = 4"`` for messages."""
        names = [n for n in _PRODUCT_FIELDS if n != "dp_shard"]
        values = [getattr(self, n) for n in names]
        return f"{'*'.join(names)} = {'*'.join(map(str, values))} = {math.prod(values)}"

    def _infer_dp_shard(self) -> None:
        if self.dp_shard != -1:
            return
        others = math.prod(getattr(self, n) for n in _PRODUCT_FIELDS if n != "dp_shard")
        if self.world_size % others:
            raise ValueError(
                f"cannot infer dp_shard=-1: world_size={self.world_size} is not divisible by "
                f"{self._others_product()}; choose degrees whose product divides {self.world_size} "
                f"(its divisors are {_format_divisors(self.world_size)})"
            )
        object.__setattr__(self, "dp_shard", self.world_size // others)
        logger.info("ParallelDims: inferred dp_shard=%d (world_size=%d / %s)",
                    self.dp_shard, self.world_size, self._others_product())

    def _check_world_size(self) -> None:
        product = math.prod(getattr(self, n) for n in _PRODUCT_FIELDS)
        if product != self.world_size:
            terms = " * ".join(f"{n}({getattr(self, n)})" for n in _PRODUCT_FIELDS)
            raise ValueError(
                f"parallel degrees do not cover the world: {terms} = {product}, but world_size is "
                f"{self.world_size}; change the degrees so their product is {self.world_size}, or "
                f"set dp_shard=-1 to infer it"
            )

    def _check_expert_tp(self) -> None:
        if self.ep > 1 and self.etp not in (self.tp, 1):
            raise ValueError(
                f"ParallelDims.etp={self.etp} is not supported with ep={self.ep}: expert tensor "
                f"parallelism either follows dense tensor parallelism (etp=tp={self.tp}) or is off "
                f"(etp=1)"
            )

    def _check_ulysses(self) -> None:
        u = self.ulysses_degree
        if u is None or u == 1:
            return
        if u > self.cp:
            raise ValueError(
                f"ParallelDims.ulysses_degree={u} exceeds cp={self.cp}: Ulysses runs inside context "
                f"parallelism, so ulysses_degree must be <= cp; pick it from the divisors of cp "
                f"{_format_divisors(self.cp)} (or raise cp)"
            )
        if self.cp % u:
            raise ValueError(
                f"ParallelDims.cp={self.cp} is not divisible by ulysses_degree={u}: the ring part "
                f"of context parallelism is cp // ulysses_degree; pick ulysses_degree from the "
                f"divisors of cp {_format_divisors(self.cp)}"
            )

    @classmethod
    def from_config(cls, parallel_config: Any, world_size: int | None = None, **kwargs) -> "ParallelDims":
        """Build from a config object or dict with the same field names.

        A legacy single ``dp`` entry is read as ``dp_shard`` (FSDP) when ``dp_shard`` is absent;
        ``etp`` defaults to the config's ``tp``. A dict with unknown keys is rejected (a misspelled
        degree would otherwise be silently 1). ``kwargs`` (``model_config=``, ``seq_len=``) are passed
        to the constructor.
        """
        if isinstance(parallel_config, Mapping):
            unknown = sorted(set(parallel_config) - set(_CONFIG_FIELDS) - {"world_size"})
            if unknown:
                raise ValueError(
                    f"parallel config has unknown keys {unknown}; known keys are "
                    f"{list(_CONFIG_FIELDS) + ['world_size']}"
                )
            get = parallel_config.get
        else:
            def get(key, default=None):
                return getattr(parallel_config, key, default)

        dp_shard = get("dp_shard", None)
        if dp_shard is None:
            legacy_dp = get("dp", None)
            dp_shard = legacy_dp if legacy_dp is not None else 1
        tp = get("tp", 1)
        if world_size is None:
            world_size = get("world_size", None)
        return cls(
            dp_replicate=get("dp_replicate", 1),
            dp_shard=dp_shard,
            cp=get("cp", 1),
            tp=tp,
            pp=get("pp", 1),
            ep=get("ep", 1),
            etp=get("etp", tp),
            ulysses_degree=get("ulysses_degree", None),
            world_size=world_size,
            **kwargs,
        )

    # ------------------------------------------------------------------ model checks
    def validate_model(self, config: Any, seq_len: int | None = None) -> "ParallelDims":
        """Check the degrees against a model config; return ``self`` or raise one ``ValueError``.

        ``config`` is a dict, a config object (HF ``PretrainedConfig``, our ``LlamaConfig``) or a
        module carrying one as ``.config``. Keys that are absent (or None) are not checked:

        * ``num_attention_heads`` and ``num_key_value_heads``: divisible by ``tp`` (attention heads
          are split over tensor-parallel ranks, key/value heads too under GQA);
        * ``intermediate_size``: divisible by ``tp`` (the FFN width is column-sharded);
        * ``num_experts`` / ``num_local_experts`` / ``n_routed_experts``: divisible by ``ep``;
        * the sequence length (``seq_len`` argument, else ``seq_len`` / ``max_seq_len`` /
          ``max_position_embeddings``): divisible by ``cp * tp`` (context parallelism splits it,
          sequence parallelism splits each piece again);
        * with ``cp > 1``: the heads each tensor-parallel rank keeps, ``num_attention_heads // tp``,
          divisible by the Ulysses degree (``ulysses_degree``, or ``cp`` when it is None), since the
          Ulysses all-to-all trades sequence shards for head shards.

        Every broken rule is listed in the one error, each naming the degree, the config key and
        the degrees that would fit.
        """
        get = _config_getter(config)
        problems: list[str] = []

        heads = _read_int(get, _HEADS_KEYS)
        kv_heads = _read_int(get, _KV_HEADS_KEYS)
        for found, why in ((heads, "attention heads are split over tensor-parallel ranks"),
                           (kv_heads, "key/value heads are split over tensor-parallel ranks under GQA"),
                           (_read_int(get, _FFN_KEYS), "the FFN width is column-sharded")):
            if found is not None and found[1] % self.tp:
                key, value = found
                problems.append(
                    f"tp={self.tp} does not divide {key}={value} ({why}); pick tp from the "
                    f"divisors of {value}: {_format_divisors(value)}"
                )

        experts = _read_int(get, _EXPERTS_KEYS)
        if experts is not None and experts[1] % self.ep:
            key, value = experts
            problems.append(
                f"ep={self.ep} does not divide {key}={value} (each expert-parallel rank holds a "
                f"whole number of experts); pick ep from the divisors of {value}: "
                f"{_format_divisors(value)}"
            )

        if seq_len is not None:
            _check_int("validate_model(seq_len)", seq_len)
            seq = ("seq_len", seq_len)
        else:
            seq = _read_int(get, _SEQ_LEN_KEYS)
        split = self.cp * self.tp
        if seq is not None and seq[1] % split:
            key, value = seq
            problems.append(
                f"cp*tp = {self.cp}*{self.tp} = {split} does not divide {key}={value} (context "
                f"parallelism splits the sequence and sequence parallelism splits each piece); use "
                f"a sequence length that is a multiple of {split}, or pick cp*tp from the divisors "
                f"of {value}: {_format_divisors(value)}"
            )

        ulysses = self.ulysses_size
        if heads is not None and ulysses > 1 and heads[1] % self.tp == 0:
            key, value = heads
            per_rank = value // self.tp
            if per_rank % ulysses:
                field_name = "ulysses_degree" if self.ulysses_degree is not None else "cp (all Ulysses)"
                problems.append(
                    f"{field_name}={ulysses} does not divide the {per_rank} heads each tensor-parallel "
                    f"rank keeps ({key}={value} / tp={self.tp}); the Ulysses all-to-all shards heads, "
                    f"so pick the Ulysses degree from the divisors of {per_rank}: "
                    f"{_format_divisors(per_rank)} (set ulysses_degree and use ring attention for "
                    f"the rest of cp)"
                )

        if problems:
            raise ValueError(
                f"{self!r} does not fit the model config:\n" + "\n".join(f"  - {p}" for p in problems)
            )
        return self

    # ------------------------------------------------------------------ degrees as properties
    @property
    def dp_size(self) -> int:
        """Ranks that take different batch rows: ``dp_replicate * dp_shard * ep`` (expert-parallel
        ranks hold different experts but, for every other layer, are data-parallel)."""
        return self.dp_replicate * self.dp_shard * self.ep

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that see the same batch rows: ``cp * tp * pp``."""
        return self.cp * self.tp * self.pp

    non_dp_size = non_data_parallel_size

    @property
    def ulysses_size(self) -> int:
        """The Ulysses degree inside ``cp``: ``ulysses_degree``, or all of ``cp`` when it is None."""
        return self.ulysses_degree if self.ulysses_degree is not None else self.cp

    @property
    def ring_size(self) -> int:
        """The ring-attention degree inside ``cp``: ``cp // ulysses_size``."""
        return self.cp // self.ulysses_size

    @property
    def dp_enabled(self) -> bool:
        return self.dp_size > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """True when there is any data-parallel axis (shard or replicate), as in the reference."""
        return self.dp_shard > 1 or self.dp_replicate > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def etp_enabled(self) -> bool:
        return self.ep > 1 and self.etp > 1

    # ------------------------------------------------------------------ mesh layout (no process group)
    def mesh_axes(self) -> dict[str, int]:
        """The base mesh axes, ``name -> size`` in canonical order (:data:`MESH_AXIS_ORDER`).

        Only degrees > 1 get an axis; when every degree is 1 (a single rank) the mesh is one
        ``dp_shard`` axis of size ``world_size`` so data-parallel code still finds its axis.
        """
        axes = {name: getattr(self, name) for name in MESH_AXIS_ORDER if getattr(self, name) > 1}
        return axes or {"dp_shard": self.world_size}

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.mesh_axes().values())

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return tuple(self.mesh_axes())

    def flattened_axes(self) -> dict[str, FlattenedAxis]:
        """The flattened aliases :meth:`build_mesh` registers, ``alias -> FlattenedAxis``.

        * ``fsdp``: ``dp_shard``, the axis FSDP shards over (when it exists);
        * ``dp``: every axis whose ranks take different batch rows, ``dp_replicate``, ``dp_shard``
          and ``ep``;
        * ``loss``: ``dp`` plus ``cp``, the ranks a loss or token count is reduced over (context
          parallel ranks hold different tokens); the same ranks as ``dp`` without ``cp``.
        """
        axes = self.mesh_axes()

        def flat(sources):
            return FlattenedAxis(tuple(sources), math.prod(axes[s] for s in sources))

        dp_sources = [a for a in ("dp_replicate", "dp_shard", "ep") if a in axes]
        loss_sources = dp_sources + (["cp"] if "cp" in axes else [])
        out: dict[str, FlattenedAxis] = {}
        if "dp_shard" in axes:
            out["fsdp"] = flat(["dp_shard"])
        if dp_sources:
            out["dp"] = flat(dp_sources)
        if loss_sources:
            out["loss"] = flat(loss_sources)
        return out

    # ------------------------------------------------------------------ the device mesh
    def build_mesh(self, device_type: str = "cpu"):
        """Create the ``DeviceMesh`` (collective: every rank calls it) and return it.

        Its axes are :meth:`mesh_axes`; the aliases of :meth:`flattened_axes` are flattened onto it,
        so ``pd.get_mesh("dp")`` / ``pd.get_mesh("loss")`` give those groups as 1-D meshes. The mesh
        is what :func:`hyper_parallel.parallelize` expects: data-parallel axes are named ``dp*``, the
        tensor-parallel one ``tp``.
        """
        import torch.distributed as dist

        from .. import compat
        from .mesh import init_device_mesh

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise ValueError(
                f"{self!r} plans for world_size={self.world_size}, but the default process group "
                f"has {dist.get_world_size()} ranks; build ParallelDims with "
                f"world_size={dist.get_world_size()} (or world_size=None)"
            )
        axes = self.mesh_axes()
        mesh = init_device_mesh(device_type, tuple(axes.values()), mesh_dim_names=tuple(axes))
        meshes: dict[str, Any] = {name: mesh[name] for name in axes}
        for alias, flat in self.flattened_axes().items():
            meshes[alias] = compat.flatten_mesh(mesh, flat.sources, alias)
        object.__setattr__(self, "_meshes", {"": mesh, **meshes})
        logger.info("ParallelDims: built mesh %s", self._mesh_text())
        return mesh

    @property
    def mesh(self):
        """The mesh the last :meth:`build_mesh` call created."""
        if not self._meshes:
            raise ValueError(f"{self!r} has no mesh yet; call build_mesh(device_type) first")
        return self._meshes[""]

    def get_mesh(self, name: str):
        """A 1-D mesh of the last built mesh: a base axis (``"tp"``) or an alias (``"dp"``, ``"loss"``).

        Flattened aliases are kept here rather than sliced from the root mesh (torch deprecates
        slicing flattened axes from the root).
        """
        meshes = self._meshes
        if not meshes:
            raise ValueError(f"{self!r} has no mesh yet; call build_mesh(device_type) first")
        if name in meshes and name:
            return meshes[name]
        known = [n for n in meshes if n]
        if name in MESH_AXIS_ORDER:
            raise ValueError(
                f"the mesh has no {name!r} axis because {name}={getattr(self, name)} (only degrees "
                f"> 1 get an axis); available: {known}"
            )
        raise ValueError(f"unknown mesh axis or alias {name!r}; available: {known}")

    # ------------------------------------------------------------------ text
    def _mesh_text(self) -> str:
        return "(" + ", ".join(f"{n}={s}" for n, s in self.mesh_axes().items()) + ")"

    def summary(self) -> str:
        """One line for logs: every degree, the data-parallel size and the world size."""
        return (
            f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp} tp={self.tp} "
            f"pp={self.pp} ep={self.ep} etp={self.etp} ulysses_degree={self.ulysses_degree} | "
            f"dp={self.dp_size} world={self.world_size}"
        )

    def describe(self) -> str:
        """Several lines: degrees, the mesh axes and shape, and the flattened aliases."""
        aliases = [
            f"{alias} = {' x '.join(flat.sources)} ({flat.size} rank{'s' if flat.size != 1 else ''})"
            for alias, flat in self.flattened_axes().items()
        ]
        lines = [
            f"ParallelDims on {self.world_size} rank{'s' if self.world_size != 1 else ''}",
            "  degrees: " + " ".join(f"{n}={getattr(self, n)}" for n in _DEGREE_FIELDS)
            + f" ulysses_degree={self.ulysses_degree}",
            f"  mesh:    {self._mesh_text()}, shape {self.mesh_shape}",
            "  aliases: " + ("; ".join(aliases) if aliases else "none"),
        ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        degrees = ", ".join(f"{n}={getattr(self, n)}" for n in _DEGREE_FIELDS)
        return (
            f"ParallelDims({degrees}, ulysses_degree={self.ulysses_degree}, "
            f"world_size={self.world_size}; mesh {self._mesh_text()})"
        )
