"""Tensor-parallel styles: declarative per-module sharding recipes (``parallelize_module`` form).

The styles mirror ``torch.distributed.tensor.parallel`` (same class names, fields and defaults), but
here a style never installs hooks or touches the module. It only answers, through
:meth:`ParallelStyle.resolve`, which placement each of the module's parameters gets on the
tensor-parallel mesh axis and which layouts the module's inputs and outputs must have at its
boundary. The plan layer turns those answers into constraints for the compiler.

Styles are frozen dataclasses with keyword-only fields. Placement fields also accept their text
(``"S(0)"``, ``"R"``, ``"P(sum)"``) so plans can come from YAML/JSON, and :func:`parse_style` turns
``"colwise"``-style strings or ``{"style": ..., **fields}`` dicts into style objects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any

from torch import nn

from hyper_parallel import compat
from hyper_parallel.layout import (
    Placement,
    Replicate,
    Shard,
    format_placements,
    parse_placement,
)

__all__ = [
    "StyleConstraints",
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
    "parse_style",
    "STYLE_NAMES",
]


def _fmt(value: Any) -> str:
    """Short text of a style field value for reprs (placements print as S(0) / R / P(sum))."""
    if isinstance(value, Placement):
        return str(value)
    if isinstance(value, tuple):
        return format_placements(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    return repr(value)


@dataclass(frozen=True)
class StyleConstraints:
    """What a style asks of one module, every placement being on the tensor-parallel axis.

    ``params``: local parameter name (``"weight"``, ``"bias"``, or a dotted name for nested
    parameters) -> placement. ``inputs`` / ``outputs``: per positional forward input / output, the
    layout it must have at the module boundary (None: leave it as propagated). ``kwarg_inputs``:
    the same for keyword inputs. ``declared_*``: the layouts the user declared the inputs/outputs
    arrive with; informative only (the compiler propagates real layouts), kept for messages.
    Shard dims of activations may be negative (``S(-1)`` = last dim); resolve them against the
    activation's rank.
    """

    params: dict[str, Placement] = field(default_factory=dict)
    inputs: tuple[Placement | None, ...] = ()
    kwarg_inputs: dict[str, Placement] = field(default_factory=dict)
    outputs: tuple[Placement | None, ...] = ()
    declared_inputs: tuple[Placement | None, ...] = ()
    declared_kwarg_inputs: dict[str, Placement] = field(default_factory=dict)
    declared_outputs: tuple[Placement | None, ...] = ()


class ParallelStyle(ABC):
    """Base class of tensor-parallel styles: a recipe resolved per module, never a hook."""

    @abstractmethod
    def resolve(self, module_fqn: str, module: nn.Module, axis: str) -> StyleConstraints:
        """Return the constraints this style puts on ``module`` (named ``module_fqn``) along mesh axis ``axis``.

        Raises TypeError if the style cannot apply to this kind of module.
        """

    def __repr__(self) -> str:
        # Only fields that differ from their defaults, so dumps stay short: ColwiseParallel().
        parts = []
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.default is not value and f.default != value:
                parts.append(f"{f.name}={_fmt(value)}")
        return f"{type(self).__name__}({', '.join(parts)})"


def _placement_or_none(value: Any, name: str, style: str) -> Placement | None:
    if value is None:
        return None
    try:
        return parse_placement(value)
    except ValueError as exc:
        raise ValueError(f"{style}({name}=...): {exc}") from None


def _placement_tuple(value: Any, name: str, style: str) -> tuple[Placement | None, ...] | None:
    """A Placement, a text, or a sequence of them (None entries allowed) -> tuple, as torch's Prepare* do."""
    if value is None:
        return None
    if isinstance(value, (Placement, str)):
        return (_placement_or_none(value, name, style),)
    if isinstance(value, (tuple, list)):
        return tuple(_placement_or_none(v, name, style) for v in value)
    raise TypeError(
        f"{style}({name}=...): expected a Placement or a tuple of Placement/None, got {value!r}"
    )


def _placement_dict(value: Any, name: str, style: str) -> dict[str, Placement]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{style}({name}=...): expected a dict kwarg name -> Placement, got {value!r}")
    return {str(k): _placement_or_none(v, name, style) for k, v in value.items()}


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


def _lora_adapters(module: nn.Module) -> list[str] | None:
    """The adapter names of a PEFT LoRA layer around an ``nn.Linear`` (peft's ``lora.Linear``:
    ``base_layer``, and ``lora_A`` / ``lora_B`` ModuleDicts of Linears per adapter), else None.
    Recognised by its structure, so peft need not be imported here."""
    base = getattr(module, "base_layer", None)
    lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    if isinstance(base, nn.Linear) and isinstance(lora_a, nn.ModuleDict) and isinstance(lora_b, nn.ModuleDict):
        return list(lora_a.keys())
    return None


def _lora_params(style: ParallelStyle, module_fqn: str, module: nn.Module, adapters: list[str],
                 base: dict[str, Placement], a: Placement, b: Placement) -> dict[str, Placement]:
    """A LoRA layer's placements: the base Linear's as the style gives them, each adapter's
    ``lora_A`` weight ``a`` and ``lora_B`` weight ``b`` (its bias, peft's ``lora_bias``, as the base
    bias). Colwise: A replicated, B sharded on the output features as the base weight, so the
    adapter's output is sharded as the base's. Rowwise: A sharded on the input features as the base
    weight, B replicated: both paths give partial sums, reduced once. DoRA is refused: its weight
    norm needs each output row whole."""
    magnitude = getattr(module, "lora_magnitude_vector", None)
    if magnitude is not None and len(magnitude):
        raise TypeError(
            f"{type(style).__name__} cannot shard the DoRA layer {module_fqn!r} (use_dora=True): DoRA scales "
            "by the norm of each row of the whole weight. Leave this module out of the tensor-parallel plan, "
            "or use LoRA without DoRA"
        )
    params = {f"base_layer.{name}": placement for name, placement in base.items()}
    for adapter in adapters:
        params[f"lora_A.{adapter}.weight"] = a
        params[f"lora_B.{adapter}.weight"] = b
        if getattr(module.lora_B[adapter], "bias", None) is not None:
            params[f"lora_B.{adapter}.bias"] = base.get("bias", Replicate())
        if getattr(module.lora_A[adapter], "bias", None) is not None:
            params[f"lora_A.{adapter}.bias"] = Replicate()
    return params


def _unsupported_module(style: ParallelStyle, module_fqn: str, module: nn.Module) -> TypeError:
    """The TypeError for Colwise/Rowwise on something that is neither nn.Linear nor nn.Embedding
    (nor a PEFT LoRA layer around an nn.Linear)."""
    style_name = type(style).__name__
    shown = module_fqn or "<root module>"
    examples = [
        name
        for name, child in module.named_modules()
        if name and isinstance(child, (nn.Linear, nn.Embedding))
    ][:2]
    if examples:
        prefix = f"{module_fqn}." if module_fqn else ""
        hint = (
            f"apply {style_name} to its Linear/Embedding children instead, e.g. "
            + " or ".join(repr(prefix + e) for e in examples)
        )
    else:
        hint = (
            "it has no Linear/Embedding children; give its parameters explicit layouts with "
            "layouts={...: {'parameter': {...}}} (shard_module form) instead"
        )
    return TypeError(
        f"{style_name} cannot be applied to module {shown!r} ({type(module).__name__}): it only "
        f"shards nn.Linear, nn.Embedding and PEFT LoRA layers around an nn.Linear; {hint}"
    )


@dataclass(frozen=True, kw_only=True, repr=False)
class _LinearStyle(ParallelStyle):
    """The fields Colwise and Rowwise share: the layout the input arrives in, the layout the output
    leaves in (each a placement on the tensor-parallel axis), and ``use_local_output``."""

    input_layouts: Placement | None = None
    output_layouts: Placement | None = None
    use_local_output: bool = True

    def __post_init__(self) -> None:
        name = type(self).__name__
        _set(self, "input_layouts", _placement_or_none(self.input_layouts, "input_layouts", name))
        _set(self, "output_layouts", _placement_or_none(self.output_layouts, "output_layouts", name))


@dataclass(frozen=True, kw_only=True, repr=False)
class ColwiseParallel(_LinearStyle):
    """Shard a Linear's output features (weight and bias ``S(0)``) or an Embedding's columns (weight ``S(1)``).

    On a PEFT LoRA layer around a Linear (``lora.Linear``): the base Linear as above, each adapter's
    ``lora_A`` replicated and ``lora_B`` ``S(0)``, so the plan written for a model applies unchanged to
    its ``get_peft_model`` wrapper (FQNs gain peft's ``base_model.model.`` prefix).

    The input must be Replicate on the tensor-parallel axis; the output leaves the module as
    ``output_layouts`` (default ``S(-1)``, sharded on the last dim). ``input_layouts`` (default R)
    only documents how the input arrives. ``use_local_output`` is kept for API parity; compiled
    modules exchange plain tensors, so it has no effect.

    ``parts`` (hyper_parallel's, default 1): a fused Linear whose output features are ``parts``
    equal projections side by side, as Phi-3's ``qkv_proj`` ([q; k; v] with as many key/value
    heads as query heads) and ``gate_up_proj`` ([gate; up]). Each part is split over the axis
    (weight and bias ``_StridedShard(0, split_factor=parts)``, output ``_StridedShard(-1)`` alike), so
    every rank holds its heads' q, k and v and the model's split of the output stays local
    (propagation/fused_projections.py); a plain column split would hand rank 0 all of q and gather.
    """

    parts: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.parts, bool) or not isinstance(self.parts, int) or self.parts < 1:
            raise ValueError(f"ColwiseParallel: parts must be a positive int (the number of equal projections "
                             f"fused in the weight, e.g. 3 for [q; k; v]), got {self.parts!r}")

    def resolve(self, module_fqn: str, module: nn.Module, axis: str) -> StyleConstraints:
        """Linear: weight/bias S(0) (strided over ``parts``); Embedding: weight S(1); input R; output
        ``output_layouts`` (S(-1), strided over ``parts``)."""
        adapters = _lora_adapters(module)
        linear = module.base_layer if adapters is not None else module
        if self.parts > 1:
            return self._resolve_fused(module_fqn, module, linear, adapters)
        if isinstance(linear, nn.Linear):
            params = {"weight": Shard(0)}
            if linear.bias is not None:
                params["bias"] = Shard(0)
            if adapters is not None:
                params = _lora_params(self, module_fqn, module, adapters, params, a=Replicate(), b=Shard(0))
        elif isinstance(module, nn.Embedding):
            params = {"weight": Shard(1)}
        else:
            raise _unsupported_module(self, module_fqn, module)
        return StyleConstraints(
            params=params,
            inputs=(Replicate(),),
            outputs=(self.output_layouts or Shard(-1),),
            declared_inputs=(self.input_layouts or Replicate(),),
        )

    def _resolve_fused(self, module_fqn: str, module: nn.Module, linear, adapters) -> StyleConstraints:
        """``parts`` > 1: weight and bias strided over the parts. On a PEFT LoRA layer around the fused
        Linear, its ``lora_B`` split per part as the base weight (its output adds to the base's part
        by part), ``lora_A`` replicated."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"ColwiseParallel(parts={self.parts}) on {module_fqn!r}: fused projections are split on "
                            f"nn.Linear only, not {type(module).__name__}; use parts=1 or leave the module out of "
                            "the plan")
        if linear.out_features % self.parts:
            raise ValueError(
                f"ColwiseParallel(parts={self.parts}) on {module_fqn!r}: its {linear.out_features} output "
                f"features are not {self.parts} equal parts; parts is for weights of equal projections side by side")
        strided = compat.StridedShard(0, split_factor=self.parts)
        params = {"weight": strided} | ({"bias": strided} if linear.bias is not None else {})
        if adapters is not None:
            params = _lora_params(self, module_fqn, module, adapters, params, a=Replicate(), b=strided)
        return StyleConstraints(
            params=params,
            inputs=(Replicate(),),
            outputs=(self.output_layouts or compat.StridedShard(-1, split_factor=self.parts),),
            declared_inputs=(self.input_layouts or Replicate(),),
        )


@dataclass(frozen=True, kw_only=True, repr=False)
class RowwiseParallel(_LinearStyle):
    """Shard a Linear's input features (weight ``S(1)``, bias R) or an Embedding's rows (weight ``S(0)``).

    On a PEFT LoRA layer around a Linear: the base Linear as above, each adapter's ``lora_A`` ``S(1)``
    and ``lora_B`` replicated (the adapter's output is a partial sum, reduced with the base's).

    A Linear needs its input sharded on the last dim (``S(-1)``); an Embedding needs replicated
    indices. Either produces partial sums, reduced to ``output_layouts`` (default R) as the output
    leaves the module. ``input_layouts`` (default ``S(-1)``) only documents how the input arrives.
    """

    def resolve(self, module_fqn: str, module: nn.Module, axis: str) -> StyleConstraints:
        """Linear: weight S(1), bias R, input S(-1); Embedding: weight S(0), input R; output ``output_layouts`` (R)."""
        adapters = _lora_adapters(module)
        linear = module.base_layer if adapters is not None else module
        if isinstance(linear, nn.Linear):
            params = {"weight": Shard(1)}
            if linear.bias is not None:
                # The bias is added once, after the partial sums are reduced.
                params["bias"] = Replicate()
            if adapters is not None:
                params = _lora_params(self, module_fqn, module, adapters, params, a=Shard(1), b=Replicate())
            desired_input: Placement = Shard(-1)
        elif isinstance(module, nn.Embedding):
            params = {"weight": Shard(0)}
            desired_input = Replicate()
        else:
            raise _unsupported_module(self, module_fqn, module)
        return StyleConstraints(
            params=params,
            inputs=(desired_input,),
            outputs=(self.output_layouts or Replicate(),),
            declared_inputs=(self.input_layouts or Shard(-1),),
        )


@dataclass(frozen=True, kw_only=True, repr=False)
class SequenceParallel(ParallelStyle):
    """Run a module (norm, dropout, ...) on sequence-sharded activations: parameters R, input and output ``S(sequence_dim)``."""

    sequence_dim: int = 1
    use_local_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.sequence_dim, bool) or not isinstance(self.sequence_dim, int):
            raise TypeError(
                f"SequenceParallel(sequence_dim=...) must be an int, got {self.sequence_dim!r}"
            )

    def resolve(self, module_fqn: str, module: nn.Module, axis: str) -> StyleConstraints:
        """Every parameter (recursively) R; input 0 and output 0 ``S(sequence_dim)``."""
        seq = Shard(self.sequence_dim)
        return StyleConstraints(
            params={name: Replicate() for name, _ in module.named_parameters()},
            inputs=(seq,),
            outputs=(seq,),
            declared_inputs=(seq,),
        )


@dataclass(frozen=True, kw_only=True, repr=False)
class PrepareModuleInput(ParallelStyle):
    """Require the module's inputs to have given layouts on entry; parameters untouched.

    ``desired_input_layouts`` has one entry per positional input (None: no constraint) and
    ``desired_input_kwarg_layouts`` one per keyword input. ``input_layouts`` /
    ``input_kwarg_layouts`` declare how the inputs arrive (informative; when given they must have
    the same length as the desired ones, as in torch).
    """

    input_layouts: tuple[Placement | None, ...] | None = None
    desired_input_layouts: tuple[Placement | None, ...] | None = None
    input_kwarg_layouts: dict[str, Placement] | None = None
    desired_input_kwarg_layouts: dict[str, Placement] | None = None
    use_local_output: bool = False

    def __post_init__(self) -> None:
        name = type(self).__name__
        declared = _placement_tuple(self.input_layouts, "input_layouts", name)
        desired = _placement_tuple(self.desired_input_layouts, "desired_input_layouts", name)
        if declared is not None and (desired is None or len(declared) != len(desired)):
            raise ValueError(
                f"{name}: input_layouts {format_placements(declared)} and desired_input_layouts "
                f"{'None' if desired is None else format_placements(desired)} must have the same "
                "length (use None entries for inputs to leave alone)"
            )
        _set(self, "input_layouts", declared)
        _set(self, "desired_input_layouts", desired)
        kw_declared = self.input_kwarg_layouts
        kw_desired = self.desired_input_kwarg_layouts
        if kw_declared is not None:
            kw_declared = _placement_dict(kw_declared, "input_kwarg_layouts", name)
        if kw_desired is not None:
            kw_desired = _placement_dict(kw_desired, "desired_input_kwarg_layouts", name)
        if kw_declared is not None and set(kw_declared) != set(kw_desired or {}):
            raise ValueError(
                f"{name}: input_kwarg_layouts keys {sorted(kw_declared)} and "
                f"desired_input_kwarg_layouts keys {sorted(kw_desired or {})} must be the same"
            )
        _set(self, "input_kwarg_layouts", kw_declared)
        _set(self, "desired_input_kwarg_layouts", kw_desired)

    def resolve(self, module_fqn: str, module: nn.Module, axis: str) -> StyleConstraints:
        """No parameters; inputs/kwarg inputs must have the desired layouts."""
        return StyleConstraints(
            inputs=self.desired_input_layouts or (),
            kwarg_inputs={
                k: v for k, v in (self.desired_input_kwarg_layouts or {}).items() if v is not None
            },
            declared_inputs=self.input_layouts or (),
            declared_kwarg_inputs={
                k: v for k, v in (self.input_kwarg_layouts or {}).items() if v is not None
            },
        )


@dataclass(frozen=True, kw_only=True, repr=False)
class PrepareModuleOutput(ParallelStyle):
    """Require the module's outputs to leave with ``desired_output_layouts``; parameters untouched.

    ``output_layouts`` declares what the outputs are before conversion (informative); both must
    have one entry per output (None: no constraint).
    """

    output_layouts: tuple[Placement | None, ...]
    desired_output_layouts: tuple[Placement | None, ...]
    use_local_output: bool = True

    def __post_init__(self) -> None:
        name = type(self).__name__
        declared = _placement_tuple(self.output_layouts, "output_layouts", name)
        desired = _placement_tuple(self.desired_output_layouts, "desired_output_layouts", name)
        if declared is None or desired is None or len(declared) != len(desired):
            raise ValueError(
                f"{name}: output_layouts {self.output_layouts!r} and desired_output_layouts "
                f"{self.desired_output_layouts!r} must both be given, with the same length"
            )
        _set(self, "output_layouts", declared)
        _set(self, "desired_output_layouts", desired)

    def resolve(self, module_fqn: str, module: nn.Module, axis: str) -> StyleConstraints:
        """No parameters; outputs must leave with the desired layouts."""
        return StyleConstraints(
            outputs=self.desired_output_layouts, declared_outputs=self.output_layouts
        )


@dataclass(frozen=True, kw_only=True, repr=False)
class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module (torch's field names)."""

    input_layouts: tuple[Placement | None, ...] | None = None
    desired_input_layouts: tuple[Placement | None, ...] | None = None
    input_kwarg_layouts: dict[str, Placement] | None = None
    desired_input_kwarg_layouts: dict[str, Placement] | None = None
    use_local_input: bool = False
    output_layouts: tuple[Placement | None, ...]
    desired_output_layouts: tuple[Placement | None, ...]
    use_local_output: bool = True

    def __post_init__(self) -> None:
        # Build the two halves once: they validate and normalise the fields.
        prepare_in = PrepareModuleInput(
            input_layouts=self.input_layouts,
            desired_input_layouts=self.desired_input_layouts,
            input_kwarg_layouts=self.input_kwarg_layouts,
            desired_input_kwarg_layouts=self.desired_input_kwarg_layouts,
            use_local_output=self.use_local_input,
        )
        prepare_out = PrepareModuleOutput(
            output_layouts=self.output_layouts,
            desired_output_layouts=self.desired_output_layouts,
            use_local_output=self.use_local_output,
        )
        for f in fields(prepare_in):
            if f.name != "use_local_output":
                _set(self, f.name, getattr(prepare_in, f.name))
        _set(self, "output_layouts", prepare_out.output_layouts)
        _set(self, "desired_output_layouts", prepare_out.desired_output_layouts)

    def resolve(self, module_fqn: str, module: nn.Module, axis: str) -> StyleConstraints:
        """No parameters; desired input and output layouts as in the two Prepare styles."""
        inputs = PrepareModuleInput(
            input_layouts=self.input_layouts,
            desired_input_layouts=self.desired_input_layouts,
            input_kwarg_layouts=self.input_kwarg_layouts,
            desired_input_kwarg_layouts=self.desired_input_kwarg_layouts,
        ).resolve(module_fqn, module, axis)
        return StyleConstraints(
            inputs=inputs.inputs,
            kwarg_inputs=inputs.kwarg_inputs,
            outputs=self.desired_output_layouts,
            declared_inputs=inputs.declared_inputs,
            declared_kwarg_inputs=inputs.declared_kwarg_inputs,
            declared_outputs=self.output_layouts,
        )


#: Strings accepted for a style in a plan (YAML/JSON), mapped to the style class.
STYLE_NAMES: dict[str, type[ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "sequence_parallel": SequenceParallel,
    "sequence": SequenceParallel,
    "ColwiseParallel": ColwiseParallel,
    "RowwiseParallel": RowwiseParallel,
    "SequenceParallel": SequenceParallel,
}

# The dict form {"style": name, **fields} may also name the Prepare* styles, which need fields.
_DICT_STYLE_NAMES: dict[str, type[ParallelStyle]] = {
    **STYLE_NAMES,
    "PrepareModuleInput": PrepareModuleInput,
    "PrepareModuleOutput": PrepareModuleOutput,
    "PrepareModuleInputOutput": PrepareModuleInputOutput,
}


def parse_style(spec: Any, where: str = "style") -> ParallelStyle:
    """Return a ParallelStyle from a style object, a name (see ``STYLE_NAMES``) or ``{"style": name, **fields}``.

    ``where`` (e.g. the plan key) prefixes error messages.
    """
    if isinstance(spec, ParallelStyle):
        return spec
    if isinstance(spec, str):
        cls = STYLE_NAMES.get(spec)
        if cls is None:
            raise ValueError(
                f"{where}: unknown parallel style {spec!r}; valid names are {list(STYLE_NAMES)} "
                "(or pass a style object such as hp.ColwiseParallel(output_layouts=Shard(1)))"
            )
        return cls()
    if isinstance(spec, dict) and "style" in spec:
        name = spec["style"]
        cls = _DICT_STYLE_NAMES.get(name) if isinstance(name, str) else None
        if cls is None:
            raise ValueError(
                f"{where}: unknown parallel style {name!r}; valid names are "
                f"{list(_DICT_STYLE_NAMES)}"
            )
        kwargs = {k: v for k, v in spec.items() if k != "style"}
        valid = [f.name for f in fields(cls)]
        unknown = [k for k in kwargs if k not in valid]
        if unknown:
            raise ValueError(
                f"{where}: {cls.__name__} has no field {unknown[0]!r}; its fields are {valid}"
            )
        return cls(**kwargs)
    raise TypeError(
        f"{where}: expected a ParallelStyle, a style name ({list(STYLE_NAMES)}) or a dict "
        f"{{'style': name, ...fields}}, got {spec!r}"
    )
