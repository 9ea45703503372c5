"""Read one rank of a dump directory into the data the report page draws.

A dump directory (``parallelize(..., dump_dir=...)``, see ``hyper_parallel/analysis/debug.py``) holds one
``rank<r>/`` folder per rank. From one of them this reads ``summary.json``, ``layouts.tsv`` and
``passes.json`` (required) and ``memory.json`` and ``trace.json`` (optional: the compile skips the
trace when the cost model fails, and older dumps have neither). Nothing here needs torch or a process group, so a
dump copied off a cluster reports on a laptop.
"""

from __future__ import annotations

import json
import os
import re

__all__ = ["DumpError", "RankDump", "find_rank", "load_page_data"]

REQUIRED = ("summary.json", "layouts.tsv", "passes.json")
_STREAMS = ("compute", "comm")
_PHASES = ("forward", "backward", "optimizer")


class DumpError(ValueError):
    """The dump directory cannot be reported on; the message says why and what to do."""


class RankDump:
    """Paths of one rank's dump files."""

    def __init__(self, dump_dir: str, rank: int, ranks: list[int]):
        self.dump_dir, self.rank, self.ranks = dump_dir, rank, ranks
        self.dir = os.path.join(dump_dir, f"rank{rank}")

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def has(self, name: str) -> bool:
        return os.path.isfile(self.path(name))


def find_rank(dump_dir: str, rank: int | None = None) -> RankDump:
    """The ``rank<r>/`` folder to report on: ``rank``, or the lowest one present."""
    if not os.path.isdir(dump_dir):
        raise DumpError(f"{dump_dir!r} is not a directory (pass the dump_dir given to parallelize)")
    ranks = sorted(
        int(m.group(1)) for name in os.listdir(dump_dir)
        if (m := re.fullmatch(r"rank(\d+)", name)) and os.path.isdir(os.path.join(dump_dir, name))
    )
    if not ranks:
        raise DumpError(
            f"{dump_dir!r} has no rank<N>/ folders: is it a dump directory? (parallelize(..., dump_dir=...) "
            "or HYPER_PARALLEL_DUMP_DIR write one folder per rank when the model compiles)"
        )
    if rank is None:
        rank = ranks[0]
    elif rank not in ranks:
        raise DumpError(f"{dump_dir!r} has no dump of rank {rank}; ranks present: {ranks}")
    dump = RankDump(dump_dir, rank, ranks)
    missing = [name for name in REQUIRED if not dump.has(name)]
    if missing:
        raise DumpError(
            f"{dump.dir!r} lacks {', '.join(missing)}: the dump is incomplete or from an older "
            "hyper_parallel; compile again with dump_dir= to write it"
        )
    return dump


def _read_json(dump: RankDump, name: str):
    try:
        with open(dump.path(name)) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DumpError(f"cannot read {dump.path(name)!r}: {e}") from e


def _layouts(dump: RankDump) -> dict:
    try:
        with open(dump.path("layouts.tsv")) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise DumpError(f"cannot read {dump.path('layouts.tsv')!r}: {e}") from e
    if not lines:
        raise DumpError(f"{dump.path('layouts.tsv')!r} is empty")
    columns = lines[0].split("\t")
    rows = [line.split("\t") for line in lines[1:] if line]
    return {"columns": columns, "rows": rows}


def _timeline(trace: dict) -> dict:
    """The trace's complete events as compact rows sorted by stream then start, the phases' spans
    on the compute stream, and the simulation's totals (``otherData``)."""
    tids = {e["tid"]: e["args"]["name"] for e in trace.get("traceEvents", []) if e.get("name") == "thread_name"}
    streams = sorted(set(tids.values()), key=lambda s: (_STREAMS.index(s) if s in _STREAMS else 99, s))
    index = {s: i for i, s in enumerate(streams)}
    events, spans = [], {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        args = e.get("args", {})
        stream = index[tids.get(e["tid"], "compute")]
        phase = args.get("phase", "")
        start, dur = float(e["ts"]), float(e["dur"])
        events.append([stream, start, dur, e["name"], e.get("cat", ""), args.get("node", ""),
                       args.get("module", ""), args.get("op", ""), phase, args.get("flops", 0), args.get("bytes", 0)])
        if phase:
            lo, hi = spans.get(phase, (start, start + dur))
            spans[phase] = (min(lo, start), max(hi, start + dur))
    events.sort(key=lambda r: (r[0], r[1]))
    phases = [{"phase": p, "start": spans[p][0], "end": spans[p][1]} for p in _PHASES if p in spans]
    return {
        "streams": streams,
        "fields": ["stream", "ts_us", "dur_us", "name", "category", "node", "module", "op", "phase", "flops", "bytes"],
        "events": events,
        "phases": phases,
        "totals": trace.get("otherData", {}),
    }


def _memory(memory: dict) -> dict:
    points = memory.get("points", [])
    peak_index = max(range(len(points)), key=lambda i: (points[i]["bytes"], -i)) if points else -1
    return {
        "categories": memory.get("categories", []),
        "fields": ["phase", "node", "module", "bytes", "live"],
        "points": [[p["phase"], p["node"], p["module"], p["bytes"], p["live"]] for p in points],
        "peak_index": peak_index,
        "estimate": memory.get("estimate", {}),
    }


def load_page_data(dump: RankDump, trace_file: str | None = None) -> dict:
    """Everything the page shows, JSON-friendly. ``trace_file``: the trace's name next to the page
    (for the link), None when the dump has no trace."""
    summary = _read_json(dump, "summary.json")
    passes = _read_json(dump, "passes.json")
    data = {
        "dump_dir": os.path.abspath(dump.dump_dir),
        "rank": dump.rank,
        "ranks": dump.ranks,
        "summary": summary,
        "passes": passes.get("stages", []),
        "layouts": _layouts(dump),
        "timeline": None,
        "memory": None,
        "trace_file": trace_file,
        "missing": {},
    }
    if dump.has("trace.json"):
        data["timeline"] = _timeline(_read_json(dump, "trace.json"))
    else:
        data["missing"]["timeline"] = ("trace.json is not in this dump: the cost model failed or was skipped "
                                       "at compile time (see the compile log's warning)")
    if dump.has("memory.json"):
        data["memory"] = _memory(_read_json(dump, "memory.json"))
    else:
        data["missing"]["memory"] = ("memory.json is not in this dump (written by an older hyper_parallel): "
                                     "compile again with dump_dir= to plot memory over the step")
    return data
