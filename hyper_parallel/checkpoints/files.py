"""A checkpoint on disk: its directory and siblings, each file's checksum, and the manifest.

Part of :mod:`hyper_parallel.checkpoints.io`. A checkpoint is a directory of DCP files plus
``hp_checkpoint.json`` (the manifest: format version, world size, each file's size and CRC-32,
every key's global shape and dtype), which is the commit marker of a save. Saves in progress or
interrupted leave ``<path>.tmp-<id>`` / ``<path>.old-<id>`` next to it; :func:`_locate` finds the
checkpoint to load, also after a save was killed between its two renames.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from typing import Any, Mapping, Optional

import torch

from .collectives import CheckpointError

MANIFEST = "hp_checkpoint.json"
FORMAT = "hyper_parallel.checkpoint"
VERSION = 1
_TMP, _OLD = ".tmp-", ".old-"
_DCP_METADATA = ".metadata"
_RANK_FILE = re.compile(r"__(\d+)_")  # DCP's FileSystemWriter names rank r's files __r_<n>.distcp
_CHUNK = 8 << 20  # read size for checksums: large enough that zlib releases the GIL, small in memory


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def _normalize(path: str | os.PathLike) -> str:
    text = os.fspath(path)
    if not isinstance(text, str) or not text.strip():
        raise TypeError(f"checkpoint path must be a non-empty str or os.PathLike, got {path!r}")
    return os.path.normpath(text)  # "ckpt/" and "ckpt" name the same checkpoint and siblings


def _owner(name: str, index: int, world: int) -> int:
    """The rank that checksums file ``name`` (``index``: its position in the sorted file list)."""
    match = _RANK_FILE.match(name)
    return int(match.group(1)) % world if match else index % world


def _crc32(path: str) -> str:
    crc, buf = 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def _record(directory: str, name: str) -> dict[str, Any]:
    full = os.path.join(directory, name)
    return {"size": os.path.getsize(full), "crc32": _crc32(full)}


def _check_file(directory: str, name: str, expected: Mapping[str, Any], checksum: bool) -> Optional[str]:
    """What is wrong with one file of a checkpoint, or None."""
    full = os.path.join(directory, name)
    if not os.path.isfile(full):
        return f"{name} is missing"
    size = os.path.getsize(full)
    if size != expected["size"]:
        return (f"{name} has {size} bytes, expected {expected['size']} (truncated or overwritten "
                "after the save)")
    if checksum:
        crc = _crc32(full)
        if crc != expected["crc32"]:
            return f"{name} has CRC-32 {crc}, expected {expected['crc32']} (its contents changed after the save)"
    return None


def _fsync_dir(directory: str) -> None:
    # A rename is durable once its directory is synced; some filesystems cannot open directories.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _parent(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


def _siblings(path: str) -> list[str]:
    """Directories left next to ``path`` by saves: ``<path>.tmp-*`` and ``<path>.old-*``."""
    parent, base = _parent(path), os.path.basename(path)
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    return sorted(
        os.path.join(os.path.dirname(path), name) for name in names
        if (name.startswith(base + _TMP) or name.startswith(base + _OLD))
        and os.path.isdir(os.path.join(parent, name))
    )


def _is_checkpoint_file(name: str) -> bool:
    return name in (MANIFEST, _DCP_METADATA) or name.endswith(".distcp") or name.startswith(_DCP_METADATA)


def _check_replaceable(path: str) -> None:
    """A save replaces ``path``: refuse if it is anything but a checkpoint (or an empty directory),
    so a wrong path cannot delete a user's files."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path):
        raise CheckpointError(f"save_checkpoint: {path} is a symbolic link, which a save would replace; save "
                              f"to {os.path.realpath(path)} or another path")
    if not os.path.isdir(path):
        raise CheckpointError(f"save_checkpoint: {path} exists and is not a directory; choose another path")
    others = sorted(n for n in os.listdir(path) if not _is_checkpoint_file(n))
    if others:
        raise CheckpointError(
            f"save_checkpoint: {path} exists and is not a checkpoint (it holds {others[:5]}); a save "
            "replaces the whole directory, so remove it or choose another path"
        )


# --------------------------------------------------------------------------------------------
# The manifest (hp_checkpoint.json)
# --------------------------------------------------------------------------------------------


def _spec(value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):  # DTensor.shape is the global shape
        return {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    return {"type": type(value).__name__}


def _keys(state: Mapping[str, Any]) -> dict[str, Any]:
    keys: dict[str, Any] = {"model": {k: _spec(v) for k, v in state["model"].items()}, "optimizer": None}
    if "optimizer" in state:
        opt = state["optimizer"]
        keys["optimizer"] = {
            "state": {fqn: {name: _spec(v) for name, v in entry.items()} for fqn, entry in opt["state"].items()},
            "param_groups": [sorted(group) for group in opt["param_groups"]],
        }
    return keys


def _write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    # Written under another name and renamed, so the commit marker is never half-written.
    final = os.path.join(directory, MANIFEST)
    partial = final + ".partial"
    with open(partial, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, final)
    _fsync_dir(directory)


def _read_manifest(directory: str) -> dict[str, Any]:
    file = os.path.join(directory, MANIFEST)
    if not os.path.isfile(file):
        legacy = os.path.isfile(os.path.join(directory, _DCP_METADATA))
        raise CheckpointError(
            f"incomplete checkpoint: {directory} was not finished (no {MANIFEST}): its save was "
            "interrupted, or another tool wrote it"
            + (" (it has DCP's .metadata: written by torch.distributed.checkpoint.save directly or an "
               "older hyper_parallel? load it with torch.distributed.checkpoint.load)" if legacy else "")
            + ". Load the last complete checkpoint instead."
        )
    try:
        with open(file) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file} cannot be read as JSON ({exc}); the checkpoint is damaged") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a hyper_parallel checkpoint manifest (no format {FORMAT!r})")
    if not isinstance(manifest.get("version"), int) or manifest["version"] > VERSION:
        raise CheckpointError(
            f"{file} has format version {manifest.get('version')!r}; this hyper_parallel reads up to "
            f"version {VERSION}: upgrade hyper_parallel to load it"
        )
    return manifest


def _locate(path: str) -> tuple[str, dict[str, Any], Optional[str]]:
    """(directory, manifest, warning) of the checkpoint to load at ``path`` (runs on rank 0)."""
    if os.path.isdir(path):
        return path, _read_manifest(path), None
    if os.path.lexists(path):
        raise CheckpointError(f"load_checkpoint: {path} is not a directory; a checkpoint is a directory")
    # No directory at path: a save may have been killed between its two renames. Its new
    # checkpoint is complete in <path>.tmp-<id> (and the previous one in <path>.old-<id>).
    complete, incomplete = [], []
    for candidate in _siblings(path):
        try:
            complete.append((_read_manifest(candidate)["saved_at"], candidate))
        except (CheckpointError, KeyError):
            incomplete.append(os.path.basename(candidate))
    if complete:
        _, directory = max(complete)
        warning = (f"load_checkpoint: no checkpoint at {path}, but a save was interrupted while "
                   f"replacing it; loading the newest complete one, {directory}. The next "
                   "save_checkpoint to this path cleans up.")
        return directory, _read_manifest(directory), warning
    found = f"; found only incomplete ones {incomplete} (no {MANIFEST}: their saves were interrupted)" \
        if incomplete else ""
    raise CheckpointError(f"load_checkpoint: no checkpoint at {path}{found}")
