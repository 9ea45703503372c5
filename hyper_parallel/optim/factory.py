"""``get_hyper_optimizer``: Muon for the hidden layers' weight matrices, AdamW for the rest, chained.

``AdamW`` here is ``torch.optim.AdamW`` itself: the reference API's AdamW is the standard algorithm
with torch's defaults (``lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01``), and torch's
already runs on DTensor parameters (every step is elementwise on the local shards).

The default split (:func:`split_muon_adamw_params`, used when ``muon_params`` / ``adamw_params`` are
``None``): Muon takes every trainable 2-D parameter except embeddings and the output head, i.e. the
attention and MLP projection matrices; AdamW takes the embeddings, the output head (``lm_head``; a
tied head is the embedding), norms, biases and any other shape (3-D expert stacks, conv kernels).
Muon's orthogonalised update suits hidden linear maps, whose rows and columns all mix; an
embedding's rows and the head's per-token rows are looked up independently, so AdamW's per-element
scaling suits them better (as in Keller Jordan's and Moonlight's recipes).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch
import torch.nn as nn

from .chained import ChainedOptimizer
from .muon import Muon

__all__ = ["AdamW", "get_hyper_optimizer", "split_muon_adamw_params"]

AdamW = torch.optim.AdamW

# Last component of a module name that marks an output head (a per-token projection), not a hidden map.
_HEAD_NAMES = frozenset({"lm_head", "output", "embed_out", "head", "score", "classifier"})


def split_muon_adamw_params(model: nn.Module) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(muon_params, adamw_params)`` as param-group lists for :func:`get_hyper_optimizer`:
    trainable 2-D parameters other than embeddings and the output head go to Muon, every other
    trainable parameter to AdamW. An empty side is ``[]``."""
    excluded: set[int] = set()
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if isinstance(head, nn.Module):
        excluded.update(id(p) for p in head.parameters())
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) or name.rsplit(".", 1)[-1] in _HEAD_NAMES:
            excluded.update(id(p) for p in module.parameters(recurse=False))
    muon, adamw = [], []
    for p in model.parameters():
        if p.requires_grad:
            (muon if p.dim() == 2 and id(p) not in excluded else adamw).append(p)
    return ([{"params": muon}] if muon else []), ([{"params": adamw}] if adamw else [])


def _strip_prefix(kwargs: Optional[Mapping[str, Any]], prefix: str, other: str, what: str) -> dict[str, Any]:
    """``kwargs`` with ``prefix`` removed from the keys that carry it (``muon_lr`` -> ``lr``)."""
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in (kwargs or {}).items():
        if key.startswith(other):
            raise ValueError(f"{what}_kwargs has {key!r}, a setting of the other optimizer; pass it in "
                             f"{other.rstrip('_')}_kwargs")
        name = key[len(prefix):] if key.startswith(prefix) else key
        if name in out:
            raise ValueError(f"{what}_kwargs sets {name!r} twice: as {given[name]!r} and as {key!r}")
        out[name], given[name] = value, key
    return out


def _count(groups: Iterable) -> int:
    n = 0
    for group in groups:
        if isinstance(group, Mapping):
            params = group.get("params", [])
            n += 1 if isinstance(params, torch.Tensor) else len(list(params))
        else:
            n += 1
    return n


def _check_muon_shapes(model: nn.Module, groups: list) -> None:
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    bad = []
    for group in groups:
        params = group.get("params", []) if isinstance(group, Mapping) else [group]
        for p in [params] if isinstance(params, torch.Tensor) else params:
            if p.dim() != 2:
                bad.append(f"{names.get(id(p), 'a parameter not in the model')} (shape {tuple(p.shape)})")
    if bad:
        raise ValueError(f"get_hyper_optimizer: muon_params must be 2-D weight matrices; put {', '.join(bad)} "
                         "in adamw_params")


def get_hyper_optimizer(
    model: nn.Module,
    muon_params: Optional[list] = None,
    adamw_params: Optional[list] = None,
    muon_kwargs: Optional[Mapping[str, Any]] = None,
    adamw_kwargs: Optional[Mapping[str, Any]] = None,
    *,
    flatten: bool = False,
) -> ChainedOptimizer:
    """A :class:`ChainedOptimizer` of ``{"muon": Muon, "adamw": AdamW}`` over ``model``.

    ``muon_params`` / ``adamw_params``: param-group lists (dicts with ``"params"`` and optional
    per-group settings, or plain tensors); an empty list leaves that optimizer out; ``None`` takes
    that side of :func:`split_muon_adamw_params`. ``muon_kwargs`` / ``adamw_kwargs``: constructor
    settings, their ``muon_`` / ``adamw_`` prefixes removed (``{"muon_lr": 0.02, "momentum":
    0.95}`` gives ``Muon(lr=0.02, momentum=0.95)``); setting a key both with and without the
    prefix, or passing the other optimizer's prefix, is a ``ValueError``. ``flatten`` is the
    chain's state-dict form. Parameters in both lists are a ``ValueError`` naming them.
    """
    if muon_params is None or adamw_params is None:
        default_muon, default_adamw = split_muon_adamw_params(model)
        muon_params = default_muon if muon_params is None else muon_params
        adamw_params = default_adamw if adamw_params is None else adamw_params
    muon_params, adamw_params = list(muon_params), list(adamw_params)
    optimizers: dict[str, torch.optim.Optimizer] = {}
    if _count(muon_params):
        _check_muon_shapes(model, muon_params)
        optimizers["muon"] = Muon(muon_params, **_strip_prefix(muon_kwargs, "muon_", "adamw_", "muon"))
    if _count(adamw_params):
        optimizers["adamw"] = AdamW(adamw_params, **_strip_prefix(adamw_kwargs, "adamw_", "muon_", "adamw"))
    if not optimizers:
        raise ValueError("get_hyper_optimizer: muon_params and adamw_params are both empty; nothing to optimise")
    return ChainedOptimizer(model, optimizers, flatten=flatten)
