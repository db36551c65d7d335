// Flow control: circuit breakers (GET /api/v1/breakers) and pauses (GET /api/v1/pauses), every
// 2 s; open or close a breaker, pause or resume a queue or a handler, each after a prompt for
// the reason (requested_by "dashboard"; audited).

import { $, describe, el, flash, getJSON, initChrome, poller, postJSON, renderRows, timeCell } from "./app.js";

const REFRESH_MS = 2000;
const STATE_TEXT = { closed: "closed", open: "open", half_open: "half-open (probing)" };

function button(testid, text, onClick, danger = false) {
  const node = el("button", { type: "button", "data-testid": testid, class: danger ? "danger" : null }, text);
  node.addEventListener("click", onClick);
  return node;
}

/** Ask for a reason; null when the operator cancels. */
function reasonFor(question) {
  const reason = window.prompt(`${question}\nReason (recorded in the audit):`, "");
  return reason === null ? null : { reason: reason || null, requested_by: "dashboard" };
}

async function act(path, question, done) {
  const note = reasonFor(question);
  if (note === null) return;
  try {
    const change = await postJSON(path, note);
    const key = change.key ? ` key ${change.key}` : "";
    flash(`${done} ${change.name}${key}: ${change.previous_state} → ${change.new_state}.`, "ok");
  } catch (err) {
    flash(describe(err), "error");
  }
  poll.now();
}

// key "" (or absent): the handler's own breaker; a keyed one is named by ?key=
function breakerPath(handler, action, key = "") {
  const query = key ? `?key=${encodeURIComponent(key)}` : "";
  return `/api/v1/breakers/${encodeURIComponent(handler)}/${action}${query}`;
}

function breakerName(b) {
  return b.key ? `${b.handler} key ${b.key}` : b.handler;
}

function pausePath(scope, name, action) {
  return `/api/v1/${scope}s/${encodeURIComponent(name)}/${action}`;
}

function rule(b) {
  return b.failures === null ? "—" : `${b.failures} in ${b.window_s} s, cooldown ${b.cooldown_s} s`;
}

function breakerRow(b) {
  const actions = [];
  if (b.state !== "closed") {
    actions.push(
      button("close-breaker", "Close", () =>
        act(breakerPath(b.handler, "close", b.key), `Close the breaker of ${breakerName(b)}? Its parked tasks run again.`, "Breaker of"),
      ),
    );
  }
  if (!(b.state === "open" && b.held)) {
    actions.push(
      button(
        "hold-breaker",
        "Hold open",
        () => act(breakerPath(b.handler, "open", b.key), `Open the breaker of ${breakerName(b)} and hold it open (no probe)?`, "Breaker of"),
        true,
      ),
    );
  }
  return el(
    "tr",
    { "data-handler": b.handler, "data-breaker-key": b.key },
    el("td", {}, b.handler),
    el("td", { "data-testid": "breaker-key" }, b.key || "—"),
    el("td", { "data-testid": "breaker-state", "data-state": b.state }, STATE_TEXT[b.state] + (b.held ? " (held)" : "")),
    el("td", { class: "num" }, String(b.recent_failures)),
    el("td", {}, rule(b)),
    el("td", { class: "num" }, b.probe_due_in_s === null ? "—" : `${Math.ceil(b.probe_due_in_s)} s`),
    el("td", { class: "num", "data-testid": "breaker-parked" }, String(b.parked)),
    el("td", { class: "num" }, String(b.transitions)),
    el("td", { class: "actions" }, ...actions),
  );
}

function pauseRow(p) {
  return el(
    "tr",
    { "data-scope": p.scope, "data-name": p.name },
    el("td", {}, p.scope),
    el("td", {}, p.name),
    el("td", {}, p.paused_by),
    timeCell(p.paused_at),
    el("td", { class: "num", "data-testid": "pause-parked" }, String(p.parked)),
    el("td", {}, p.reason ?? "—"),
    el(
      "td",
      { class: "actions" },
      button("resume", "Resume", () =>
        act(pausePath(p.scope, p.name, "resume"), `Resume ${p.scope} ${p.name}? Its parked tasks run again.`, `Resumed ${p.scope}`),
      ),
    ),
  );
}

async function refresh() {
  const [breakers, pauses] = await Promise.all([getJSON("/api/v1/breakers"), getJSON("/api/v1/pauses")]);
  const bkey = (b) => `${b.handler}|${b.key}|${b.state}|${b.held}|${b.recent_failures}|${b.parked}|${b.transitions}|${Math.ceil(b.probe_due_in_s ?? -1)}`;
  renderRows($("[data-testid=breakers-table] tbody"), breakers.breakers, bkey, breakerRow);
  $("#breakers-empty").hidden = breakers.breakers.length > 0;
  const pkey = (p) => `${p.scope}|${p.name}|${p.parked}`;
  renderRows($("[data-testid=pauses-table] tbody"), pauses.pauses, pkey, pauseRow);
  $("#pauses-empty").hidden = pauses.pauses.length > 0;
}

const poll = poller(REFRESH_MS, refresh);

$("[data-testid=open-breaker-form]").addEventListener("submit", (event) => {
  event.preventDefault();
  const handler = $("[data-testid=open-breaker-handler]").value.trim();
  const key = $("[data-testid=open-breaker-key]").value;
  const name = key ? `${handler} key ${key}` : handler;
  if (handler) act(breakerPath(handler, "open", key), `Open the breaker of ${name} and hold it open (no probe)?`, "Breaker of");
});
$("[data-testid=pause-form]").addEventListener("submit", (event) => {
  event.preventDefault();
  const scope = $("[data-testid=pause-scope]").value;
  const name = $("[data-testid=pause-name]").value;
  if (name) act(pausePath(scope, name, "pause"), `Pause ${scope} ${name}? Its tasks are not claimed until it is resumed.`, `Paused ${scope}`);
});

initChrome();
poll.start();
