"""The live page: one HTML document, no external assets; it polls /api/state every second."""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Pilotfish scheduler</title>
<style>
 body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
 h1 { font-size: 1.3em; margin: 0 0 .3em 0; }
 h2 { font-size: 1.05em; margin: 1.4em 0 .4em 0; }
 table { border-collapse: collapse; }
 th, td { padding: 3px 9px; border-bottom: 1px solid #ddd; text-align: right; white-space: nowrap; }
 th:first-child, td:first-child { text-align: left; }
 .ejected { color: #b00; font-weight: 600; }
 .ok { color: #070; }
 .stale { color: #b60; }
 #summary span { margin-right: 1.5em; }
 .muted { color: #777; }
</style>
</head>
<body>
<h1>Pilotfish scheduler</h1>
<div id="summary">loading&hellip;</div>
<h2>Engines</h2>
<table id="engines"><thead></thead><tbody></tbody></table>
<h2>Recent decisions</h2>
<table id="decisions"><thead><tr><th>time</th><th>request</th><th>engine</th><th>fallbacks</th></tr></thead>
<tbody></tbody></table>
<h2>Migrations</h2>
<table id="migrations"><thead><tr><th>policy</th><th>attempted</th><th>failed</th><th>migrated requests</th></tr>
</thead><tbody></tbody></table>
<p class="muted" id="updated"></p>
<script>
"use strict";
function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
}
function num(v, digits) {
  if (v === null || v === undefined) return "\\u2013";
  return digits === undefined ? String(v) : Number(v).toFixed(digits);
}
function render(s) {
  const summary = document.getElementById("summary");
  summary.replaceChildren();
  for (const [k, v] of [["mode", s.mode], ["policy", s.policy.name],
                        ["policy metrics", s.policy.metrics.join(", ") || "\\u2013"],
                        ["rescheduling", s.policy.rescheduling.join(", ") || "off"],
                        ["engines", s.engines.length], ["held requests", s.held_requests]]) {
    const span = document.createElement("span");
    span.textContent = k + ": " + v;
    summary.appendChild(span);
  }
  const total = document.createElement("span");
  total.id = "decisions-total";
  total.textContent = "decisions: " + s.decisions_total;
  summary.appendChild(total);

  const metricNames = s.engines.length ? Object.keys(s.engines[0].metrics) : [];
  const head = document.querySelector("#engines thead");
  head.replaceChildren();
  const hr = document.createElement("tr");
  for (const h of ["engine", "address", "type", "health", "dispatched", "held", "held tokens", "unconfirmed",
                   "running", "waiting", "KV use", "staleness s", ...metricNames]) {
    const th = document.createElement("th"); th.textContent = h; hr.appendChild(th);
  }
  head.appendChild(hr);
  const body = document.querySelector("#engines tbody");
  body.replaceChildren();
  for (const e of s.engines) {
    const tr = document.createElement("tr");
    tr.className = "engine";
    tr.dataset.engine = e.engine;
    cell(tr, e.engine, "name");
    cell(tr, e.address);
    cell(tr, e.infer_type);
    const stale = e.staleness_seconds !== null && e.staleness_seconds > 5;
    cell(tr, e.ejected ? "ejected" : (!e.schedulable ? "unschedulable" : (stale ? "stale" : "ok")),
         e.ejected || !e.schedulable ? "ejected" : (stale ? "stale" : "ok"));
    cell(tr, num(e.dispatched), "dispatched");
    cell(tr, num(e.held_requests));
    cell(tr, num(e.held_tokens));
    cell(tr, num(e.inflight_unconfirmed));
    cell(tr, num(e.running));
    cell(tr, num(e.waiting));
    cell(tr, e.kv_usage === null ? "\\u2013" : (100 * e.kv_usage).toFixed(1) + "%");
    cell(tr, num(e.staleness_seconds, 2));
    for (const m of metricNames) cell(tr, num(e.metrics[m], 3));
    body.appendChild(tr);
  }
  const dbody = document.querySelector("#decisions tbody");
  dbody.replaceChildren();
  for (const d of s.recent_decisions) {
    const tr = document.createElement("tr");
    tr.className = "decision";
    cell(tr, new Date(d.at * 1000).toISOString().slice(11, 23));
    cell(tr, d.request_id);
    cell(tr, d.decode_engine ? d.engine + " \\u2192 " + d.decode_engine : d.engine);
    cell(tr, d.fallbacks.join(", "));
    dbody.appendChild(tr);
  }
  const mbody = document.querySelector("#migrations tbody");
  mbody.replaceChildren();
  for (const m of s.migrations) {
    const tr = document.createElement("tr");
    cell(tr, m.policy); cell(tr, num(m.attempted || 0)); cell(tr, num(m.failed || 0));
    cell(tr, num(m.migrated_requests || 0));
    mbody.appendChild(tr);
  }
  document.getElementById("updated").textContent = "updated " + new Date(s.time * 1000).toISOString();
}
async function poll() {
  try {
    const reply = await fetch("api/state", {cache: "no-store"});
    if (reply.ok) render(await reply.json());
  } catch (err) {
    document.getElementById("updated").textContent = "scheduler unreachable: " + err;
  }
  setTimeout(poll, 1000);
}
poll();
</script>
</body>
</html>
"""
