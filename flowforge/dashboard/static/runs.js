// Runs: GET /api/v1/runs with the filters (state, workflow, created since/until), keyset pages
// (a stack of cursors: "older" pushes, "newer" pops), the current page refreshed every 2 s.
// Each run shows the schedule and fire time that made it, its start time while SCHEDULED, its
// deadline and why the run itself failed (deadline_exceeded).
// The applied filters live in the address bar, so a reload or a shared link keeps them.

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
  madeBy,
  poller,
  query,
  renderRows,
  stateBadge,
  timeCell,
  timeOf,
} from "./app.js";

const REFRESH_MS = 2000;
const PAGE_SIZE = 25;
const FILTERS = ["state", "workflow", "since", "until"];

const view = { filters: {}, cursors: [null], next: null };

const field = filterField;

/** A time typed by the operator as ISO 8601 for the api (no offset: the browser's zone). */
function isoTime(name, text) {
  const value = text.trim();
  if (!value) return "";
  const parsed = new Date(value);
  if (Number.isNaN(parsed.getTime())) {
    throw new Error(`"${name}" is not a date and time (e.g. 2024-05-01T12:00:00Z)`);
  }
  return parsed.toISOString();
}

function readFilters() {
  return {
    state: field("state").value,
    workflow: field("workflow").value.trim(),
    since: isoTime("since", field("since").value),
    until: isoTime("until", field("until").value),
  };
}

/** Started: while SCHEDULED, when it will start instead. */
function startCell(run) {
  if (run.state === "SCHEDULED" && run.start_at) {
    return el("td", { class: "time" }, "starts ", timeOf(run.start_at, { "data-testid": "run-start-at" }));
  }
  return timeCell(run.started_at);
}

function row(run) {
  return el(
    "tr",
    { "data-run-id": run.id },
    el(
      "td",
      {},
      el("a", { "data-testid": "run-link", href: `/ui/runs/${encodeURIComponent(run.id)}` }, run.id),
    ),
    el("td", {}, run.workflow),
    el(
      "td",
      {},
      stateBadge(run.state, { "data-testid": "run-state" }),
      run.failure_reason ? [" ", el("span", { class: "reason", "data-testid": "run-reason" }, run.failure_reason)] : null,
    ),
    el("td", { class: "made-by" }, ...madeBy(run)),
    timeCell(run.created_at),
    startCell(run),
    timeCell(run.finished_at),
    el("td", { class: "time" }, timeOf(run.deadline_at, { "data-testid": "run-deadline" })),
  );
}

async function refresh() {
  const cursor = view.cursors[view.cursors.length - 1];
  const data = await getJSON(`/api/v1/runs?${query({ ...view.filters, limit: PAGE_SIZE, cursor })}`);
  const key = (run) =>
    [run.id, run.state, run.failure_reason, run.started_at, run.finished_at, run.start_at, run.deadline_at].join("|");
  renderRows($("[data-testid=runs-table] tbody"), data.runs, key, row);
  $("#runs-empty").hidden = data.runs.length > 0;
  view.next = data.next_cursor;
  $("[data-testid=next-page]").disabled = !view.next;
  $("[data-testid=prev-page]").disabled = view.cursors.length < 2;
  $("#page-number").textContent = `page ${view.cursors.length}`;
}

const poll = poller(REFRESH_MS, refresh);

function apply() {
  try {
    view.filters = readFilters();
  } catch (err) {
    flash(describe(err), "error");
    return;
  }
  view.cursors = [null];
  rememberFilters(view.filters);
  flash("");
  poll.now();
}

function restoreFilters() {
  restoreFilterFields(FILTERS);
  try {
    view.filters = readFilters();
  } catch (err) {
    flash(describe(err), "error");
    view.filters = {};
  }
}

initChrome();
restoreFilters();
$("[data-testid=apply-filters]").addEventListener("click", apply);
for (const name of ["workflow", "since", "until"]) {
  field(name).addEventListener("keydown", (event) => {
    if (event.key === "Enter") apply();
  });
}
wirePager(view, poll);
poll.start();
