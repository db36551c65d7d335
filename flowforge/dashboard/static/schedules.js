// Schedules: GET /api/v1/schedules, a page of PAGE_SIZE by name (a stack of cursors: "next"
// pushes, "previous" pops), refreshed every 2 s; Pause / Resume / Run now post to
// /api/v1/schedules/{name}/pause|resume|trigger after a confirm(); a schedule's panel (its
// policies and recent decisions, GET /api/v1/schedules/{name}) opens on a click on its name
// and is kept in the address bar (?schedule=NAME), so a run's page can link to it.

import {
  $,
  ApiError,
  describe,
  el,
  flash,
  getJSON,
  initChrome,
  poller,
  postJSON,
  pretty,
  query,
  renderRows,
  SCHEDULE_PARAM,
  scheduleHref,
  stateBadge,
  when,
  wirePager,
} from "./app.js";

const REFRESH_MS = 2000;
const HISTORY = 20;
const PAGE_SIZE = 50;

const view = {
  selected: new URLSearchParams(location.search).get(SCHEDULE_PARAM) || null,
  cursors: [null],
  next: null,
};

/** The api path of a schedule (a name may hold one "/": sent as %2F, which the api accepts). */
function path(name, action = "") {
  return `/api/v1/schedules/${encodeURIComponent(name)}${action ? `/${action}` : ""}`;
}

/** An instant as "YYYY-MM-DD HH:MM:SS" in time zone ``zone``, or null if the browser lacks it. */
function zoned(iso, zone) {
  try {
    const format = new Intl.DateTimeFormat("sv-SE", {
      timeZone: zone,
      year: "numeric",
      month: "2-digit",
      day: "2-digit",
      hour: "2-digit",
      minute: "2-digit",
      second: "2-digit",
    });
    return format.format(new Date(iso));
  } catch {
    return null;
  }
}

/** A <time> of an instant in the browser's zone; the tooltip adds the schedule's zone. */
function instant(iso, zone, testid) {
  if (!iso) return el("span", { "data-testid": testid }, "—");
  const there = zoned(iso, zone);
  const title = there ? `${iso} (${there} ${zone})` : iso;
  return el("time", { datetime: iso, title, "data-testid": testid }, when(iso));
}

function stateOf(schedule, attrs = {}) {
  return el("span", { ...attrs, class: `sched sched-${schedule.state}` }, schedule.state);
}

/** What the last fire did: its run (a link, with the run's state), and a skip's reason. */
function lastRun(schedule) {
  const parts = [];
  const run = schedule.last_run;
  if (run) {
    parts.push(
      el(
        "a",
        { "data-testid": "schedule-last-run", href: `/ui/runs/${encodeURIComponent(run.id)}`, title: run.id },
        run.id.slice(0, 8),
      ),
      " ",
      run.state ? stateBadge(run.state) : el("span", { class: "note" }, "purged"),
    );
  }
  const decision = schedule.last_decision;
  if (decision && decision.outcome === "skipped") {
    if (parts.length) parts.push(" ");
    parts.push(el("span", { class: "note", "data-testid": "schedule-last-skip" }, `skipped (${decision.reason})`));
  }
  return parts.length ? parts : ["—"];
}

function button(testid, text, onClick, danger = false) {
  const node = el("button", { type: "button", "data-testid": testid, class: danger ? "danger" : null }, text);
  node.addEventListener("click", onClick);
  return node;
}

/** The actions a schedule's state allows: a retired one (gone from the files) has none. */
function actions(schedule) {
  if (schedule.state === "retired") return [el("span", { class: "note" }, "retired")];
  const toggle =
    schedule.state === "paused"
      ? button("resume-schedule", "Resume", () => act(schedule, "resume"))
      : button("pause-schedule", "Pause", () => act(schedule, "pause"));
  return [toggle, " ", button("trigger-schedule", "Run now", () => act(schedule, "trigger"))];
}

function row(schedule) {
  const name = el("a", { href: scheduleHref(schedule.name), "data-testid": "schedule-link" }, schedule.name);
  name.addEventListener("click", (event) => {
    event.preventDefault();
    select(schedule.name);
  });
  return el(
    "tr",
    { "data-schedule": schedule.name, class: view.selected === schedule.name ? "selected" : null },
    el("td", {}, name),
    el("td", {}, schedule.workflow),
    el("td", { "data-testid": "schedule-timetable" }, schedule.timetable),
    el("td", {}, schedule.timezone),
    el("td", {}, stateOf(schedule, { "data-testid": "schedule-state" })),
    el("td", { class: "time" }, instant(schedule.next_fire_at, schedule.timezone, "schedule-next")),
    el("td", { class: "time" }, instant(schedule.last_fire_at, schedule.timezone, "schedule-last")),
    el("td", {}, ...lastRun(schedule)),
    el("td", { class: "actions" }, ...actions(schedule)),
  );
}

function keyOf(s) {
  const run = s.last_run ? `${s.last_run.id}:${s.last_run.state}` : "";
  const decision = s.last_decision ? `${s.last_decision.outcome}:${s.last_decision.reason}` : "";
  return [s.name, s.state, s.timetable, s.timezone, s.next_fire_at, s.last_fire_at, run, decision,
    s.name === view.selected].join("|");
}

function decisionRow(decision, zone) {
  const through = decision.last_fire_time && decision.last_fire_time !== decision.fire_time;
  const outcome = decision.manual ? `${decision.outcome} (run now)` : decision.outcome;
  return el(
    "tr",
    { "data-testid": "decision", "data-outcome": decision.outcome },
    el("td", { class: "time" }, instant(decision.fire_time, zone, "decision-fire-time")),
    el("td", { class: "time" }, through ? instant(decision.last_fire_time, zone, "decision-through") : "—"),
    el("td", {}, outcome),
    el("td", { "data-testid": "decision-reason" }, decision.reason || "—"),
    el(
      "td",
      {},
      decision.run_id
        ? el("a", { href: `/ui/runs/${encodeURIComponent(decision.run_id)}`, title: decision.run_id }, decision.run_id.slice(0, 8))
        : "—",
    ),
    el("td", { class: "time" }, when(decision.decided_at)),
  );
}

function text(selector, value) {
  $(selector).textContent = value;
}

function drawPanel(detail) {
  const panel = $("[data-testid=schedule-panel]");
  panel.hidden = false;
  panel.dataset.schedule = detail.name;
  const spec = detail.spec || {};
  const zone = detail.timezone;
  text("#schedule-name", detail.name);
  $("[data-testid=panel-state]").replaceChildren(stateOf(detail));
  text("#panel-workflow", detail.workflow);
  text("#panel-timetable", detail.timetable);
  text("#panel-timezone", zone);
  text("#panel-catch-up", `${spec.catch_up} (at most ${spec.max_catch_up})`);
  text("#panel-overlap", spec.overlap);
  $("#panel-next").replaceChildren(instant(detail.next_fire_at, zone, "panel-next"));
  $("#panel-last").replaceChildren(instant(detail.last_fire_at, zone, "panel-last"));
  $("#panel-paused-fact").hidden = !detail.paused_at;
  text("#panel-paused", when(detail.paused_at));
  $("#panel-retired-fact").hidden = !detail.retired_at;
  text("#panel-retired", when(detail.retired_at));
  text("[data-testid=schedule-input]", pretty(spec.input || {}));
  const body = $("[data-testid=schedule-history] tbody");
  body.replaceChildren(...detail.history.map((d) => decisionRow(d, zone)));
  $("#history-empty").hidden = detail.history.length > 0;
}

async function refresh() {
  const cursor = view.cursors[view.cursors.length - 1];
  const data = await getJSON(`/api/v1/schedules?${query({ limit: PAGE_SIZE, cursor })}`);
  renderRows($("[data-testid=schedules-table] tbody"), data.schedules, keyOf, row);
  $("#schedules-empty").hidden = data.schedules.length > 0;
  view.next = data.next_cursor;
  $("[data-testid=next-page]").disabled = !view.next;
  $("[data-testid=prev-page]").disabled = view.cursors.length < 2;
  $("#page-number").textContent = `page ${view.cursors.length}`;
  if (view.selected) await loadPanel(view.selected);
}

/** The open panel's schedule and decisions; a name the api does not know closes the panel
 * (said once on the status line) instead of failing every refresh. */
async function loadPanel(name) {
  let detail;
  try {
    detail = await getJSON(`${path(name)}?limit=${HISTORY}`);
  } catch (err) {
    if (!(err instanceof ApiError && err.status === 404) || view.selected !== name) throw err;
    select(null);
    flash(describe(err), "error");
    return;
  }
  if (view.selected === name) drawPanel(detail);
}

const poll = poller(REFRESH_MS, refresh);

function select(name) {
  view.selected = name;
  history.replaceState(null, "", name ? scheduleHref(name) : location.pathname);
  if (!name) $("[data-testid=schedule-panel]").hidden = true;
  poll.now();
}

const CONFIRM = {
  pause: (name) => `Pause schedule ${name}? Fire times that pass while it is paused are recorded as skipped.`,
  resume: (name) => `Resume schedule ${name}? It fires again from its next fire time.`,
  trigger: (name) => `Run schedule ${name} now, outside its timetable? One run is started with its input.`,
};

async function act(schedule, action) {
  if (!window.confirm(CONFIRM[action](schedule.name))) return;
  try {
    const done = await postJSON(path(schedule.name, action));
    if (action === "trigger") {
      flash(`Started run ${done.run_id} of ${schedule.name} (fire time ${when(done.fire_time)}).`, "ok");
    } else {
      flash(`Schedule ${done.name} is ${done.state}; next fire ${when(done.next_fire_at)}.`, "ok");
    }
  } catch (err) {
    flash(describe(err), "error");
  }
  poll.now();
}

initChrome();
$("#close-panel").addEventListener("click", () => select(null));
wirePager(view, poll);
poll.start();
