// The run page's timeline: where the run spent its time. GET /api/v1/runs/{id}/timeline (laid
// out on the server: rows, segments in seconds from the axis start, ticks) drawn as SVG on the
// width the page gives it, redrawn with the page's refresh (a running attempt grows to the
// database's now). One row per task; a map's first items under it and one row counting the
// rest; a bar per attempt coloured by outcome, a lighter one for the wait before the first,
// a thin one for a backoff. Hovering or focusing a segment shows its times, outcome and the
// first line of its error on the line under the chart (text only: an error is untrusted).

import { $, getJSON, span, svg, when } from "./app.js";

const LABEL = 200; // the label column, as flowforge/dashboard/timeline.py's LABEL_WIDTH
const ROW = 22;
const AXIS = 22;
const PAD = 12;
const MIN_PLOT = 320;
const BAR = { attempt: 14, span: 14, items: 14, wait: 8, backoff: 3 };

/** A map's items by state: "3 SUCCEEDED, 2 RUNNING". */
function counted(counts) {
  return Object.entries(counts || {})
    .map(([state, n]) => `${n} ${state}`)
    .join(", ");
}

/** What a span segment is, by the kind of task that has it. */
const SPANS = {
  timer: "slept",
  map: "its items ran",
  event: "waited for its event",
  child: "its child run ran",
};

/** The words of one segment: its row, what it is, when, how long, and for an attempt its
 * outcome, worker and the first line of its error. */
export function describeSegment(row, seg, run) {
  const until = seg.open ? `now (${run.state === "RUNNING" ? "still going" : "not ended"})` : when(seg.end);
  const times = `${when(seg.start)} → ${until}, ${span(seg.end_s - seg.start_s)}`;
  const who = row.kind === "more" ? `${row.label} of ${row.name}` : row.name;
  switch (seg.kind) {
    case "attempt": {
      const reason = seg.failure_reason ? ` (${seg.failure_reason})` : "";
      const worker = seg.worker ? `, worker ${seg.worker}` : "";
      const error = seg.error ? ` — ${seg.error}` : "";
      return `${who}: attempt ${seg.attempt} ${seg.outcome}${reason}, ${times}${worker}${error}`;
    }
    case "wait":
      return `${who}: waited to start, ${times}`;
    case "backoff": {
      const next = row.retry_at && seg.open ? ` (next attempt due ${when(row.retry_at)})` : "";
      return `${who}: backoff before its next attempt${next}, ${times}`;
    }
    case "items":
      return `${who}: ${counted(row.counts)}; first start to last finish ${times}`;
    default:
      return `${who}: ${SPANS[row.task_kind] || "ran"}, ${times}`;
  }
}

/** A row's label, its tooltip the task's facts. */
function rowTitle(row) {
  if (row.kind === "omitted" || row.kind === "more") return row.label;
  const omitted = row.attempts_omitted ? ` (the first ${row.attempts_omitted} not drawn)` : "";
  const what = row.task_kind === "worker" ? row.handler : row.task_kind;
  return `${row.name} (${what}): ${row.state}, ${row.attempts} attempt(s)${omitted}`;
}

function segmentClass(seg) {
  const outcome = seg.outcome ? ` o-${seg.outcome}` : "";
  return `seg seg-${seg.kind}${outcome}${seg.open ? " open" : ""}`;
}

function segmentKey(row, seg, i) {
  return `${row.key}/${i}/${seg.kind}/${seg.attempt ?? ""}`;
}

/**
 * The timeline of run ``runId`` in the page's ``[data-testid=timeline]``; ``onSelect(name)``
 * is called when a task's row is clicked (the page opens its panel). ``refresh()`` reads and
 * draws it again; the segment under the pointer or the focus keeps its details shown.
 */
export function timeline(runId, onSelect) {
  const chart = $("[data-testid=timeline]");
  const tip = $("[data-testid=timeline-tip]");
  const note = $("#timeline-note");
  let shown = null; // the key of the segment whose details are shown
  let last = null;

  function show(key, text) {
    shown = key;
    tip.textContent = text;
    tip.dataset.key = key;
  }

  function hide(key) {
    if (shown !== key) return;
    shown = null;
    tip.textContent = "Point at or focus a bar for its times.";
    delete tip.dataset.key;
  }

  function drawSegment(row, seg, i, y, x) {
    const key = segmentKey(row, seg, i);
    const height = BAR[seg.kind] || BAR.span;
    const left = x(seg.start_s);
    const text = describeSegment(row, seg, last.run);
    const rect = svg(
      "rect",
      {
        "data-testid": "timeline-segment",
        "data-kind": seg.kind,
        "data-attempt": seg.attempt,
        "data-outcome": seg.outcome,
        "data-open": seg.open ? "true" : null,
        "data-start": seg.start,
        "data-end": seg.end,
        "data-key": key,
        class: segmentClass(seg),
        x: left.toFixed(1),
        y: (y + (ROW - height) / 2).toFixed(1),
        width: Math.max(1.5, x(seg.end_s) - left).toFixed(1),
        height,
        rx: seg.kind === "attempt" ? 2 : 0,
        tabindex: 0,
        "aria-label": text,
      },
      svg("title", {}, text),
    );
    rect.addEventListener("mouseenter", () => show(key, text));
    rect.addEventListener("focus", () => show(key, text));
    rect.addEventListener("mouseleave", () => hide(key));
    rect.addEventListener("blur", () => hide(key));
    return rect;
  }

  function drawRow(row, index, x) {
    const y = AXIS + index * ROW;
    const indent = row.depth * 14;
    const label = svg(
      "text",
      { class: "tl-label", x: PAD + indent, y: y + ROW / 2, "dominant-baseline": "central" },
      svg("title", {}, rowTitle(row)),
      row.label,
    );
    const group = svg(
      "g",
      {
        "data-testid": "timeline-row",
        "data-kind": row.kind,
        // a "more" row names its map apart, so [data-task=NAME] is one row
        "data-task": row.kind === "more" ? null : row.name || null,
        "data-map": row.kind === "more" ? row.name : null,
        "data-task-id": row.task_id,
        "data-state": row.state,
        "data-key": row.key,
        class: `tl-row${index % 2 ? " odd" : ""}`,
      },
      svg("rect", { class: "tl-band", x: 0, y, width: "100%", height: ROW }),
      label,
      ...row.segments.map((seg, i) => drawSegment(row, seg, i, y, x)),
    );
    if (row.kind === "task" && onSelect) {
      label.classList.add("link");
      label.addEventListener("click", () => onSelect(row.name));
    }
    return group;
  }

  function draw(data) {
    last = data;
    const width = Math.max(LABEL + MIN_PLOT + PAD, chart.parentElement.clientWidth - 2);
    const plot = width - LABEL - PAD;
    const x = (s) => LABEL + (s / data.span_s) * plot;
    const height = AXIS + data.rows.length * ROW + PAD;
    chart.setAttribute("viewBox", `0 0 ${width} ${height}`);
    chart.setAttribute("width", String(width));
    chart.setAttribute("height", String(height));
    const ticks = data.ticks.map((t) =>
      svg(
        "g",
        { class: "tl-tick" },
        svg("line", { x1: x(t.s), x2: x(t.s), y1: AXIS - 4, y2: height - PAD }),
        svg("text", { x: x(t.s), y: AXIS - 8, "text-anchor": "middle" }, t.label),
      ),
    );
    const focused = document.activeElement && chart.contains(document.activeElement)
      ? document.activeElement.getAttribute("data-key")
      : null;
    chart.replaceChildren(...ticks, ...data.rows.map((row, i) => drawRow(row, i, x)));
    // the same segment keeps the focus and its details across a redraw
    const again = shown && chart.querySelector(`[data-key="${CSS.escape(shown)}"]`);
    if (again) show(shown, again.getAttribute("aria-label"));
    else if (shown) hide(shown);
    if (focused) chart.querySelector(`[data-key="${CSS.escape(focused)}"]`)?.focus();
    const items = data.limits.items;
    note.textContent =
      `From ${when(data.start)}, ${span(data.span_s)}. ` +
      `A map shows its first ${items} items and one row for the rest; a task its latest ` +
      `${data.limits.attempts} attempts.`;
  }

  async function refresh() {
    draw(await getJSON(`/api/v1/runs/${encodeURIComponent(runId)}/timeline`));
  }

  hide(null);
  window.addEventListener("resize", () => last && draw(last));
  return { refresh };
}
