"""``hyper-parallel report``: the dump files it reads, the page it writes, and the page rendered in
headless Chromium (no console messages, every section built, hover / search / expand work).

One compile of a 2-layer Llama with FSDP + TP on a 4-rank mesh of torch's fake process-group
backend (one process plays rank 0, nothing runs) writes the dump. (That the new dump files are
byte-identical across compiles is checked with every other dump file by
tests/compile/test_compile.py.) The Chromium checks skip when no Chromium binary is found,
except under CI (``CI`` set), where ``.ci/run`` installs it and its absence is a failure.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tempfile

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.tools.cli import main
from hyper_parallel.passes import pass_names

pytestmark = pytest.mark.timeout(180)

DUMP_FILES = ("passes.json", "memory.json", "trace.json", "summary.json", "layouts.tsv")


def _compile(dump_dir: str):
    from hyper_parallel.api import compile_for_inputs
    from hyper_parallel.tools.explain import fake_world
    from hyper_parallel.models.llama import LlamaConfig, LlamaForCausalLM
    from hyper_parallel.models.plans import llama_tp_plan

    with fake_world(4, 0):
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2))
        plan = {**llama_tp_plan(), "fully_shard": {"units": ["model.layers.*", ""]}}
        pmodel = hp.parallelize(model, plan, mesh, dump_dir=dump_dir)
        ids = torch.zeros(2, 16, dtype=torch.long)
        compile_for_inputs(pmodel, (), {"input_ids": ids, "labels": ids})
        forward, backward = pmodel.compiled_programs()
        counts = {name: sum(n.op != "output" for n in gm.graph.nodes)
                  for name, gm in (("forward", forward), ("backward", backward))}
        return pmodel.compile_summary(), counts


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process (leaked by another test)")
    root = tmp_path_factory.mktemp("report")
    summary, counts = _compile(str(root / "dump"))
    assert not dist.is_initialized()
    return {"dir": str(root / "dump"), "summary": summary, "counts": counts}


def _load(dump, name):
    with open(os.path.join(dump["dir"], "rank0", name)) as f:
        return json.load(f)


# --- the dump ---------------------------------------------------------------------------------------


def _comm_rows(layouts: dict) -> list[list[str]]:
    """The rows the Layouts table opens on: collectives (not their waits) and lowering's local layout
    changes, as the page selects them."""
    col = {c: i for i, c in enumerate(layouts["columns"])}
    return [r for r in layouts["rows"] if r[col["why"]] and (
        "wait_tensor" not in r[col["op"]] if r[col["op"]].startswith("_c10d_functional.")
        else "->" in r[col["input_layouts"]])]


@pytest.mark.slow
def test_every_collective_says_why(dump):
    """layouts.tsv's ``why`` column: every collective of the program has a reason, and FSDP + TP's
    reasons name the FSDP units, the plan entries, the vocab-parallel loss and the passes."""
    with open(os.path.join(dump["dir"], "rank0", "layouts.tsv")) as f:
        lines = f.read().splitlines()
    columns, rows = lines[0].split("\t"), [line.split("\t") for line in lines[1:]]
    assert columns[-1] == "why" and all(len(r) == len(columns) for r in rows)
    collectives = [r for r in rows if r[1].startswith("_c10d_functional.") and "wait_tensor" not in r[1]]
    assert collectives and all(r[-1] for r in collectives), [r[0] for r in collectives if not r[-1]]
    reasons = {r[-1] for r in collectives}
    assert "FSDP unit model.layers.0: all-gather of its parameters for forward (9 params; bucketing)" in reasons
    assert "FSDP unit model.layers.1: reduce-scatter of its gradients to their shards (9 params; bucketing)" \
        in reasons
    assert "plan: tensor_parallel['model.layers.*.self_attn.o_proj'] RowwiseParallel output 0" in reasons
    assert "plan: tensor_parallel['lm_head'] ColwiseParallel input 0 (its gradient)" in reasons
    assert any(r.startswith("op rule: aten._log_softmax, vocab-parallel cross-entropy") for r in reasons)
    assert any(r.startswith("fused: small reductions forward") for r in reasons)
    # Nodes that move nothing have no reason.
    assert not any(r[-1] for r in rows if r[1] in ("aten.mm.default", "placeholder"))
    assert dump["summary"]["unplanned_collectives"] == []


def test_dump_has_report_files(dump):
    for name in DUMP_FILES:
        assert os.path.isfile(os.path.join(dump["dir"], "rank0", name)), name


def test_passes_json_accounts_for_every_node(dump):
    stages = _load(dump, "passes.json")["stages"]
    assert [s["stage"] for s in stages] == ["captured", "lowered", *pass_names(), "partition"]
    previous = 0
    for s in stages:
        assert s["nodes_before"] == previous, s["stage"]
        if s["stage"] != "partition":
            assert s["nodes_after"] - s["nodes_before"] == len(s["added"]) - len(s["removed"]), s["stage"]
            previous = s["nodes_after"]
        for entry in s["added"] + s["removed"] + s["moved"]:
            assert set(entry) == {"node", "op", "module"}
    assert stages[0]["nodes_after"] == len(stages[0]["added"]) > 0
    # FSDP + TP: lowering adds the collectives, bucketing fuses FSDP's, prefetch reorders.
    by = {s["stage"]: s for s in stages}
    assert any("all_gather" in e["op"] for e in by["lowered"]["added"])
    assert by["bucketing"]["added"] and by["bucketing"]["removed"]
    assert by["prefetch"]["moved"]
    # Ops are named alike in every run: a Python function target (the agreement gate, the
    # collective-input releases) by its module and name, never by its repr's address.
    ops = {e["op"] for s in stages for e in s["added"] + s["removed"] + s["moved"]}
    assert "hyper_parallel.runtime.agreement_gate.await_agreement" in ops, sorted(ops)
    assert not [op for op in ops if " at 0x" in op], sorted(ops)
    assert by["partition"]["programs"] == dump["counts"]


def test_memory_series_peaks_at_the_estimate(dump):
    memory = _load(dump, "memory.json")
    peak = dump["summary"]["memory"]["peak"]
    points = memory["points"]
    assert max(p["bytes"] for p in points) == memory["estimate"]["peak"] == peak
    assert [p["phase"] for p in points][-1] == "optimizer"
    assert {p["phase"] for p in points} == {"forward", "backward", "optimizer"}
    for p in points:
        assert sum(p["live"]) == p["bytes"] and len(p["live"]) == len(memory["categories"])


def test_trace_json_has_every_collective_on_the_comm_stream(dump):
    trace = _load(dump, "trace.json")
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    threads = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    comm = [e for e in events if e["tid"] == threads["comm"]]
    per_step = dump["summary"]["collectives_per_step"]
    assert len(comm) == sum(entry["count"] for axes in per_step.values() for entry in axes.values())
    assert {e["args"]["phase"] for e in events} == {"forward", "backward", "optimizer"}
    assert trace["otherData"]["profile"] == "cpu"  # a cpu mesh: the cpu profile
    assert all(e["dur"] >= 0 for e in events)


# --- the command --------------------------------------------------------------------------------


def _page_data(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    match = re.search(r'<script type="application/json" id="hp-data">(.*?)</script>', text, re.S)
    assert match, "no embedded data"
    return json.loads(match.group(1))


def test_report_command_writes_page_and_trace(dump, capsys, tmp_path):
    out = str(tmp_path / "page.html")
    assert main(["report", dump["dir"], "--out", out]) == 0
    printed = capsys.readouterr().out
    trace = str(tmp_path / "page.trace.json")
    assert out in printed and trace in printed
    with open(trace) as f:
        assert json.load(f) == _load(dump, "trace.json")
    with open(out, encoding="utf-8") as f:
        html = f.read()
    # Self-contained: nothing fetched (the SVG namespace name is an identifier, not a fetch).
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html)
    assert "url(" not in html and "@import" not in html and "https://" not in html
    assert html.replace('"http://www.w3.org/2000/svg"', "").count("http://") == 0
    data = _page_data(out)
    assert data["rank"] == 0 and data["ranks"] == [0]
    assert len(data["passes"]) == len(pass_names()) + 3
    assert len(data["layouts"]["rows"]) > 100 and data["layouts"]["columns"][0] == "node"
    assert len(data["timeline"]["events"]) == trace_events(trace)
    assert data["memory"]["points"][data["memory"]["peak_index"]][3] == dump["summary"]["memory"]["peak"]
    assert os.path.isfile(os.path.join(tmp_path, data["rank_dir_href"], data["passes"][0]["file"]))


def trace_events(path: str) -> int:
    with open(path) as f:
        return sum(e["ph"] == "X" for e in json.load(f)["traceEvents"])


def test_report_default_output_next_to_dump(dump, tmp_path, capsys):
    copy = tmp_path / "dump"
    shutil.copytree(dump["dir"], copy)
    assert main(["report", str(copy), "--rank", "0"]) == 0
    assert os.path.isfile(copy / "report.html") and os.path.isfile(copy / "report.trace.json")


@pytest.mark.parametrize("case", ["no_dir", "no_ranks", "bad_rank", "missing_file"])
def test_report_errors_are_one_line_exit_2(dump, tmp_path, capsys, case):
    if case == "no_dir":
        argv, expect = ["report", str(tmp_path / "nope")], "is not a directory"
    elif case == "no_ranks":
        argv, expect = ["report", str(tmp_path)], "no rank<N>/ folders"
    elif case == "bad_rank":
        argv, expect = ["report", dump["dir"], "--rank", "7"], "no dump of rank 7; ranks present: [0]"
    else:
        copy = tmp_path / "dump"
        shutil.copytree(dump["dir"], copy)
        os.remove(copy / "rank0" / "passes.json")
        argv, expect = ["report", str(copy)], "lacks passes.json"
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hyper-parallel report: error:") and expect in err[0], err


# --- headless Chromium --------------------------------------------------------------------------

_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def _chromium() -> str:
    found = os.environ.get("HP_CHROMIUM") or next((p for b in _BROWSERS if (p := shutil.which(b))), None)
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("CI is set but no Chromium was found (looked for HP_CHROMIUM and " + ", ".join(_BROWSERS)
                    + " on PATH); .ci/run installs it with apt-get: see its log for why that failed")
    pytest.skip("no Chromium on PATH (apt-get install chromium, or set HP_CHROMIUM); CI installs it and runs this")


def _render(path: str, extra: tuple[str, ...] = ()) -> tuple[str, list[str]]:
    """(dumped DOM, console lines) of ``path`` in headless Chromium, after its timers ran."""
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
             "--window-size=1400,2000", "--virtual-time-budget=3000", *extra, "--dump-dom", "file://" + path],
            capture_output=True, text=True, timeout=120,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Chromium logs every console message (any level) and uncaught exceptions as CONSOLE lines.
    console = [line for line in proc.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    return proc.stdout, console


def _attr(dom: str, name: str) -> str | None:
    match = re.search(rf'{name}="([^"]*)"', dom)
    return match.group(1) if match else None


# Appended to a copy of the page: exercises search, expand and both hovers, records the results.
PROBE = """<script>
setTimeout(function () {
  var input = document.getElementById("layout-search");
  input.value = "all_gather_into_tensor";
  input.dispatchEvent(new Event("input"));
  var details = document.querySelector('details[data-stage="bucketing"]');
  details.open = true;
  var canvas = document.getElementById("timeline-canvas"), r = canvas.getBoundingClientRect();
  var hits = 0, tips = [];
  for (var x = r.left + 100; x < r.right - 10; x += 25) {
    // The comm stream's row: below the time axis (22 px), the phase band (18) and the compute row (44 + 6).
    canvas.dispatchEvent(new MouseEvent("mousemove", {clientX: x, clientY: r.top + 22 + 18 + 50 + 22, bubbles: true}));
    var tip = canvas.parentNode.querySelector(".tip");
    if (tip.style.display === "block") { hits++; tips.push(tip.textContent); }
  }
  var peak = document.getElementById("memory-peak"), overlay = document.querySelector("#memory-chart rect:last-of-type");
  var pr = peak.getBoundingClientRect();
  overlay.dispatchEvent(new MouseEvent("mousemove", {clientX: Math.round(pr.left + pr.width / 2), clientY: Math.round(pr.top + 20), bubbles: true}));
  var memtip = overlay.ownerSVGElement.parentNode.querySelector(".tip").textContent;
  setTimeout(function () {
    var b = document.body.dataset;
    b.probeRows = String(document.querySelectorAll("#layout-table tbody tr").length);
    var only = document.getElementById("layout-only-comm");
    only.checked = false;
    input.value = "";
    only.dispatchEvent(new Event("change"));
    b.probeAllRows = String(document.querySelectorAll("#layout-table tbody tr").length);
    var lists = document.querySelector('tr.pass-detail[data-stage="bucketing"]');
    b.probeDetails = lists.querySelectorAll(".lists > div").length + "";
    b.probeAdded = lists.querySelectorAll(".lists > div:first-child tbody tr").length + "";
    b.probeHits = String(hits);
    b.probeTip = tips.filter(function (t) { return t.indexOf("[") > 0; })[0] || "";
    b.probeMemtip = memtip;
  }, 400);
}, 100);
</script></body>"""


@pytest.mark.slow
def test_page_renders_in_headless_chromium(dump, tmp_path):
    _chromium()
    out = str(tmp_path / "report.html")
    assert main(["report", dump["dir"], "--out", out]) == 0
    data = _page_data(out)
    dom, console = _render(out)
    assert console == [], console
    assert _attr(dom, "data-errors") is None
    assert _attr(dom, "data-rendered") == "ok"
    # Every section was built from the data.
    assert dom.count('class="pass-row"') == len(data["passes"])
    # The Layouts table opens on the collectives and layout changes, each with its reason.
    rows, comm = len(data["layouts"]["rows"]), len(_comm_rows(data["layouts"]))
    assert 0 < comm < rows
    assert f"{comm} of {comm} collectives and layout changes ({rows} nodes in all)" in dom
    assert dom.count('class="why"') == comm
    assert _attr(dom, "data-drawn") == str(len(data["timeline"]["events"]))
    assert 'id="memory-total"' in dom and 'id="memory-peak"' in dom
    assert "reserved, expandable segments" in dom  # the caching allocator's predicted reserved peak
    assert 'class="missing"' not in dom
    # The plan's boundary layout changes (TP's) as a table: boundary, then the change and its entry.
    boundaries = data["summary"]["plan_redistributions"]
    assert boundaries and '<details id="fallbacks">' in dom
    key, change = boundaries[0].split(": ", 1)
    row = f'<td class="">{key}</td><td class="">{html.escape(change, quote=False)}</td>'
    assert row in dom, dom[dom.index('id="fallbacks"'):][:1500]

    # Interactions: search filters the table, a pass row expands, hovering shows events and memory.
    with open(out, encoding="utf-8") as f:
        page = f.read()
    probe = str(tmp_path / "probe.html")
    with open(probe, "w", encoding="utf-8") as f:
        f.write(page.replace("</body>", PROBE))
    dom, console = _render(probe)
    assert console == [] and _attr(dom, "data-errors") is None, (console, _attr(dom, "data-errors"))
    gathers = sum("all_gather_into_tensor" in "\t".join(r) for r in _comm_rows(data["layouts"]))
    assert int(_attr(dom, "data-probe-rows")) == gathers > 0
    # Unticked, with no search: every node (up to the table's first 500).
    assert int(_attr(dom, "data-probe-all-rows")) == min(500, len(data["layouts"]["rows"])) > comm
    assert _attr(dom, "data-probe-details") == "3"  # added, removed, moved
    bucketing = next(s for s in data["passes"] if s["stage"] == "bucketing")
    assert _attr(dom, "data-probe-added") == str(len(bucketing["added"]))
    assert int(_attr(dom, "data-probe-hits")) > 0
    assert re.match(r"(all_gather|all_reduce|reduce_scatter)\[", _attr(dom, "data-probe-tip") or ""), dom[-2000:]
    peak = data["memory"]["points"][data["memory"]["peak_index"]]
    assert peak[1] in _attr(dom, "data-probe-memtip") and "live: " in _attr(dom, "data-probe-memtip")


def test_page_without_trace_or_memory_renders(dump, tmp_path):
    _chromium()
    copy = tmp_path / "dump"
    shutil.copytree(dump["dir"], copy)
    os.remove(copy / "rank0" / "trace.json")
    os.remove(copy / "rank0" / "memory.json")
    assert main(["report", str(copy)]) == 0
    assert not os.path.exists(copy / "report.trace.json")
    dom, console = _render(str(copy / "report.html"))
    assert console == [] and _attr(dom, "data-errors") is None and _attr(dom, "data-rendered") == "ok"
    assert "trace.json is not in this dump" in dom and "memory.json is not in this dump" in dom


def test_chromium_check_catches_script_errors(tmp_path):
    """The harness itself: an uncaught error is seen both in the console log and in data-errors.
    (The page it breaks has no data at all: it still renders, each section saying what is missing.)"""
    _chromium()
    from hyper_parallel.tools.report.page import render_page

    page = render_page({"rank": 0, "ranks": [0], "dump_dir": "x", "summary": {}, "passes": [], "missing": {},
                        "layouts": {"columns": ["node"], "rows": []}, "timeline": None, "memory": None})
    path = tmp_path / "broken.html"
    path.write_text(page.replace("</body>", "<script>null.boom();</script></body>"))
    dom, console = _render(str(path))
    assert any("Uncaught" in line for line in console), console
    assert "boom" in (_attr(dom, "data-errors") or "")
    assert _attr(dom, "data-rendered") == "ok"  # the page itself (with no data at all) rendered first


@pytest.mark.slow
def test_explain_dump_page_shows_what_explain_printed(tmp_path, capsys):
    """``explain --dump-dir`` then ``report``: the rendered page names the hardware explain priced the
    step on, its step time and peak, and the optimizer whose state explain counted."""
    _chromium()
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"base": "llama3-8b", "hidden_size": 256, "intermediate_size": 512,
                                  "num_attention_heads": 8, "num_hidden_layers": 1, "vocab_size": 1024}))
    dump = tmp_path / "dump"
    assert main(["explain", "--config", str(config), "--parallel", "dp_shard=-1,tp=2", "--world-size", "8",
                 "--plan", "fsdp+tp", "--seq-len", "64", "--hardware", "a100", "--dump-dir", str(dump),
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert main(["report", str(dump)]) == 0
    dom, console = _render(str(dump / "report.html"))
    assert console == [] and _attr(dom, "data-errors") is None and _attr(dom, "data-rendered") == "ok"
    shown_dom = re.sub(r"<(script|style)\b.*?</\1>", "", dom, flags=re.S)
    text = html.unescape(re.sub(r"<[^>]+>", "", shown_dom))
    step = printed["step"]["step_s"] * 1e6  # fmtUs: ms with 3 decimals at this size
    assert 1e3 <= step < 1e6
    assert f"Simulated step on the a100 hardware profile: {step / 1e3:.3f} ms" in text, text[:3000]
    peak = printed["memory"]["peak"] / 2 ** 30 if printed["memory"]["peak"] >= 2 ** 30 else None
    shown = f"{peak:.2f} GiB" if peak else f"{printed['memory']['peak'] / 2 ** 20:.2f} MiB"
    assert f"peak memory (est.){shown}" in text.replace("\n", "")
    assert "Memory (a100, optimizer: adamw)" in text and "adamw optimizer state counted" in text
    assert "undefined" not in text and "no optimizer state counted" not in text
