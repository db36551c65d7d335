// Run detail: the DAG from GET /api/v1/runs/{id}/graph (laid out on the server by grandalf)
// drawn as SVG, task states refreshed every 2 s; a click on a task shows its attempts, input
// and result (GET /api/v1/task-runs/{id}), a timer when it wakes; the run's schedule and fire
// time (a link to the schedule), start time, deadline and failure reason; the cancel button
// posts to /cancel (a SCHEDULED run too); the rerun button (a finished run that did not
// succeed) posts to /rerun with the reason the operator gives. A map task's panel lists its
// items a page at a time (GET /api/v1/task-runs/{id}/items: counts by state, then a page in
// item order; a state filter, previous/next by cursor), so a map of 10,000 items is never
// loaded whole. The task panel's buttons act on that one task, each with the reason the
// operator gives (audited; listed under "Operator actions"): retry now (a RETRYING task), cancel
// and bury (an unfinished one; a running one is asked to stop). The panel shows the task's
// progress (ctx.progress) and the output of the attempt picked, else the latest (ctx.log,
// stdout, stderr: GET /api/v1/task-runs/{id}/logs), refreshed with it; handler text is set as
// text, never as HTML. Under the DAG, the run's timeline (timeline.js), refreshed with it; a
// click on a task's row there selects the task.

import {
  $,
  describe,
  el,
  flash,
  getJSON,
  initChrome,
  madeBy,
  poller,
  postJSON,
  pretty,
  query,
  renderRows,
  span,
  stateBadge,
  svg,
  timeCell,
  timeOf,
  when,
  wirePager,
} from "./app.js";
import { timeline } from "./timeline.js";

const REFRESH_MS = 2000;
const STATES = ["PENDING", "READY", "RUNNING", "RETRYING", "FAILED", "SUCCEEDED", "DEAD", "CANCELLED"];

const runId = decodeURIComponent(location.pathname.replace(/\/+$/, "").split("/").pop());
const view = {
  shape: null,
  nodes: new Map(),
  selected: null,
  attempt: null,
  state: null,
  task: null, // the task shown in the panel (its actions act on it)
};
// the map whose items are shown, the state they are filtered by, and the pages: a stack of
// cursors whose top is the page shown (null: the first), next the cursor of the next one
const ITEMS_PAGE = 50;
const ITEM_CHARS = 60;
const items = { taskId: null, state: "", cursors: [null], next: null };

function setState(element, state) {
  element.textContent = state;
  element.className = `state s-${state}`;
}

/** A map's items by state, most first: "250 items: 200 SUCCEEDED, 50 RUNNING". */
function itemSummary(counts) {
  const entries = Object.entries(counts).sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
  const total = entries.reduce((sum, [, n]) => sum + n, 0);
  const parts = entries.map(([state, n]) => `${n} ${state}`).join(", ");
  return `${total} ${total === 1 ? "item" : "items"}${parts ? `: ${parts}` : ""}`;
}

/** A node's tooltip: name, handler (or timer and wake time, awaited event, or a map's items) and state. */
function nodeTitle(node) {
  if (node.event_name) {
    const until = node.wake_at ? `, until ${when(node.wake_at)}` : "";
    return `${node.name} (waits for event ${node.event_name} key ${node.event_key}): ${node.state}${until}`;
  }
  if (node.child_workflow) {
    const child = node.child_run_id ? `, child run ${node.child_run_id}` : "";
    return `${node.name} (child workflow ${node.child_workflow}): ${node.state}${child}`;
  }
  if (node.item_counts) {
    return `${node.name} (${node.handler}, for each of ${node.for_each}: ${itemSummary(node.item_counts)}): ${node.state}`;
  }
  if (node.sleep_s === null || node.sleep_s === undefined) {
    return `${node.name} (${node.handler}): ${node.state}`;
  }
  const wakes = node.wake_at ? `, wakes ${when(node.wake_at)}` : "";
  return `${node.name} (timer, sleeps ${span(node.sleep_s)}): ${node.state}${wakes}`;
}

function drawDag(graph) {
  const dag = $("[data-testid=dag]");
  const width = Math.max(graph.width, 1);
  const height = Math.max(graph.height, 1);
  dag.setAttribute("viewBox", `0 0 ${width} ${height}`);
  dag.setAttribute("width", String(width));
  dag.setAttribute("height", String(height));
  const arrow = svg(
    "marker",
    { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 8, markerHeight: 8, orient: "auto" },
    svg("path", { d: "M0,0 L10,5 L0,10 z", class: "arrowhead" }),
  );
  const edges = graph.edges.map((edge) =>
    svg("path", { d: edge.path, "data-edge": `${edge.from}->${edge.to}`, class: "edge", "marker-end": "url(#arrow)" }),
  );
  view.nodes = new Map();
  const nodes = graph.nodes.map((node) => {
    const title = svg("title", {}, nodeTitle(node));
    const group = svg(
      "g",
      {
        class: "node",
        "data-task": node.name,
        "data-state": node.state,
        "data-task-id": node.task_id,
        transform: `translate(${node.x},${node.y})`,
        tabindex: 0,
        role: "button",
        "aria-label": `task ${node.name}`,
      },
      title,
      svg("rect", { width: node.width, height: node.height, rx: 6, ry: 6 }),
      svg("text", { x: node.width / 2, y: node.height / 2, "text-anchor": "middle", "dominant-baseline": "central" }, node.label),
    );
    group.addEventListener("click", () => select(node.name));
    group.addEventListener("keydown", (event) => {
      if (event.key === "Enter" || event.key === " ") {
        event.preventDefault();
        select(node.name);
      }
    });
    view.nodes.set(node.name, { group, title, node });
    return group;
  });
  dag.replaceChildren(svg("defs", {}, arrow), ...edges, ...nodes);
}

function updateNodes(graph) {
  for (const node of graph.nodes) {
    const drawn = view.nodes.get(node.name);
    if (!drawn) continue;
    drawn.node = node;
    if (drawn.group.getAttribute("data-state") !== node.state) {
      drawn.group.setAttribute("data-state", node.state);
    }
    drawn.title.textContent = nodeTitle(node);
    drawn.group.classList.toggle("selected", node.name === view.selected);
  }
}

function drawRun(run) {
  document.title = `Run ${run.id} · FlowForge`;
  $("#run-id").textContent = run.id;
  $("#run-workflow").textContent = run.workflow;
  setState($("[data-testid=run-state]"), run.state);
  $("#run-created").textContent = when(run.created_at);
  $("#run-started").textContent = when(run.started_at);
  $("#run-finished").textContent = when(run.finished_at);
  fact("#run-reason-fact", run.failure_reason, () => {
    $("[data-testid=run-reason]").textContent = run.failure_reason;
  });
  fact("#run-schedule-fact", run.schedule, () => $("#run-made-by").replaceChildren(...madeBy(run)));
  fact("#run-start-fact", run.start_at, () =>
    $("#run-start-at").replaceChildren(timeOf(run.start_at, { "data-testid": "run-start-at" })),
  );
  fact("#run-deadline-fact", run.deadline_at, () =>
    $("#run-deadline").replaceChildren(timeOf(run.deadline_at, { "data-testid": "run-deadline" })),
  );
  // sub-workflows: the run whose task started this one, and the runs this one's tasks started
  fact("#run-parent-fact", run.parent_run_id, () =>
    $("#run-parent").replaceChildren(
      el("a", { "data-testid": "run-parent", href: runHref(run.parent_run_id) }, run.parent_run_id),
    ),
  );
  const children = run.children || [];
  fact("#run-children-fact", children.length, () =>
    $("#run-children").replaceChildren(
      ...children.map((c) =>
        el(
          "a",
          { "data-testid": "run-child", "data-task": c.task || "", href: runHref(c.run_id), class: "child" },
          `${c.task || "?"} (attempt ${c.attempt}, ${c.workflow}): ${c.state}`,
        ),
      ),
    ),
  );
  view.state = run.state;
  // a finished run has nothing left to cancel (a SCHEDULED one has: nothing of it has run)
  $("[data-testid=cancel-run]").hidden = Boolean(run.finished_at);
  // a finished run that did not succeed has DEAD or CANCELLED tasks to run again
  $("[data-testid=rerun-run]").hidden = !run.finished_at || run.state === "SUCCEEDED";
}

/** The dashboard page of run ``id``. */
function runHref(id) {
  return `/ui/runs/${encodeURIComponent(id)}`;
}

/** Show the fact ``selector`` (and draw it) when ``value`` is set; hide it otherwise. */
function fact(selector, value, draw) {
  $(selector).hidden = !value;
  if (value) draw();
}

/** A task's flow-control keys as [kind, text] pairs, in the order the gates apply: its
 * concurrency key with its limit, its rate key with its window, its circuit breaker's key (a
 * breaker without a key is its handler's: no entry). Shown as text, never markup. */
function taskKeys(task) {
  const keys = [];
  if (task.concurrency_key) {
    keys.push(["concurrency", `concurrency ${task.concurrency_key} (limit ${task.concurrency_limit})`]);
  }
  if (task.rate_key) {
    keys.push(["rate_limit", `rate_limit ${task.rate_key} (${task.rate_limit} per ${task.rate_per_s}s)`]);
  }
  if (task.breaker_key) keys.push(["circuit_breaker", `circuit_breaker ${task.breaker_key}`]);
  return keys;
}

function shapeOf(graph) {
  return JSON.stringify([graph.nodes.map((n) => [n.name, n.x, n.y]), graph.edges.map((e) => e.path)]);
}

/** The attempt whose error is shown: the one picked, else the latest with an error. */
function shownAttempt(attempts) {
  const picked = attempts.find((a) => a.attempt === view.attempt);
  if (picked) return picked;
  return [...attempts].reverse().find((a) => a.error || a.traceback) || null;
}

function drawTask(detail) {
  const task = detail.task;
  const panel = $("[data-testid=task-panel]");
  panel.hidden = false;
  panel.dataset.task = task.name;
  $("#task-name").textContent = task.name;
  setState($("[data-testid=task-state]"), task.state);
  const timer = task.sleep_s !== null && task.sleep_s !== undefined;
  $("#task-handler").textContent = task.event_name
    ? `(waits for event ${task.event_name}, key ${task.event_key})`
    : task.child_workflow
      ? `(starts a child run of ${task.child_workflow})`
      : timer
      ? `(durable timer: sleeps ${span(task.sleep_s)})`
      : task.handler;
  // wake_at is set once the timer sleeps (its dependencies met): when it succeeds
  fact("#task-wake-fact", timer, () =>
    $("#task-wake").replaceChildren(
      task.wake_at
        ? timeOf(task.wake_at, { "data-testid": "task-wake" })
        : el("span", { "data-testid": "task-wake" }, "not asleep yet: waits for its dependencies"),
    ),
  );
  fact("#task-child-fact", task.child_run_id, () =>
    $("#task-child").replaceChildren(
      el("a", { "data-testid": "task-child", href: runHref(task.child_run_id) }, task.child_run_id),
    ),
  );
  $("#task-attempts").textContent = `${task.attempt} of ${task.max_attempts}`;
  $("#task-reason").textContent = task.failure_reason || "—";
  // the broker queue its messages go to (none: a task before queues routed, or no worker's)
  fact("#task-queue-fact", task.queue, () => {
    $("#task-queue").textContent = task.queue;
  });
  // its flow-control keys, rendered (concurrency, rate limit, circuit breaker); none: hidden
  const keyed = taskKeys(task);
  fact("#task-keys-fact", keyed.length, () => {
    $("#task-keys").replaceChildren(
      ...keyed.map(([kind, text]) =>
        el("span", { "data-testid": "task-key", "data-kind": kind, class: "task-key" }, text),
      ),
    );
  });
  // why it waits (SPEC 7.4): start_at, timer, event, concurrency, rate_limit or circuit_open
  // (with its key); none: hidden
  fact("#task-waiting-fact", task.waiting_on, () => {
    const keys = {
      concurrency: task.concurrency_key,
      rate_limit: task.rate_key,
      circuit_open: task.breaker_key,
    };
    const key = keys[task.waiting_on] ? ` (${keys[task.waiting_on]})` : "";
    $("#task-waiting-on").textContent = `${task.waiting_on}${key}`;
  });
  // the current attempt's last ctx.progress (none reported: hidden)
  fact("#task-progress-fact", task.progress, () => {
    $("#task-progress-bar").value = task.progress.fraction;
    const percent = `${Math.round(task.progress.fraction * 100)}%`;
    $("#task-progress").textContent = [percent, task.progress.message].filter(Boolean).join(" ");
  });
  const shown = shownAttempt(detail.attempts);
  $("#attempt-rows").replaceChildren(
    ...detail.attempts.map((a) => {
      const row = el(
        "tr",
        { "data-testid": "attempt", "data-attempt": a.attempt, class: shown === a ? "shown" : null },
        el("td", { class: "num" }, String(a.attempt)),
        el("td", {}, a.worker || "—"),
        timeCell(a.started_at),
        timeCell(a.finished_at),
        el("td", {}, a.outcome),
        el("td", {}, a.failure_reason || "—"),
      );
      row.addEventListener("click", () => {
        view.attempt = a.attempt;
        drawTask(detail);
        loadOutput(task).catch((error) => flash(describe(error)));
      });
      return row;
    }),
  );
  $("#error-of").textContent = shown ? `(attempt ${shown.attempt})` : "";
  $("[data-testid=error]").textContent = (shown && shown.error) || task.last_error || "(none)";
  $("[data-testid=traceback]").textContent = (shown && shown.traceback) || "(none)";
  const given = Object.keys(detail.upstream || {}).length
    ? { input: detail.input, upstream: detail.upstream }
    : detail.input;
  $("[data-testid=task-input]").textContent = pretty(given);
  $("[data-testid=task-result]").textContent = pretty(detail.result);
  $("#task-audit").replaceChildren(
    ...(detail.audit.length
      ? detail.audit.map((entry) =>
          el(
            "li",
            { "data-testid": "audit-entry" },
            `${entry.action} ${when(entry.requested_at)} by ${entry.requested_by}: ` +
              `${entry.reason || "(no reason)"} — ${auditChange(entry)} at attempt ${entry.attempt}`,
          ),
        )
      : [el("li", { class: "empty" }, "no operator action yet")]),
  );
  drawActions(task);
}

/** What an audited action changed: a requeue the reason it had died with, the others their
 * states (a running task asked to stop stays RUNNING until it stops). */
function auditChange(entry) {
  if (entry.action === "requeue") return `was ${entry.previous_reason || "?"}`;
  if (entry.previous_state === entry.new_state) return `${entry.new_state}, asked to stop`;
  return `${entry.previous_state} → ${entry.new_state}`;
}

const UNFINISHED = ["PENDING", "READY", "RETRYING", "FAILED", "RUNNING"];

/** The task actions its state allows (the server decides; a refusal is flashed). */
function drawActions(task) {
  view.task = task;
  const running = task.state === "RUNNING";
  const stoppable =
    UNFINISHED.includes(task.state) && !(running && (task.cancel_requested || task.for_each));
  $("[data-testid=task-retry-now]").hidden = task.state !== "RETRYING";
  $("[data-testid=task-cancel]").hidden = !stoppable;
  $("[data-testid=task-bury]").hidden = !stoppable;
}

async function loadTask() {
  const drawn = view.nodes.get(view.selected);
  if (!drawn) return;
  const detail = await getJSON(`/api/v1/task-runs/${encodeURIComponent(drawn.node.task_id)}`);
  drawTask(detail);
  await loadOutput(detail.task);
  await loadItems(detail.task);
}

/** The output of the attempt picked (else the latest), with how much its tail dropped. */
async function loadOutput(task) {
  const params = view.attempt ? `?${query({ attempt: view.attempt })}` : "";
  const log = await getJSON(`/api/v1/task-runs/${encodeURIComponent(task.id)}/logs${params}`);
  $("#output-of").textContent = log.attempt
    ? `(attempt ${log.attempt}${log.running ? ", running" : ""})`
    : "(no attempt yet)";
  const dropped = log.dropped_bytes ? `[… ${log.dropped_bytes} bytes dropped …]\n` : "";
  $("[data-testid=task-output]").textContent = dropped + log.output || "(nothing written)";
}

/** A map task's items: the page shown (first on another map), refreshed with the panel. */
async function loadItems(task) {
  const section = $("[data-testid=map-items]");
  section.hidden = !task.for_each;
  if (!task.for_each) return;
  if (items.taskId !== task.id) {
    Object.assign(items, { taskId: task.id, state: "", cursors: [null], next: null });
    $("[data-testid=item-state-filter]").value = "";
  }
  const params = { limit: ITEMS_PAGE, state: items.state, cursor: items.cursors[items.cursors.length - 1] };
  drawItems(await getJSON(`/api/v1/task-runs/${encodeURIComponent(task.id)}/items?${query(params)}`));
}

/** A JSON value on one line, cut to ``limit`` characters ("…" marks the cut). */
function clip(value, limit) {
  const text = JSON.stringify(value) ?? "null";
  return text.length <= limit ? text : `${text.slice(0, limit - 1)}…`;
}

function itemRow(item) {
  return el(
    "tr",
    { "data-testid": "item", "data-index": item.index, "data-state": item.state, "data-item-id": item.id },
    el("td", { class: "num" }, String(item.index)),
    el("td", { class: "item", title: clip(item.item, 2000) }, clip(item.item, ITEM_CHARS)),
    el("td", {}, stateBadge(item.state, { "data-testid": "item-state" })),
    el("td", { class: "num" }, String(item.attempt)),
    el(
      "td",
      { class: item.failure_reason ? "reason" : null, "data-testid": "item-reason", title: item.last_error || null },
      item.failure_reason || "—",
    ),
  );
}

function drawItems(page) {
  $("[data-testid=items-summary]").textContent = `(${itemSummary(page.counts)})`;
  $("#item-counts").replaceChildren(
    ...STATES.filter((state) => page.counts[state]).map((state) =>
      el("span", {}, stateBadge(state), " ", el("span", { "data-testid": `item-count-${state}` }, String(page.counts[state]))),
    ),
  );
  const tbody = $("#item-rows");
  if (page.items.length) {
    renderRows(tbody, page.items, (i) => [i.index, i.state, i.attempt, i.failure_reason].join("|"), itemRow);
  } else {
    const what = items.state ? `no ${items.state} item` : "no item yet";
    tbody.replaceChildren(el("tr", { class: "empty" }, el("td", { colspan: 5 }, what)));
  }
  items.next = page.next_cursor;
  $("[data-testid=items-prev]").disabled = items.cursors.length < 2;
  $("[data-testid=items-next]").disabled = !items.next;
  $("[data-testid=items-page]").textContent = `page ${items.cursors.length}`;
}

async function refresh() {
  const graph = await getJSON(`/api/v1/runs/${encodeURIComponent(runId)}/graph`);
  drawRun(graph.run);
  const shape = shapeOf(graph);
  if (shape !== view.shape) {
    drawDag(graph);
    view.shape = shape;
  }
  updateNodes(graph);
  await gantt.refresh();
  if (view.selected) await loadTask();
}

const gantt = timeline(runId, (name) => select(name));
const poll = poller(REFRESH_MS, refresh);

function select(name) {
  if (view.selected !== name) view.attempt = null;
  view.selected = name;
  poll.now();
}

async function cancelRun() {
  const question =
    view.state === "SCHEDULED"
      ? `Cancel run ${runId}? It has not started yet: it ends CANCELLED and nothing of it runs.`
      : `Cancel run ${runId}? Tasks not started are cancelled, running ones are asked to stop.`;
  if (!window.confirm(question)) return;
  try {
    const run = await postJSON(`/api/v1/runs/${encodeURIComponent(runId)}/cancel`);
    flash(`Cancel requested: the run is ${run.state}.`, "ok");
  } catch (err) {
    flash(describe(err), "error");
  }
  poll.now();
}

async function rerunRun() {
  const reason = window.prompt(
    `Rerun run ${runId} from its failed and cancelled tasks (and what follows them)? ` +
      "Tasks that succeeded keep their results. Why (recorded in the audit)?",
  );
  if (reason === null) return;
  try {
    const done = await postJSON(`/api/v1/runs/${encodeURIComponent(runId)}/rerun`, {
      reason: reason || null,
      requested_by: "dashboard",
    });
    flash(`Rerun: ${done.task_names.length} task(s) reset; the run is ${done.run.state}.`, "ok");
  } catch (err) {
    flash(describe(err), "error");
  }
  poll.now();
}

const TASK_ACTIONS = {
  "retry-now": {
    ask: (t) => `Retry task ${t.name} now, skipping its backoff (no attempt is added)?`,
    done: (d) => `Retried now: ${d.task.name} is ${d.task.state}.`,
  },
  cancel: {
    ask: (t) =>
      `Cancel task ${t.name}? What only it feeds is cancelled too` +
      (t.state === "RUNNING" ? "; it is running: it is asked to stop." : "."),
    done: (d) =>
      d.effect === "stop"
        ? `${d.task.name} is asked to stop: CANCELLED once its worker stops.`
        : `Cancelled: ${d.task.name} is ${d.task.state}.`,
  },
  bury: {
    ask: (t) =>
      `Bury task ${t.name} (DEAD, reason operator)?` +
      (t.state === "RUNNING" ? " It is running: it is asked to stop first." : ""),
    done: (d) =>
      d.effect === "stop"
        ? `${d.task.name} is asked to stop: DEAD (operator) once its worker stops.`
        : `Buried: ${d.task.name} is ${d.task.state}.`,
  },
};

async function actOnTask(action) {
  const task = view.task;
  if (!task) return;
  const spec = TASK_ACTIONS[action];
  const reason = window.prompt(`${spec.ask(task)} Why (recorded in the audit)?`);
  if (reason === null) return;
  try {
    const done = await postJSON(`/api/v1/task-runs/${encodeURIComponent(task.id)}/${action}`, {
      reason: reason || null,
      requested_by: "dashboard",
    });
    flash(spec.done(done), "ok");
  } catch (err) {
    flash(describe(err), "error");
  }
  poll.now();
}

function legend() {
  $("#dag-legend").replaceChildren(...STATES.map((s) => stateBadge(s)));
}

initChrome();
legend();
$("[data-testid=cancel-run]").addEventListener("click", cancelRun);
$("[data-testid=rerun-run]").addEventListener("click", rerunRun);
for (const action of Object.keys(TASK_ACTIONS)) {
  $(`[data-testid=task-${action}]`).addEventListener("click", () => actOnTask(action));
}
wirePager(items, poll, $("[data-testid=items-next]"), $("[data-testid=items-prev]"));
$("[data-testid=item-state-filter]").addEventListener("change", (event) => {
  Object.assign(items, { state: event.target.value, cursors: [null], next: null });
  poll.now();
});
poll.start();
