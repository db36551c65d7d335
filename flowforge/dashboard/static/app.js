// Shared by every dashboard page: building DOM nodes (text only: data never becomes HTML),
// the JSON api (the bearer token from sessionStorage on every request), the token field, the
// status line and polling. A read refused for want of a token (api.read_access: token) pauses
// the page's polling and asks for the token; saving one resumes it.

const TOKEN_KEY = "flowforge.api-token";
// dispatched on window when a token is saved or cleared
const TOKEN_EVENT = "flowforge:token";
const SVG_NS = "http://www.w3.org/2000/svg";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function build(node, attrs, children) {
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    // append() turns a string into a text node: never parsed as markup
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

/** An HTML element: attributes by name, children as nodes or plain text. */
export function el(tag, attrs, ...children) {
  return build(document.createElement(tag), attrs, children);
}

/** An SVG element, like el(). */
export function svg(tag, attrs, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

export function $(selector, root = document) {
  return root.querySelector(selector);
}

/** Show a message on the status line; kind is "info", "ok" or "error". */
export function flash(message, kind = "info") {
  const line = $("[data-testid=flash]");
  line.textContent = message;
  line.dataset.kind = kind;
}

export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

async function call(method, path, body) {
  const headers = { Accept: "application/json" };
  const init = { method, headers, credentials: "same-origin", cache: "no-store" };
  const saved = token();
  if (saved) headers.Authorization = `Bearer ${saved}`;
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    throw new ApiError(0, `the api did not answer (${err.message})`);
  }
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!response.ok) {
    const message = data && typeof data.error === "string" ? data.error : response.statusText;
    throw new ApiError(response.status, message || "request failed");
  }
  return data;
}

/** GET with the saved token (reads need it unless the api runs with read_access: open). */
export function getJSON(path) {
  return call("GET", path);
}

/** POST with the saved token; without one the api answers 401 and the error says so. */
export function postJSON(path, body) {
  return call("POST", path, body);
}

/** Whether a read failed for want of a (valid) token: 401, or 403 on a GET. */
function needsToken(err) {
  return err instanceof ApiError && (err.status === 401 || err.status === 403);
}

/** Ask for the token: the status line says why, the token field is marked and focused. */
function askForToken(err) {
  const input = $("input[data-testid=token]");
  input.setAttribute("aria-invalid", "true");
  const why = token() ? "the saved token was refused" : "no token is saved";
  flash(
    `This page needs the API token (${why}: ${describe(err)}). ` +
      "Enter it in the API token field and press Save token.",
    "error",
  );
  input.focus();
}

/** An error as one line for the status line. */
export function describe(err) {
  if (err instanceof ApiError) {
    return err.status ? `Error ${err.status}: ${err.message}` : `Error: ${err.message}`;
  }
  return `Error: ${err && err.message ? err.message : err}`;
}

/** A query string of the non-empty values of params (without the "?"). */
export function query(params) {
  const search = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    if (value !== null && value !== undefined && value !== "") search.set(name, value);
  }
  return search.toString();
}

/** The form field of a list page's filter bar named ``name``. */
export function filterField(name) {
  return $(`.filters [name=${name}]`);
}

/** Fills the filter fields named in ``names`` from the page's query string. */
export function restoreFilterFields(names) {
  const params = new URLSearchParams(location.search);
  for (const name of names) {
    const value = params.get(name);
    if (value) filterField(name).value = value;
  }
}

/** Puts ``filters`` in the address bar, so a reload or a shared link shows the same list. */
export function rememberFilters(filters) {
  const search = query(filters);
  history.replaceState(null, "", search ? `?${search}` : location.pathname);
}

/**
 * Wires the "older" / "newer" buttons of a keyset-paged list: ``view.cursors`` is a stack of
 * cursors whose top is the page shown, ``view.next`` the cursor of the next page (or null).
 * The buttons are the page's pager unless others are given (a panel's own pager).
 */
export function wirePager(view, poll, next = $("[data-testid=next-page]"), prev = $("[data-testid=prev-page]")) {
  next.addEventListener("click", () => {
    if (!view.next) return;
    view.cursors.push(view.next);
    poll.now();
  });
  prev.addEventListener("click", () => {
    if (view.cursors.length < 2) return;
    view.cursors.pop();
    poll.now();
  });
}

/** A number of seconds as "1h 30m 5s" ("250ms" below a second). */
export function span(seconds) {
  if (seconds > 0 && seconds < 1) return `${Math.round(seconds * 1000)}ms`;
  const parts = [];
  let left = Math.round(seconds);
  for (const [unit, size] of [["d", 86400], ["h", 3600], ["m", 60], ["s", 1]]) {
    if (left >= size) {
      parts.push(`${Math.floor(left / size)}${unit}`);
      left %= size;
    }
  }
  return parts.join(" ") || "0s";
}

function pad(n) {
  return String(n).padStart(2, "0");
}

/** An ISO time as local "YYYY-MM-DD HH:MM:SS" ("—" for none). */
export function when(iso) {
  if (!iso) return "—";
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return String(iso);
  return (
    `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
    `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`
  );
}

/** The query parameter of the schedules page that opens one schedule's panel. */
export const SCHEDULE_PARAM = "schedule";

/** The page that shows schedule ``name`` with its panel open (runs link to it). */
export function scheduleHref(name) {
  return `/ui/schedules?${new URLSearchParams({ [SCHEDULE_PARAM]: name })}`;
}

/** A table cell showing a time, the exact ISO value as its tooltip. */
export function timeCell(iso) {
  return el("td", { title: iso || null, class: "time" }, when(iso));
}

/** A <time> element (``datetime`` = the exact ISO value, text local), or "—" for none. */
export function timeOf(iso, attrs = {}) {
  if (!iso) return el("span", attrs, "—");
  return el("time", { ...attrs, datetime: iso, title: iso }, when(iso));
}

/** What made a run, for a run list or page: a link to its schedule and its fire time. */
export function madeBy(run) {
  if (!run.schedule) return ["—"];
  return [
    el("a", { "data-testid": "run-schedule", href: scheduleHref(run.schedule) }, run.schedule),
    " at ",
    timeOf(run.fire_time, { "data-testid": "run-fire-time" }),
  ];
}

/** A state badge: text = the state, coloured by class. */
export function stateBadge(state, attrs = {}) {
  return el("span", { ...attrs, class: `state s-${state}` }, state);
}

/** JSON for a <pre>, "(none)" for null. */
export function pretty(value) {
  if (value === null || value === undefined) return "(none)";
  return JSON.stringify(value, null, 2);
}

/** Replace tbody's rows unless every row's key is unchanged (no flicker, stable nodes). */
export function renderRows(tbody, items, keyOf, rowOf) {
  const keys = items.map(keyOf);
  const current = Array.from(tbody.rows, (row) => row.dataset.key);
  if (keys.length === current.length && keys.every((k, i) => k === current[i])) return;
  tbody.replaceChildren(
    ...items.map((item, i) => {
      const row = rowOf(item);
      row.dataset.key = keys[i];
      return row;
    }),
  );
}

/**
 * Run work() now and then every intervalMs after it ended. now() runs it at once (a run in
 * flight is followed by another). An error goes to the status line until the next success
 * (only that error is cleared: an action's result stays visible). A read refused for want of a
 * token asks for it and pauses until a token is saved.
 */
export function poller(intervalMs, work) {
  let timer = null;
  let busy = false;
  let again = false;
  let shown = null; // the error this poller put on the status line
  async function run() {
    clearTimeout(timer);
    if (busy) {
      again = true;
      return;
    }
    busy = true;
    let paused = false;
    try {
      await work();
      if (shown !== null && $("[data-testid=flash]").textContent === shown) flash("");
      shown = null;
    } catch (err) {
      paused = needsToken(err);
      if (paused) askForToken(err);
      else flash(describe(err), "error");
      shown = $("[data-testid=flash]").textContent;
    } finally {
      busy = false;
    }
    if (again) {
      again = false;
      run();
      return;
    }
    if (!paused) timer = setTimeout(run, intervalMs);
  }
  window.addEventListener(TOKEN_EVENT, run);
  return { start: run, now: run };
}

/** The header's token field: saved in sessionStorage only (this tab), never in a cookie. */
export function initChrome() {
  const input = $("input[data-testid=token]");
  input.value = token();
  const save = () => {
    const value = input.value.trim();
    input.removeAttribute("aria-invalid");
    if (value) {
      sessionStorage.setItem(TOKEN_KEY, value);
      flash("Token saved for this browser tab.", "ok");
    } else {
      sessionStorage.removeItem(TOKEN_KEY);
      flash("Token cleared.", "ok");
    }
    window.dispatchEvent(new Event(TOKEN_EVENT)); // the page reads again, with the token
  };
  $("[data-testid=save-token]").addEventListener("click", save);
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") save();
  });
}
