"""The report page: one self-contained HTML file (inline CSS and JS, the data as embedded JSON).

No external URL anywhere (no CDN, no web fonts): the page opens from disk, offline. The script
(``script.py``) builds every section from the ``<script type="application/json" id="hp-data">``
block; when it has finished it sets ``<body data-rendered="ok">``, and any uncaught error is
recorded in ``<html data-errors="...">`` (tests and headless checks read both).
"""

from __future__ import annotations

import html
import json

from .script import SCRIPT

__all__ = ["render_page"]

CSS = """
:root { --fg: #1d2330; --muted: #667085; --line: #d9dee7; --bg: #f6f7f9; --card: #fff;
        --accent: #2f6fdf; --add: #1a7f37; --del: #c4312b; --move: #8a5a00; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
       color: var(--fg); background: var(--bg); }
header { background: #1d2330; color: #fff; padding: 14px 24px; }
header h1 { margin: 0; font-size: 19px; font-weight: 600; }
header .sub { color: #b8c0cc; font-size: 13px; margin-top: 2px; word-break: break-all; }
nav { position: sticky; top: 0; z-index: 5; background: #fff; border-bottom: 1px solid var(--line);
      padding: 6px 24px; display: flex; gap: 18px; }
nav a { color: var(--accent); text-decoration: none; font-weight: 500; }
main { padding: 8px 24px 40px; max-width: 1600px; }
section { background: var(--card); border: 1px solid var(--line); border-radius: 6px; margin: 16px 0;
          padding: 12px 18px 16px; }
section h2 { font-size: 17px; margin: 2px 0 10px; }
h3 { font-size: 14px; margin: 14px 0 6px; }
.note { color: var(--muted); font-size: 13px; }
.missing { color: var(--del); }
.cards { display: flex; flex-wrap: wrap; gap: 10px; margin-bottom: 8px; }
.card { border: 1px solid var(--line); border-radius: 6px; padding: 8px 12px; min-width: 170px; }
.card .k { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .03em; }
.card .v { font-size: 18px; font-weight: 600; }
.card .d { color: var(--muted); font-size: 12px; max-width: 360px; overflow-wrap: anywhere; }
.cols { display: flex; flex-wrap: wrap; gap: 28px; }
table { border-collapse: collapse; font-size: 13px; }
th, td { text-align: left; padding: 3px 10px 3px 0; border-bottom: 1px solid #eef0f4; vertical-align: top; }
th { color: var(--muted); font-weight: 600; border-bottom: 1px solid var(--line); }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
td.nowrap { white-space: nowrap; }
tr.pass-detail > td { background: #fafbfc; padding: 4px 12px 10px; }
code, .mono, td.mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12px; }
.add { color: var(--add); } .del { color: var(--del); } .mov { color: var(--move); }
.chip { display: inline-block; border: 1px solid var(--line); border-radius: 10px; padding: 0 7px;
        margin: 1px 3px 1px 0; font-size: 12px; background: #fafbfc; }
details > summary { cursor: pointer; color: var(--accent); }
.lists { display: flex; flex-wrap: wrap; gap: 24px; margin: 6px 0 4px; }
.lists > div { flex: 1 1 380px; min-width: 0; }
.scroll { max-height: 340px; overflow: auto; border: 1px solid #eef0f4; }
#layout-search { width: 420px; max-width: 100%; padding: 6px 9px; border: 1px solid var(--line);
                 border-radius: 5px; font-size: 14px; }
#layout-table-wrap { max-height: 560px; overflow: auto; margin-top: 8px; border: 1px solid #eef0f4; }
#layout-table th { position: sticky; top: 0; background: #fff; }
#layout-table td { white-space: nowrap; }
#layout-table td.src { white-space: normal; min-width: 300px; color: var(--muted); }
#layout-table td.why { white-space: normal; min-width: 280px; }
button { font: inherit; font-size: 13px; padding: 3px 10px; border: 1px solid var(--line); background: #fff;
         border-radius: 4px; cursor: pointer; }
.chart { position: relative; width: 100%; }
#timeline-canvas { display: block; width: 100%; border: 1px solid #eef0f4; cursor: crosshair; }
.legend { display: flex; flex-wrap: wrap; gap: 14px; font-size: 12px; color: var(--muted); margin: 6px 0; }
.legend i { display: inline-block; width: 12px; height: 12px; vertical-align: -2px; margin-right: 4px;
            border-radius: 2px; }
.tip { position: absolute; pointer-events: none; background: #1d2330; color: #fff; font-size: 12px;
       padding: 6px 9px; border-radius: 4px; max-width: 460px; z-index: 10; display: none;
       white-space: pre-wrap; overflow-wrap: anywhere; }
svg text { font: 11px system-ui, sans-serif; fill: #4a5363; }
"""

BODY = """
<header>
  <h1>hyper_parallel report</h1>
  <div class="sub" id="subtitle"></div>
</header>
<nav>
  <a href="#summary">Summary</a><a href="#passes">Passes</a><a href="#layouts">Layouts</a>
  <a href="#timeline">Timeline</a><a href="#memory">Memory</a>
</nav>
<main>
  <section id="summary"><h2>Summary</h2><div id="summary-body"></div></section>
  <section id="passes"><h2>Passes</h2>
    <p class="note">Each stage of the compile, in order, and what it did to the graph by node name:
    nodes added, removed and moved (the fewest nodes whose moving explains the new order). The partition
    compares the forward and backward programs together with the last joint graph.</p>
    <div id="passes-body"></div></section>
  <section id="layouts"><h2>Layouts</h2>
    <p class="note">One row per node of the final joint graph (layouts.tsv). It opens on the collectives and
    layout changes, each with why the program has it (a plan entry, an op's sharding rule, the loss, an FSDP
    unit, a pass); untick the box for every node. Type to filter: every word must appear in the row.</p>
    <label class="note"><input id="layout-only-comm" type="checkbox" checked> only collectives and layout changes</label>
    <input id="layout-search" type="search" placeholder="filter, e.g.  layers.0 mm  or  all_reduce  or  plan:" autocomplete="off">
    <span id="layout-count" class="note"></span>
    <div id="layout-table-wrap"><table id="layout-table"><thead></thead><tbody></tbody></table></div>
    <div id="layout-more"></div></section>
  <section id="timeline"><h2>Timeline (cost-model estimate)</h2><div id="timeline-body"></div></section>
  <section id="memory"><h2>Memory over the step (estimate)</h2><div id="memory-body"></div></section>
</main>
"""

# Runs first: records uncaught errors where a headless check (tests/tools/test_report.py) reads them.
ERROR_HOOK = """
window.__hpErrors = [];
window.addEventListener("error", function (e) {
  window.__hpErrors.push(String(e.message || e));
  document.documentElement.setAttribute("data-errors", window.__hpErrors.join(" | "));
});
"""


def _embed_json(data) -> str:
    """JSON safe inside a <script> element: no "<", ">" or "&" survives unescaped, so no string in
    the data (a source line, a module name) can close the element or open a comment."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(data: dict) -> str:
    """The complete HTML page for ``data`` (``report.data.load_page_data``)."""
    title = f"hyper_parallel report: rank {data['rank']}"
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(title)}</title>",
        f"<script>{ERROR_HOOK}</script>",
        f"<style>{CSS}</style>",
        "</head>",
        "<body>",
        BODY,
        f'<script type="application/json" id="hp-data">{_embed_json(data)}</script>',
        f"<script>{SCRIPT}</script>",
        "</body>",
        "</html>",
        "",
    ])
