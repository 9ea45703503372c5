"""Loading: which of the checkpoint's keys the model (and optimizer) can read, checked on all ranks.

Part of :mod:`hyper_parallel.checkpoints.io`. The model's keys, global shapes and optimizer state
are compared with the manifest's before DCP reads anything: with ``strict`` any difference raises
:class:`~hyper_parallel.checkpoints.io.CheckpointError` listing the unexpected and missing keys;
``strict=False`` requests the keys both have and returns the rest.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .collectives import CheckpointError, _gathered

_MAX_LISTED = 20  # keys named in one error message


def _listed(keys: list[str]) -> str:
    if len(keys) <= _MAX_LISTED:
        return str(keys)
    return f"{keys[:_MAX_LISTED]} and {len(keys) - _MAX_LISTED} more"


def _match_keys(state: Mapping[str, Any], manifest: Mapping[str, Any], strict: bool,
                directory: str, model_name: str) -> tuple[dict[str, Any], list[str], list[str]]:
    """Check the model's (and optimizer's) keys against the checkpoint's, on every rank together.

    Returns (the state to read with DCP, missing keys, unexpected keys). A pipeline stage holds
    only some of the model's keys, so a checkpoint key is unexpected only if no rank holds it.
    Each rank's findings are all-gathered before anyone raises, so all ranks raise the same error.
    """
    local = state["model"]
    requests: list[dict[str, Any]] = []

    def findings() -> tuple[list[str], list[str], set[str]]:
        saved = manifest["keys"]
        saved_model = saved["model"]
        problems = []
        shapes = [
            f"{key!r}: checkpoint {tuple(saved_model[key]['shape'])}, model {tuple(value.shape)}"
            for key, value in local.items()
            if key in saved_model and "shape" in saved_model[key] and isinstance(value, torch.Tensor)
            and list(value.shape) != saved_model[key]["shape"]
        ]
        if shapes:
            problems.append(f"global shapes differ: {'; '.join(shapes)}")
        request: dict[str, Any] = {"model": {k: v for k, v in local.items() if k in saved_model}}
        if "optimizer" in state:
            if saved["optimizer"] is None:
                problems.append("it was saved without optimizer state: pass optimizer=None to load the model only")
            else:
                request["optimizer"] = _optimizer_request(
                    state["optimizer"], saved["optimizer"], saved_model, strict, problems)
        requests.append(request)
        return problems, sorted(set(local) - set(saved_model)), set(saved_model) - set(local)

    gathered = _gathered(findings)  # raises on every rank if findings() raised on any
    request = requests[0]
    problems = list(dict.fromkeys(p for rank_problems, _, _ in gathered for p in rank_problems))
    missing = sorted({k for _, rank_missing, _ in gathered for k in rank_missing})
    unexpected = sorted(set.intersection(*(not_here for _, _, not_here in gathered)))
    if strict and (missing or unexpected):
        parts = []
        if unexpected:
            parts.append(f"unexpected keys (in the checkpoint, not in the model): {_listed(unexpected)}")
        if missing:
            parts.append(f"missing keys (in the model, not in the checkpoint): {_listed(missing)}")
        problems.append(
            f"{'; '.join(parts)}. Was it saved from a model with another configuration (e.g. another "
            "number of layers)? Build the model it was saved from, or pass strict=False to load the "
            "keys both have and get the others back"
        )
    if problems:
        raise CheckpointError(
            f"load_checkpoint({directory}) into {model_name} (saved on {manifest['world_size']} ranks): "
            + "; ".join(problems)
        )
    return request, missing, unexpected


def _optimizer_request(current: Mapping[str, Any], saved: Mapping[str, Any], saved_model: Mapping[str, Any],
                       strict: bool, problems: list[str]) -> dict[str, Any]:
    """The part of the optimizer state dict to read: state of the parameters the checkpoint has,
    and the param groups' hyperparameters (their "params" lists name this model's parameters)."""
    saved_state, state = saved["state"], {}
    no_state, other_names = [], []
    for fqn, entry in current["state"].items():
        if fqn not in saved_state:
            if fqn in saved_model:  # a parameter missing altogether is reported as a missing key
                no_state.append(fqn)
        elif sorted(entry) != sorted(saved_state[fqn]):
            other_names.append(f"{fqn!r} has {sorted(entry)}, the checkpoint {sorted(saved_state[fqn])}")
        else:
            state[fqn] = entry
    if no_state and strict:
        problems.append(f"the checkpoint has no optimizer state for {_listed(no_state)} (frozen when saved?)")
    if other_names:
        problems.append(f"optimizer state differs for {len(other_names)} parameters ({other_names[0]}): "
                        "was it saved with another optimizer?")
    groups, saved_groups = current["param_groups"], saved["param_groups"]
    if len(groups) != len(saved_groups):
        problems.append(f"the optimizer has {len(groups)} param groups, the checkpoint {len(saved_groups)}")
        return {"state": state}
    request_groups = []
    for i, (group, names) in enumerate(zip(groups, saved_groups)):
        absent = sorted(set(group) - set(names))
        if absent and strict:
            problems.append(f"param group {i} has {absent}, which the checkpoint lacks (another optimizer?)")
        keep = set(names) if strict else set(names) - {"params"}
        request_groups.append({k: v for k, v in group.items() if k in keep})
    return {"state": state, "param_groups": request_groups}
