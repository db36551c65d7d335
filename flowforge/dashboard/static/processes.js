// Processes: every registered process of every tree (GET /api/v1/processes), every 2 s.

import { $, el, getJSON, initChrome, poller, renderRows, timeCell } from "./app.js";

const REFRESH_MS = 2000;

function row(p) {
  return el(
    "tr",
    { "data-pid": p.pid, "data-host": p.host, "data-role": p.role, class: p.live ? null : "stale" },
    el("td", {}, p.host),
    el("td", { class: "num" }, String(p.pid)),
    el("td", {}, p.role),
    timeCell(p.started_at),
    timeCell(p.last_seen_at),
    el("td", { class: "num" }, `${Number(p.silent_s).toFixed(1)} s`),
    el("td", {}, p.queue ?? "—"),
  );
}

async function refresh() {
  const data = await getJSON("/api/v1/processes");
  const key = (p) => `${p.id}|${p.last_seen_at}|${p.live}`;
  renderRows($("[data-testid=processes-table] tbody"), data.processes, key, row);
  $("#processes-empty").hidden = data.processes.length > 0;
}

initChrome();
poller(REFRESH_MS, refresh).start();
