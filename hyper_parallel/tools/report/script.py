"""The report page's script: plain JavaScript (no library), inlined by ``page.py``.

It reads the embedded JSON (``#hp-data``) and builds the sections: summary cards and tables, the
per-pass changes (lists built lazily when a row is opened), the layout table with its search box,
the timeline (a canvas: compute and communication streams over the simulated step, wheel to zoom,
drag to pan, hover for the event) and memory over the step (an SVG: live bytes stacked by category,
the peak marked, hover for the node). When done it sets ``document.body.dataset.rendered = "ok"``.
"""

SCRIPT = r"""
(function () {
"use strict";
var D = JSON.parse(document.getElementById("hp-data").textContent);
var SVGNS = "http://www.w3.org/2000/svg";  // a namespace name, never fetched

function el(tag, attrs, children) {
  var node = document.createElement(tag);
  for (var k in (attrs || {})) {
    if (k === "text") node.textContent = attrs[k];
    else if (k === "cls") node.className = attrs[k];
    else node.setAttribute(k, attrs[k]);
  }
  (children || []).forEach(function (c) {
    if (c !== null && c !== undefined) node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
  });
  return node;
}
function svg(tag, attrs) {
  var node = document.createElementNS(SVGNS, tag);
  for (var k in (attrs || {})) {
    if (k === "text") node.textContent = attrs[k]; else node.setAttribute(k, attrs[k]);
  }
  return node;
}
function fmtBytes(n) {
  var units = [["GiB", 1073741824], ["MiB", 1048576], ["KiB", 1024]];
  for (var i = 0; i < units.length; i++) if (Math.abs(n) >= units[i][1]) return (n / units[i][1]).toFixed(2) + " " + units[i][0];
  return n + " B";
}
function fmtUs(us) {
  if (Math.abs(us) >= 1e6) return (us / 1e6).toFixed(3) + " s";
  if (Math.abs(us) >= 1e3) return (us / 1e3).toFixed(3) + " ms";
  return us.toFixed(us >= 100 ? 1 : 2) + " \u00b5s";
}
// A compile's dump cannot know the optimizer (memory_report(optimizer) adds it); explain's names it.
function optimizerNote(optimizer) {
  return optimizer && optimizer !== "none" ? optimizer + " optimizer state counted" : "no optimizer state counted (the dump cannot know the optimizer)";
}
function fmtS(s) { return fmtUs(s * 1e6); }
function fmtTick(us, step) {  // axis labels: the unit of the tick step, just enough decimals
  var unit = step >= 1e6 ? [1e6, " s"] : step >= 1e3 ? [1e3, " ms"] : [1, " \u00b5s"];
  var digits = Math.max(0, -Math.floor(Math.log10(step / unit[0]) + 1e-9));
  return (us / unit[0]).toFixed(Math.min(digits, 6)) + unit[1];
}
function fmtCount(n) {
  var units = [["T", 1e12], ["G", 1e9], ["M", 1e6], ["K", 1e3]];
  for (var i = 0; i < units.length; i++) if (Math.abs(n) >= units[i][1]) return (n / units[i][1]).toFixed(2) + " " + units[i][0];
  return String(n);
}
function card(k, v, d) {
  return el("div", {cls: "card"}, [el("div", {cls: "k", text: k}), el("div", {cls: "v", text: v}),
    d ? el("div", {cls: "d", text: d}) : null]);
}
function table(head, rows, numeric) {
  numeric = numeric || [];
  var thead = el("thead", {}, [el("tr", {}, head.map(function (h, i) {
    return el("th", {cls: numeric.indexOf(i) >= 0 ? "num" : "", text: h});
  }))]);
  var tbody = el("tbody", {}, rows.map(function (r) {
    return el("tr", {}, r.map(function (c, i) {
      return el("td", {cls: numeric.indexOf(i) >= 0 ? "num" : "", text: String(c)});
    }));
  }));
  return el("table", {}, [thead, tbody]);
}
function missing(where, reason) { where.appendChild(el("p", {cls: "missing", text: reason})); }

// --- header and summary -----------------------------------------------------------------------

function renderHeader() {
  var mesh = D.summary.mesh || {};
  var axes = Object.keys(mesh).map(function (a) { return a + "=" + mesh[a]; }).join(" \u00d7 ") || "1 rank";
  document.getElementById("subtitle").textContent =
    "rank " + D.rank + " (ranks in dump: " + D.ranks.join(", ") + ") \u00b7 mesh " + axes + " \u00b7 " + D.dump_dir;
}

var KIND_COLORS = {all_gather: "#2e9e5b", reduce_scatter: "#8e5bd0", all_reduce: "#e08a1e",
                   all_to_all: "#1f9fb0", broadcast: "#7b8494"};

function renderSummary() {
  var S = D.summary, body = document.getElementById("summary-body");
  var mem = S.memory || {}, coll = S.collectives || {}, per = S.collectives_per_step || {};
  var nColl = 0, nBytes = 0;
  Object.keys(per).forEach(function (k) { Object.keys(per[k]).forEach(function (a) { nColl += per[k][a].count; nBytes += per[k][a].bytes; }); });
  var cards = el("div", {cls: "cards"});
  var mesh = S.mesh || {};
  cards.appendChild(card("mesh", Object.keys(mesh).map(function (a) { return a + "=" + mesh[a]; }).join(" \u00d7 ") || "1 rank",
                         "spmd hash " + String(S.spmd_hash || "-").slice(0, 16)));
  if (mem.peak !== undefined) cards.appendChild(card("peak memory (est.)", fmtBytes(mem.peak),
      "at " + ((mem.peak_site || {}).where || "-") + "; " + optimizerNote(mem.optimizer)));
  cards.appendChild(card("collectives / step", String(nColl), fmtBytes(nBytes) + " of local inputs"));
  var T = D.timeline && D.timeline.totals;
  if (T && T.step_s !== undefined) {
    cards.appendChild(card("step time (est., " + T.profile + ")", fmtS(T.step_s),
      "compute " + fmtS(T.compute_s) + ", comm " + fmtS(T.comm_s) + " (" + fmtS(T.exposed_comm_s) + " exposed)"));
  }
  cards.appendChild(card("fallbacks", String((S.fallbacks || []).length), "ops without a sharding rule, run replicated"));
  body.appendChild(cards);

  var cols = el("div", {cls: "cols"});
  // Collectives by kind and axis: forward / backward counts, bytes per step.
  var rows = [];
  Object.keys(per).sort().forEach(function (k) {
    Object.keys(per[k]).sort().forEach(function (a) {
      var f = ((coll.forward || {})[k] || {})[a], b = ((coll.backward || {})[k] || {})[a];
      rows.push([k, a, f ? f.count : 0, b ? b.count : 0, per[k][a].count, fmtBytes(per[k][a].bytes)]);
    });
  });
  var c1 = el("div", {}, [el("h3", {text: "Collectives per step"})]);
  if (rows.length) c1.appendChild(table(["kind", "axis", "forward", "backward", "total", "bytes"], rows, [2, 3, 4, 5]));
  else c1.appendChild(el("p", {cls: "note", text: "no collectives"}));
  c1.appendChild(el("p", {cls: "note", text: "bytes: each collective's local input"}));
  cols.appendChild(c1);
  // Memory numbers.
  if (mem.peak !== undefined) {
    var mrows = [["parameters", mem.params], ["buffers", mem.buffers], ["inputs", mem.inputs], ["gradients", mem.grads],
                 ["saved activations", mem.saved_activations], ["comm buffers (max live)", mem.comm_buffers_max],
                 ["forward peak", mem.peak_forward], ["backward peak", mem.peak_backward],
                 ["optimizer step peak", mem.peak_optimizer], ["peak", mem.peak]];
    // What the caching allocator reserves (analysis/allocator_model.py); older dumps have no such entry.
    if (mem.reserved_expandable) mrows.push(["reserved, expandable segments", mem.reserved_expandable],
                                            ["reserved, default allocator", mem.reserved_default]);
    var c2 = el("div", {}, [el("h3", {text: "Memory (" + mem.device + ", optimizer: " + mem.optimizer + ")"}),
      table(["", "bytes"], mrows.map(function (r) { return [r[0], fmtBytes(r[1] || 0)]; }), [1])]);
    cols.appendChild(c2);
    var at = mem.at_peak || {};
    var c3 = el("div", {}, [el("h3", {text: "Live at the peak"}),
      table(["category", "bytes"], Object.keys(at).filter(function (k) { return at[k]; }).map(function (k) { return [k, fmtBytes(at[k])]; }), [1]),
      el("p", {cls: "note", text: "peak at " + ((mem.peak_site || {}).where || "-")})]);
    cols.appendChild(c3);
  }
  // Inputs.
  var inputs = S.inputs || {};
  var c4 = el("div", {}, [el("h3", {text: "Inputs"}), table(["input", "placements"],
    Object.keys(inputs).sort().map(function (k) { return [k, "[" + inputs[k].join(", ") + "]"]; }))]);
  cols.appendChild(c4);
  body.appendChild(cols);
  var fallbacks = S.fallbacks || [], boundaries = S.plan_redistributions || [];
  if (fallbacks.length || boundaries.length) {
    // Each line is "<what>: <detail>": a table of the two, not raw JSON.
    var split = function (line) {
      var i = line.indexOf(": ");
      return i < 0 ? [line, ""] : [line.slice(0, i), line.slice(i + 2)];
    };
    var parts = [el("summary", {text: "fallbacks (" + fallbacks.length + ") and plan-imposed redistributions (" +
                                      boundaries.length + ")"})];
    if (fallbacks.length) {
      parts.push(el("h3", {text: "ops without a sharding rule, run replicated"}),
                 table(["op", "why"], fallbacks.map(split)));
    }
    if (boundaries.length) {
      parts.push(el("h3", {text: "layout changes the plan imposes at module boundaries"}),
                 table(["boundary", "layout change (plan entry)"], boundaries.map(split)));
    }
    body.appendChild(el("details", {id: "fallbacks"}, parts));
  }
  var unplanned = S.unplanned_collectives || [];
  if (unplanned.length) {
    // Open: collectives an op's rule added beyond the plan's boundaries cost communication the plan did not ask for.
    body.appendChild(el("details", {id: "unplanned", open: "open"}, [
      el("summary", {text: "collectives the plan adds beyond its boundaries (" + unplanned.length + " modules)"}),
      table(["module", "per step", "axes", "plan entries", "example"], unplanned.map(function (f) {
        return [f.module, f.count + " " + f.kinds.join("/"), f.axes.join(", "), f.entries.join("; "), f.example];
      }))]));
  }
}

// --- passes -------------------------------------------------------------------------------------

function opCounts(list) {
  var counts = {};
  list.forEach(function (n) { counts[n.op] = (counts[n.op] || 0) + 1; });
  return Object.keys(counts).sort(function (a, b) { return counts[b] - counts[a] || (a < b ? -1 : 1); })
    .map(function (op) { return [op, counts[op]]; });
}
function shortOp(op) { return op.replace(/^_c10d_functional\./, "c10d.").replace(/\.default$/, ""); }

function nodeList(title, cls, list) {
  var box = el("div", {}, [el("h3", {cls: cls, text: title + " (" + list.length + ")"})]);
  if (!list.length) { box.appendChild(el("p", {cls: "note", text: "none"})); return box; }
  var rows = list.map(function (n) { return [n.node, shortOp(n.op), n.module || "(root)"]; });
  var t = table(["node", "op", "module"], rows);
  t.className = "mono";
  box.appendChild(el("div", {cls: "scroll"}, [t]));
  return box;
}

function renderPasses() {
  var body = document.getElementById("passes-body");
  var stages = D.passes || [];
  if (!stages.length) { missing(body, "passes.json lists no stages"); return; }
  var rows = [];
  var head = el("tr", {}, ["#", "stage", "graph file", "nodes", "added", "removed", "moved", "what changed"].map(function (h, i) {
    return el("th", {cls: i === 3 || (i >= 4 && i <= 6) ? "num" : "", text: h});
  }));
  var tbody = el("tbody");
  stages.forEach(function (s, i) {
    var files = s.file.split(", ");
    var fileCell = el("td", {cls: "mono"});
    files.forEach(function (f, j) {
      if (j) fileCell.appendChild(document.createTextNode(", "));
      fileCell.appendChild(el("a", {href: D.rank_dir_href + "/" + f, text: f}));
    });
    var nodes = s.nodes_before + " \u2192 " + s.nodes_after;
    if (s.programs) nodes = s.nodes_before + " \u2192 " + Object.keys(s.programs).map(function (p) { return p + " " + s.programs[p]; }).join(", ");
    var chips = el("div");
    opCounts(s.added).slice(0, 4).forEach(function (c) { chips.appendChild(el("span", {cls: "chip add", text: "+" + c[1] + " " + shortOp(c[0])})); });
    opCounts(s.removed).slice(0, 4).forEach(function (c) { chips.appendChild(el("span", {cls: "chip del", text: "\u2212" + c[1] + " " + shortOp(c[0])})); });
    if (s.moved.length) chips.appendChild(el("span", {cls: "chip mov", text: s.moved.length + " moved"}));
    var changed = s.added.length + s.removed.length + s.moved.length;
    var details = el("details", {"data-stage": s.stage}, [el("summary", {text: changed ? "nodes" : "no change"})]);
    // The lists go in a full-width row under the pass, built when first opened: a large model's
    // passes touch thousands of nodes.
    var detailRow = el("tr", {cls: "pass-detail", "data-stage": s.stage, style: "display:none"}, [el("td", {colspan: "8"})]);
    if (changed) {
      details.addEventListener("toggle", function () {
        detailRow.style.display = details.open ? "" : "none";
        if (!details.open || detailRow.dataset.built) return;
        detailRow.dataset.built = "1";
        detailRow.firstChild.appendChild(el("div", {cls: "lists"}, [nodeList("added", "add", s.added),
          nodeList("removed", "del", s.removed), nodeList("moved", "mov", s.moved)]));
      });
    }
    tbody.appendChild(el("tr", {cls: "pass-row"}, [
      el("td", {cls: "num", text: String(i)}), el("td", {text: s.stage}), fileCell,
      el("td", {cls: "num nowrap", text: nodes}),
      el("td", {cls: "num add", text: s.added.length ? "+" + s.added.length : "0"}),
      el("td", {cls: "num del", text: s.removed.length ? "\u2212" + s.removed.length : "0"}),
      el("td", {cls: "num mov", text: String(s.moved.length)}),
      el("td", {}, [chips, details])]));
    tbody.appendChild(detailRow);
  });
  body.appendChild(el("table", {id: "passes-table"}, [el("thead", {}, [head]), tbody]));
}

// --- layout table -------------------------------------------------------------------------------

var LAYOUT_LIMIT = 500;

function renderLayouts() {
  var L = D.layouts, input = document.getElementById("layout-search");
  var thead = document.querySelector("#layout-table thead"), tbody = document.querySelector("#layout-table tbody");
  var count = document.getElementById("layout-count"), more = document.getElementById("layout-more");
  var onlyBox = document.getElementById("layout-only-comm");
  thead.appendChild(el("tr", {}, L.columns.map(function (c) { return el("th", {text: c}); })));
  var haystack = L.rows.map(function (r) { return r.join("\t").toLowerCase(); });
  var srcCol = L.columns.indexOf("source"), whyCol = L.columns.indexOf("why");
  var opCol = L.columns.indexOf("op"), inCol = L.columns.indexOf("input_layouts"), showAll = false;
  // Collectives (not their waits) and the layout changes lowering made locally (slices): the rows
  // that cost communication or say where a value changed layout, each with its reason.
  function isComm(r) {
    if (whyCol < 0 || !r[whyCol]) return false;
    var op = r[opCol] || "";
    if (op.indexOf("_c10d_functional.") === 0) return op.indexOf("wait_tensor") < 0;
    return (r[inCol] || "").indexOf("->") >= 0;
  }
  var comm = L.rows.map(isComm), commCount = comm.filter(Boolean).length;
  function draw() {
    var words = input.value.toLowerCase().split(/\s+/).filter(Boolean), only = onlyBox.checked;
    var matches = [];
    for (var i = 0; i < L.rows.length; i++) {
      if (only && !comm[i]) continue;
      var h = haystack[i], ok = true;
      for (var w = 0; w < words.length && ok; w++) ok = h.indexOf(words[w]) >= 0;
      if (ok) matches.push(i);
    }
    var shown = showAll ? matches : matches.slice(0, LAYOUT_LIMIT);
    var frag = document.createDocumentFragment();
    shown.forEach(function (i) {
      frag.appendChild(el("tr", {}, L.rows[i].map(function (c, j) {
        return el("td", {cls: j === srcCol ? "src mono" : j === whyCol ? "why" : "mono", text: c});
      })));
    });
    tbody.textContent = "";
    tbody.appendChild(frag);
    var of = only ? commCount + " collectives and layout changes (" + L.rows.length + " nodes in all)" : L.rows.length + " rows";
    count.textContent = matches.length + " of " + of + (shown.length < matches.length ? ", showing the first " + shown.length : "");
    more.textContent = "";
    if (shown.length < matches.length) {
      var btn = el("button", {text: "show all " + matches.length});
      btn.addEventListener("click", function () { showAll = true; draw(); });
      more.appendChild(btn);
    }
  }
  var timer = null;
  input.addEventListener("input", function () { showAll = false; clearTimeout(timer); timer = setTimeout(draw, 80); });
  onlyBox.addEventListener("change", function () { showAll = false; draw(); });
  draw();
}

// --- timeline -----------------------------------------------------------------------------------

var CAT_COLORS = {compute: "#4f7fd6", wait: "#d9534f", runtime: "#a9b4c6", optimizer: "#5f6b7d"};
function eventColor(e) {
  if (e[4] === "comm") { var kind = e[3].split("[")[0]; return KIND_COLORS[kind] || "#7b8494"; }
  if (e[4] === "wait") return CAT_COLORS.wait;
  if (e[8] === "optimizer") return CAT_COLORS.optimizer;
  if (e[7] === "runtime" || e[3].indexOf("issue ") === 0) return CAT_COLORS.runtime;
  return CAT_COLORS.compute;
}
var PHASE_FILL = {forward: "rgba(79,127,214,0.08)", backward: "rgba(142,91,208,0.08)", optimizer: "rgba(95,107,125,0.12)"};

function renderTimeline() {
  var body = document.getElementById("timeline-body");
  var T = D.timeline;
  if (!T) { missing(body, D.missing.timeline); return; }
  var t = T.totals || {};
  body.appendChild(el("p", {}, [
    "Simulated step on the ", el("b", {text: String(t.profile)}), " hardware profile: ",
    el("b", {text: fmtS(t.step_s || 0)}), " (forward " + fmtS(t.forward_s || 0) + ", backward " + fmtS(t.backward_s || 0) +
    ", optimizer " + fmtS(t.optimizer_s || 0) + "); compute busy " + fmtS(t.compute_s || 0) + ", communication " +
    fmtS(t.comm_s || 0) + ", of which " + fmtS(t.exposed_comm_s || 0) + " exposed (compute waiting); " +
    fmtCount(t.flops || 0) + "FLOP."]));
  var legend = el("div", {cls: "legend"});
  [["compute", CAT_COLORS.compute], ["launch / runtime", CAT_COLORS.runtime], ["waiting on comm (exposed)", CAT_COLORS.wait],
   ["optimizer step (SGD, no state)", CAT_COLORS.optimizer]].concat(Object.keys(KIND_COLORS).map(function (k) { return [k, KIND_COLORS[k]]; }))
    .forEach(function (x) { legend.appendChild(el("span", {}, [el("i", {style: "background:" + x[1]}), x[0]])); });
  body.appendChild(legend);
  var controls = el("div", {cls: "note"}, ["Wheel to zoom, drag to pan, double-click (or ",
    el("button", {id: "timeline-reset", text: "reset"}), ") to see the whole step. Hover an event for its node."]);
  body.appendChild(controls);
  var wrap = el("div", {cls: "chart"});
  var canvas = el("canvas", {id: "timeline-canvas"});
  var tip = el("div", {cls: "tip"});
  wrap.appendChild(canvas); wrap.appendChild(tip);
  body.appendChild(wrap);
  if (D.trace_file) {
    body.appendChild(el("p", {cls: "note"}, ["Chrome trace of this step: ", el("a", {href: D.trace_file, text: D.trace_file}),
      " (open it in Perfetto: ui.perfetto.dev \u2192 Open trace file, or chrome://tracing)."]));
  }

  var E = T.events, streams = T.streams;
  var byStream = streams.map(function () { return []; });
  E.forEach(function (e) { byStream[e[0]].push(e); });
  var end = 0;
  E.forEach(function (e) { end = Math.max(end, e[1] + e[2]); });
  if (end <= 0) end = 1;
  var view = [0, end];
  var AXIS = 22, PHASE = 18, ROW = 44, GAP = 6, LABEL = 78;
  var H = AXIS + PHASE + streams.length * (ROW + GAP) + 4;
  var W = 0, ctx = canvas.getContext("2d");

  function rowTop(i) { return AXIS + PHASE + i * (ROW + GAP); }
  function xOf(us) { return LABEL + (us - view[0]) / (view[1] - view[0]) * (W - LABEL - 8); }
  function usOf(x) { return view[0] + (x - LABEL) / (W - LABEL - 8) * (view[1] - view[0]); }
  function firstVisible(list, t0) {  // first event ending after t0 (events on a stream do not overlap)
    var lo = 0, hi = list.length;
    while (lo < hi) { var mid = (lo + hi) >> 1; if (list[mid][1] + list[mid][2] < t0) lo = mid + 1; else hi = mid; }
    return lo;
  }
  function niceStep(span, n) {
    var raw = span / n, p = Math.pow(10, Math.floor(Math.log10(raw))), m = raw / p;
    return (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p;
  }
  function draw() {
    W = Math.max(400, wrap.clientWidth || 1000);
    var dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(W * dpr); canvas.height = Math.round(H * dpr);
    canvas.style.height = H + "px";
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, W, H);
    ctx.font = "11px system-ui, sans-serif";
    // Phases.
    T.phases.forEach(function (p) {
      var x0 = Math.max(LABEL, xOf(p.start)), x1 = Math.min(W - 8, xOf(p.end));
      if (x1 <= x0) return;
      ctx.fillStyle = PHASE_FILL[p.phase] || "rgba(0,0,0,0.05)";
      ctx.fillRect(x0, AXIS, x1 - x0, H - AXIS);
      ctx.fillStyle = "#4a5363";
      if (x1 - x0 > 50) ctx.fillText(p.phase, x0 + 4, AXIS + 13);
      ctx.strokeStyle = "#c9ced8"; ctx.beginPath(); ctx.moveTo(x0 + 0.5, AXIS); ctx.lineTo(x0 + 0.5, H); ctx.stroke();
    });
    // Time axis.
    var step = niceStep(view[1] - view[0], Math.max(2, Math.floor((W - LABEL) / 110)));
    ctx.fillStyle = "#4a5363"; ctx.strokeStyle = "#e3e6ec";
    for (var tick = Math.ceil(view[0] / step) * step; tick <= view[1]; tick += step) {
      var x = xOf(tick);
      ctx.beginPath(); ctx.moveTo(x + 0.5, AXIS - 4); ctx.lineTo(x + 0.5, H); ctx.stroke();
      ctx.fillText(fmtTick(tick, step), x + 2, 12);
    }
    // Streams.
    var drawn = 0;
    streams.forEach(function (s, i) {
      var top = rowTop(i);
      ctx.fillStyle = "#1d2330"; ctx.font = "600 12px system-ui, sans-serif"; ctx.fillText(s, 8, top + ROW / 2 + 4); ctx.font = "11px system-ui, sans-serif";
      ctx.fillStyle = "#f3f4f7"; ctx.fillRect(LABEL, top, W - LABEL - 8, ROW);
      var list = byStream[i];
      for (var j = firstVisible(list, view[0]); j < list.length && list[j][1] <= view[1]; j++) {
        var e = list[j], x0 = xOf(e[1]), x1 = xOf(e[1] + e[2]);
        ctx.fillStyle = eventColor(e);
        ctx.fillRect(x0, top + 3, Math.max(1, x1 - x0), ROW - 6);
        drawn++;
      }
    });
    canvas.dataset.drawn = String(drawn);
  }
  function hit(mx, my) {
    for (var i = 0; i < streams.length; i++) {
      var top = rowTop(i);
      if (my < top || my > top + ROW) continue;
      var list = byStream[i], slack = 3 * (view[1] - view[0]) / (W - LABEL), t = usOf(mx);
      var j = firstVisible(list, t - slack), best = null, dist = Infinity;
      for (; j < list.length && list[j][1] <= t + slack; j++) {
        var e = list[j], d = t < e[1] ? e[1] - t : t > e[1] + e[2] ? t - e[1] - e[2] : 0;
        if (d < dist) { dist = d; best = e; }
      }
      return best;
    }
    return null;
  }
  canvas.addEventListener("mousemove", function (ev) {
    var r = canvas.getBoundingClientRect(), mx = ev.clientX - r.left, my = ev.clientY - r.top;
    if (dragging) {
      var shift = (dragging.x - mx) / (W - LABEL - 8) * (dragging.view[1] - dragging.view[0]);
      view = [dragging.view[0] + shift, dragging.view[1] + shift]; draw(); return;
    }
    var e = hit(mx, my);
    if (!e) { tip.style.display = "none"; return; }
    var lines = [e[3], "node: " + (e[5] || "-"), "module: " + (e[6] || "(root)"), "op: " + (e[7] || "-"),
                 "phase: " + e[8], "start " + fmtUs(e[1]) + ", duration " + fmtUs(e[2])];
    if (e[10]) lines.push("bytes: " + fmtBytes(e[10]));
    if (e[9]) lines.push("FLOPs: " + fmtCount(e[9]));
    tip.textContent = lines.join("\n");
    tip.style.display = "block";
    tip.style.left = Math.min(mx + 14, W - 300) + "px"; tip.style.top = (my + 14) + "px";
  });
  canvas.addEventListener("mouseleave", function () { tip.style.display = "none"; dragging = null; });
  var dragging = null;
  canvas.addEventListener("mousedown", function (ev) { dragging = {x: ev.clientX - canvas.getBoundingClientRect().left, view: view.slice()}; });
  window.addEventListener("mouseup", function () { dragging = null; });
  canvas.addEventListener("wheel", function (ev) {
    ev.preventDefault();
    var r = canvas.getBoundingClientRect(), at = usOf(ev.clientX - r.left);
    var f = ev.deltaY > 0 ? 1.25 : 0.8, span = (view[1] - view[0]) * f;
    span = Math.min(end, Math.max(span, end / 1e6));
    var left = at - (at - view[0]) * (span / (view[1] - view[0]));
    view = [left, left + span]; draw();
  }, {passive: false});
  function reset() { view = [0, end]; draw(); }
  canvas.addEventListener("dblclick", reset);
  document.getElementById("timeline-reset").addEventListener("click", reset);
  window.addEventListener("resize", draw);
  draw();
}

// --- memory -------------------------------------------------------------------------------------

var MEM_COLORS = {params: "#4f7fd6", buffers: "#9bb3e0", inputs: "#7fc8d9", optimizer_state: "#5f6b7d",
                  grads: "#e08a1e", saved_activations: "#8e5bd0", comm_buffers: "#2e9e5b", temporaries: "#d9a441"};

function renderMemory() {
  var body = document.getElementById("memory-body");
  var M = D.memory;
  if (!M || !M.points.length) { missing(body, D.missing.memory || "no memory series in this dump"); return; }
  var P = M.points, cats = M.categories, peak = P[M.peak_index], est = M.estimate || {};
  body.appendChild(el("p", {}, ["Live bytes on " + (est.device || "the device") + " at every node of forward then backward (x: moment in the step), then the optimizer step. Peak ",
    el("b", {text: fmtBytes(peak[3])}), " at " + peak[0] + (peak[1] ? " " + peak[1] : "") + (peak[2] ? " in " + peak[2] : "") +
    ". Stacked by what holds the memory; " + optimizerNote(est.optimizer) + "."]));
  var legend = el("div", {cls: "legend"});
  cats.forEach(function (c) { legend.appendChild(el("span", {}, [el("i", {style: "background:" + (MEM_COLORS[c] || "#999")}), c])); });
  body.appendChild(legend);
  var wrap = el("div", {cls: "chart"});
  var tip = el("div", {cls: "tip"});
  body.appendChild(wrap);
  var W = Math.max(400, wrap.clientWidth || 1000), H = 300, L = 78, R = 12, TOP = 22, B = 26;
  var plotW = W - L - R, plotH = H - TOP - B;
  var maxY = 0;
  P.forEach(function (p) { maxY = Math.max(maxY, p[3]); });
  maxY = maxY * 1.08 || 1;
  var n = P.length;
  function x(i) { return L + (n > 1 ? i / (n - 1) : 0.5) * plotW; }
  function y(v) { return TOP + plotH - v / maxY * plotH; }
  var s = svg("svg", {id: "memory-chart", width: W, height: H, viewBox: "0 0 " + W + " " + H});
  // Phase bands.
  var runs = [];
  P.forEach(function (p, i) { if (!runs.length || runs[runs.length - 1].phase !== p[0]) runs.push({phase: p[0], a: i, b: i}); else runs[runs.length - 1].b = i; });
  runs.forEach(function (r) {
    var x0 = x(r.a), x1 = Math.max(x(r.b), x0 + 2);
    s.appendChild(svg("rect", {x: x0, y: TOP, width: x1 - x0, height: plotH, fill: PHASE_FILL[r.phase] || "rgba(0,0,0,0.04)"}));
    if (x1 - x0 > 50) s.appendChild(svg("text", {x: x0 + 4, y: TOP - 6, text: r.phase}));
  });
  // Y ticks.
  for (var k = 0; k <= 4; k++) {
    var v = maxY / 1.08 * k / 4, yy = y(v);
    s.appendChild(svg("line", {x1: L, x2: W - R, y1: yy, y2: yy, stroke: "#e3e6ec"}));
    s.appendChild(svg("text", {x: L - 6, y: yy + 4, "text-anchor": "end", text: fmtBytes(Math.round(v))}));
  }
  s.appendChild(svg("text", {x: L, y: H - 8, text: "node 0"}));
  s.appendChild(svg("text", {x: W - R, y: H - 8, "text-anchor": "end", text: "node " + (n - 1) + " (" + n + " moments)"}));
  // Downsample to about one point per pixel, keeping each column's largest total (the peak survives).
  var idx = [];
  if (n <= plotW * 2) { for (var i = 0; i < n; i++) idx.push(i); }
  else {
    var per = n / plotW;
    for (var c = 0; c < plotW; c++) {
      var a = Math.floor(c * per), b = Math.min(n, Math.floor((c + 1) * per)), best = a;
      for (var j = a; j < b; j++) if (P[j][3] > P[best][3]) best = j;
      idx.push(best);
    }
  }
  // Stacked areas, bottom category first.
  var base = idx.map(function () { return 0; });
  cats.forEach(function (c, ci) {
    var top = idx.map(function (i, m) { return base[m] + P[i][4][ci]; });
    if (top.every(function (t, m) { return t === base[m]; })) return;
    var pts = idx.map(function (i, m) { return x(i).toFixed(1) + "," + y(top[m]).toFixed(1); });
    var back = idx.map(function (i, m) { return x(i).toFixed(1) + "," + y(base[m]).toFixed(1); }).reverse();
    s.appendChild(svg("polygon", {points: pts.concat(back).join(" "), fill: MEM_COLORS[c] || "#999", "fill-opacity": "0.55", "data-category": c}));
    base = top;
  });
  s.appendChild(svg("polyline", {id: "memory-total", points: idx.map(function (i) { return x(i).toFixed(1) + "," + y(P[i][3]).toFixed(1); }).join(" "),
                                 fill: "none", stroke: "#1d2330", "stroke-width": "1.3"}));
  // The peak.
  var px = x(M.peak_index), py = y(peak[3]);
  s.appendChild(svg("line", {x1: px, x2: px, y1: TOP, y2: TOP + plotH, stroke: "#c4312b", "stroke-dasharray": "4 3"}));
  s.appendChild(svg("circle", {id: "memory-peak", cx: px, cy: py, r: 4.5, fill: "#c4312b"}));
  var label = "peak " + fmtBytes(peak[3]) + ": " + (peak[1] || peak[0]) + (peak[2] ? " (" + peak[2] + ")" : "");
  s.appendChild(svg("text", {x: px > W / 2 ? px - 8 : px + 8, y: Math.max(TOP + 12, py - 8), "text-anchor": px > W / 2 ? "end" : "start",
                             fill: "#c4312b", text: label, style: "fill:#c4312b;font-weight:600"}));
  // Hover.
  var cursor = svg("line", {x1: 0, x2: 0, y1: TOP, y2: TOP + plotH, stroke: "#1d2330", "stroke-opacity": "0.4", visibility: "hidden"});
  s.appendChild(cursor);
  var overlay = svg("rect", {x: L, y: TOP, width: plotW, height: plotH, fill: "transparent"});
  s.appendChild(overlay);
  overlay.addEventListener("mousemove", function (ev) {
    var r = s.getBoundingClientRect(), mx = ev.clientX - r.left;
    var i = Math.max(0, Math.min(n - 1, Math.round((mx - L) / plotW * (n - 1))));
    var p = P[i];
    cursor.setAttribute("x1", x(i)); cursor.setAttribute("x2", x(i)); cursor.setAttribute("visibility", "visible");
    var lines = ["#" + i + " " + p[0] + (p[1] ? " " + p[1] : " (phase boundary)"), "module: " + (p[2] || "(root)"), "live: " + fmtBytes(p[3])];
    cats.forEach(function (c, ci) { if (p[4][ci]) lines.push("  " + c + ": " + fmtBytes(p[4][ci])); });
    tip.textContent = lines.join("\n");
    tip.style.display = "block";
    tip.style.left = Math.min(mx + 14, W - 260) + "px"; tip.style.top = (ev.clientY - r.top + 14) + "px";
  });
  overlay.addEventListener("mouseleave", function () { tip.style.display = "none"; cursor.setAttribute("visibility", "hidden"); });
  wrap.appendChild(s);
  wrap.appendChild(tip);
}

renderHeader();
renderSummary();
renderPasses();
renderLayouts();
renderTimeline();
renderMemory();
document.body.dataset.rendered = "ok";
})();
"""
