// Overview: counts by state, tasks finished per minute, backlog, poison candidates, dead tasks
// by reason, outbox lag and live processes, from GET /api/v1/overview every few seconds.

import { $, el, getJSON, initChrome, poller, svg, when } from "./app.js";

const REFRESH_MS = 3000;
const CHART = { width: 720, height: 180, left: 36, right: 8, top: 10, bottom: 22 };
const SERIES = [
  ["succeeded", "SUCCEEDED"],
  ["dead", "DEAD"],
  ["cancelled", "CANCELLED"],
];

// A count above 100,000 is PostgreSQL's estimate (migration 0023): shown as "≈ n", with a title
// that says so; the api lists those states under "estimated".
function setCounts(kind, counts, estimated = []) {
  for (const [state, n] of Object.entries(counts)) {
    const cell = $(`[data-testid="${kind}-count-${CSS.escape(state)}"]`);
    if (!cell) continue;
    const rough = estimated.includes(state);
    cell.textContent = rough ? `≈ ${n.toLocaleString("en")}` : String(n);
    cell.title = rough ? "more than 100,000: PostgreSQL's estimate, not a count" : "";
  }
}

function hhmm(iso) {
  return when(iso).slice(11, 16);
}

function drawThroughput(minutes) {
  const chart = $("[data-testid=throughput-chart]");
  const { width, height, left, right, top, bottom } = CHART;
  const plotW = width - left - right;
  const plotH = height - top - bottom;
  const totals = minutes.map((m) => m.succeeded + m.dead + m.cancelled);
  const peak = Math.max(1, ...totals);
  const step = plotW / Math.max(1, minutes.length);
  const parts = [
    svg("line", { x1: left, y1: top + plotH, x2: width - right, y2: top + plotH, class: "axis" }),
    svg("text", { x: left - 4, y: top + 8, class: "tick", "text-anchor": "end" }, String(peak)),
    svg("text", { x: left - 4, y: top + plotH, class: "tick", "text-anchor": "end" }, "0"),
  ];
  minutes.forEach((minute, i) => {
    const x = left + i * step;
    let y = top + plotH;
    const bar = svg("g", { "data-minute": minute.minute, class: "bar" });
    bar.append(
      svg(
        "title",
        {},
        `${hhmm(minute.minute)}: ${minute.succeeded} succeeded, ${minute.dead} dead, ` +
          `${minute.cancelled} cancelled`,
      ),
    );
    // an invisible full-height rect so the tooltip works on empty minutes too
    bar.append(svg("rect", { x, y: top, width: step, height: plotH, class: "hit" }));
    for (const [key, state] of SERIES) {
      const h = (minute[key] / peak) * plotH;
      if (h <= 0) continue;
      y -= h;
      bar.append(
        svg("rect", { x: x + 1, y, width: Math.max(1, step - 2), height: h, class: `s-${state}` }),
      );
    }
    parts.push(bar);
    if (i % 15 === 0 || i === minutes.length - 1) {
      parts.push(
        svg("text", { x: x + step / 2, y: height - 6, class: "tick", "text-anchor": "middle" },
          hhmm(minute.minute)),
      );
    }
  });
  chart.replaceChildren(...parts);
  const sum = totals.reduce((a, b) => a + b, 0);
  $("#throughput-total").textContent = `— ${sum} in the last hour`;
}

function table(headers, rows, empty) {
  if (!rows.length) return el("p", { class: "empty" }, empty);
  return el(
    "table",
    { class: "list compact" },
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows),
  );
}

function drawPoison(candidates, threshold) {
  $("#poison-threshold").textContent = `(unfinished, ${threshold} attempts or more)`;
  const rows = candidates.map((c) =>
    el(
      "tr",
      { "data-task-id": c.id },
      el("td", {}, el("a", { href: `/ui/runs/${encodeURIComponent(c.run_id)}` }, c.name)),
      el("td", {}, c.workflow),
      el("td", {}, c.handler),
      el("td", {}, c.state),
      el("td", { class: "num" }, String(c.attempt)),
      el("td", {}, c.failure_reason || "—"),
    ),
  );
  $("[data-testid=poison-candidates]").replaceChildren(
    table(["Task", "Workflow", "Handler", "State", "Attempts", "Last reason"], rows, "None."),
  );
}

function drawDead(byReason) {
  const rows = Object.entries(byReason).map(([reason, n]) =>
    el(
      "tr",
      { "data-reason": reason },
      el("td", {}, el("a", { href: `/ui/dead?reason=${encodeURIComponent(reason)}` }, reason)),
      el("td", { class: "num" }, String(n)),
    ),
  );
  $("[data-testid=dead-by-reason]").replaceChildren(
    table(["Reason", "Dead tasks"], rows, "No dead task."),
  );
}

function drawProcesses(processes) {
  const rows = processes.map((p) =>
    el(
      "tr",
      { "data-host": p.host, "data-role": p.role },
      el("td", {}, p.host),
      el("td", {}, p.role),
      el("td", { class: "num" }, String(p.n)),
    ),
  );
  $("[data-testid=processes-summary]").replaceChildren(
    table(["Host", "Role", "Live"], rows, "No live process."),
  );
}

// READY tasks and live consumers per queue; a named queue with READY tasks and no live consumer
// is flagged (the warning /health/ready reports as unserved_queues)
function drawQueues(queues, unserved) {
  const rows = queues.map((q) =>
    el(
      "tr",
      { "data-queue": q.queue ?? "", class: unserved.includes(q.queue) ? "warn" : null },
      el("td", {}, q.queue ?? "(none)"),
      el("td", { class: "num" }, q.estimated ? `more than ${(q.ready - 1).toLocaleString("en")}` : String(q.ready)),
      el("td", { class: "num" }, String(q.consumers)),
      el("td", {}, unserved.includes(q.queue) ? "no live consumer" : ""),
    ),
  );
  $("[data-testid=queues-summary]").replaceChildren(
    table(["Queue", "Ready", "Consumers", ""], rows, "No READY task, no live worker."),
  );
}

async function refresh() {
  const data = await getJSON("/api/v1/overview");
  const estimated = data.estimated || { runs: [], tasks: [] };
  setCounts("run", data.runs, estimated.runs);
  setCounts("task", data.tasks, estimated.tasks);
  drawThroughput(data.finished_per_minute);
  const backlog = data.retry_backlog;
  $("[data-testid=retry-backlog]").textContent = String(backlog.n);
  $("#retry-next").textContent = backlog.n
    ? `next retry ${when(backlog.next_at)}, last ${when(backlog.latest_at)}`
    : "";
  const outbox = data.outbox;
  $("[data-testid=outbox-lag]").textContent =
    `${outbox.pending} pending, oldest ${Number(outbox.oldest_s).toFixed(1)} s`;
  drawPoison(data.poison_candidates, data.poison_threshold);
  drawDead(data.dead_by_reason);
  drawProcesses(data.processes);
  drawQueues(data.queues, data.unserved_queues);
}

initChrome();
poller(REFRESH_MS, refresh).start();
