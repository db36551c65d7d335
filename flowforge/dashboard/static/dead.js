// Dead tasks: GET /api/v1/dead with the filters (reason, workflow, handler) and keyset pages,
// refreshed every 2 s. Requeue one (POST /api/v1/task-runs/{id}/requeue) or all matching the
// applied filters (POST /api/v1/dead/requeue: a dry run shows the count, then confirm); every
// requeue needs a reason, recorded in the audit table.

import {
  filterField,
  rememberFilters,
  restoreFilterFields,
  wirePager,
  $,
  describe,
  el,
  flash,
  getJSON,
  initChrome,
  poller,
  postJSON,
  query,
  renderRows,
  timeCell,
} from "./app.js";

const REFRESH_MS = 2000;
const PAGE_SIZE = 50;
const FILTERS = ["reason", "workflow", "handler"];
const REQUESTER = "dashboard";
const ERROR_PREVIEW = 120;

const view = { filters: {}, cursors: [null], next: null, pending: null };

const field = filterField;

function readFilters() {
  return {
    reason: field("reason").value,
    workflow: field("workflow").value.trim(),
    handler: field("handler").value.trim(),
  };
}

/** The requeue reason, or null (and a message) when it is missing. */
function requeueReason() {
  const input = $("input[name=requeue-reason]");
  const reason = input.value.trim();
  if (!reason) {
    flash("A requeue reason is required: say why in the requeue reason field.", "error");
    input.focus();
    return null;
  }
  return reason;
}

function shorten(text) {
  if (!text) return "—";
  return text.length > ERROR_PREVIEW ? `${text.slice(0, ERROR_PREVIEW - 1)}…` : text;
}

async function requeueOne(task) {
  const reason = requeueReason();
  if (reason === null) return;
  try {
    const done = await postJSON(`/api/v1/task-runs/${encodeURIComponent(task.id)}/requeue`, {
      reason,
      requested_by: REQUESTER,
    });
    flash(`Requeued ${task.name} of ${task.workflow} (${task.id}): it is ${done.state} now.`, "ok");
  } catch (err) {
    flash(describe(err), "error");
  }
  poll.now();
}

function row(task) {
  const button = el("button", { type: "button", "data-testid": "requeue-one" }, "Requeue");
  button.addEventListener("click", () => requeueOne(task));
  return el(
    "tr",
    { "data-task-id": task.id },
    el("td", {}, el("a", { href: `/ui/runs/${encodeURIComponent(task.run_id)}` }, task.name)),
    el("td", {}, task.workflow),
    el("td", {}, task.handler),
    el("td", {}, task.failure_reason || "—"),
    el("td", { class: "num" }, `${task.attempt}/${task.max_attempts}`),
    timeCell(task.finished_at),
    el("td", { class: "error", title: task.last_error || null }, shorten(task.last_error)),
    el("td", {}, button),
  );
}

async function refresh() {
  const cursor = view.cursors[view.cursors.length - 1];
  const data = await getJSON(`/api/v1/dead?${query({ ...view.filters, limit: PAGE_SIZE, cursor })}`);
  renderRows($("[data-testid=dead-table] tbody"), data.tasks, (t) => `${t.id}|${t.attempt}`, row);
  $("#dead-empty").hidden = data.tasks.length > 0;
  view.next = data.next_cursor;
  $("[data-testid=next-page]").disabled = !view.next;
  $("[data-testid=prev-page]").disabled = view.cursors.length < 2;
  $("#page-number").textContent = `page ${view.cursors.length}`;
}

const poll = poller(REFRESH_MS, refresh);

function bulkBody(reason, dryRun) {
  return {
    reason,
    requested_by: REQUESTER,
    reason_filter: view.filters.reason || null,
    workflow: view.filters.workflow || null,
    handler: view.filters.handler || null,
    dry_run: dryRun,
  };
}

function hideDryRun() {
  view.pending = null;
  $("#dry-run").hidden = true;
}

async function dryRun() {
  const reason = requeueReason();
  if (reason === null) return;
  try {
    const body = bulkBody(reason, true);
    const found = await postJSON("/api/v1/dead/requeue", body);
    view.pending = { ...body, dry_run: false };
    $("[data-testid=dry-run-count]").textContent = String(found.matched);
    $("#dry-run-text").textContent =
      found.matched > found.limit
        ? `dead tasks match; the first ${found.limit} will be requeued (repeat for the rest).`
        : "dead tasks match.";
    $("[data-testid=confirm-requeue-all]").disabled = found.matched === 0;
    $("#dry-run").hidden = false;
    flash(`Dry run: ${found.matched} dead tasks match the filters. Nothing changed yet.`);
  } catch (err) {
    hideDryRun();
    flash(describe(err), "error");
  }
}

async function confirmAll() {
  if (!view.pending) return;
  const body = view.pending;
  hideDryRun();
  try {
    const done = await postJSON("/api/v1/dead/requeue", body);
    let text = `Requeued ${done.requeued} of ${done.matched} matching dead tasks`;
    if (done.skipped) text += ` (${done.skipped} were no longer dead)`;
    if (done.more) text += `; at most ${done.limit} per request: requeue again for the rest`;
    flash(`${text}.`, "ok");
  } catch (err) {
    flash(describe(err), "error");
  }
  poll.now();
}

function apply() {
  view.filters = readFilters();
  view.cursors = [null];
  hideDryRun();
  rememberFilters(view.filters);
  flash("");
  poll.now();
}

function restoreFilters() {
  restoreFilterFields(FILTERS);
  view.filters = readFilters();
}

initChrome();
restoreFilters();
$("[data-testid=apply-filters]").addEventListener("click", apply);
for (const name of ["workflow", "handler"]) {
  field(name).addEventListener("keydown", (event) => {
    if (event.key === "Enter") apply();
  });
}
$("[data-testid=requeue-all]").addEventListener("click", dryRun);
$("[data-testid=confirm-requeue-all]").addEventListener("click", confirmAll);
$("#cancel-requeue-all").addEventListener("click", hideDryRun);
wirePager(view, poll);
poll.start();
