"""``hyper-parallel report DUMP_DIR``: one self-contained HTML page about a compile, from its dump.

The page (no server, no network: inline CSS and JS, the data embedded as JSON) shows, for one rank:
a summary (mesh, collectives per step by kind and axis, memory numbers, the estimated step time);
per compile stage and pass, the nodes added, removed and moved; the layout table with a search
box; the cost model's simulated step as a timeline of the compute and communication streams; and
live memory over the step with the peak marked. The simulated step is also copied next to the page
as a Chrome trace JSON that opens in Perfetto.

``data`` reads the dump (no torch needed), ``page`` and ``script`` make the HTML.
"""

from __future__ import annotations

import os
import shutil

from .data import DumpError, find_rank, load_page_data
from .page import render_page

__all__ = ["DumpError", "write_report"]


def _trace_path(out: str) -> str:
    stem = out[:-5] if out.endswith(".html") else out
    return stem + ".trace.json"


def write_report(dump_dir: str, rank: int | None = None, out: str | None = None) -> tuple[str, str | None]:
    """Write the report page of ``rank`` (default: the lowest rank in the dump) to ``out``
    (default ``DUMP_DIR/report.html``) and the step's Chrome trace next to it
    (``<out without .html>.trace.json``; None when the dump has no trace). Returns both paths.
    Raises :class:`DumpError` (a ValueError) when the dump cannot be reported on."""
    dump = find_rank(dump_dir, rank)
    out = out or os.path.join(dump_dir, "report.html")
    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):
        raise DumpError(f"--out {out!r}: directory {out_dir!r} does not exist")
    trace = _trace_path(out) if dump.has("trace.json") else None
    data = load_page_data(dump, os.path.basename(trace) if trace else None)
    # Links from the page to the graph files, relative so the page and dump move together.
    data["rank_dir_href"] = os.path.relpath(dump.dir, out_dir).replace(os.sep, "/")
    try:
        with open(out, "w", encoding="utf-8") as f:
            f.write(render_page(data))
        if trace:
            shutil.copyfile(dump.path("trace.json"), trace)
    except OSError as e:
        raise DumpError(f"cannot write the report: {e}") from e
    return out, trace
