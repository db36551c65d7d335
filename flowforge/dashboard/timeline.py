"""Layout of a run's timeline (the run page's Gantt): rows of time segments on one axis.

Pure: :class:`~flowforge.domain.timeline.TimelineFacts` in (already bounded by the store),
rows out — no I/O, no clock (``facts.now`` is the database's). Times are kept as instants and
as seconds from the axis start (``start_s``/``end_s``), which the page scales to its width.

One row per top-level task in creation order; a map's row is followed by its shown items
(depth 1) and, when the store left items out, one ``more`` row for them (their counts and the
span from the first start to the last finish); tasks beyond the limit are one ``omitted``
row. A worker task's row: a ``wait`` segment from when it could start (dependencies finished;
an item: its map's expansion) to its first attempt, one ``attempt`` segment per attempt
(coloured by outcome on the page), a ``backoff`` segment between two attempts and after the
last one while the task waits to be tried again. A task no worker runs (a map, a timer, an
event wait, a child workflow) has its ``wait`` and one ``span`` from its start. A segment that
has not ended ends at ``now`` and is ``open``: it grows on the next read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Literal
from uuid import UUID

from flowforge.dashboard.graph import label_for
from flowforge.domain.model import Attempt
from flowforge.domain.timeline import MapRest, TimelineFacts, TimelineTask

SegmentKind = Literal["wait", "attempt", "backoff", "span", "items"]
RowKind = Literal["task", "item", "more", "omitted"]

#: The width (SVG units) of the label column; labels are shortened to fit it.
LABEL_WIDTH = 200.0
#: Characters of an attempt's error a segment carries: its first line, cut.
ERROR_LINE_CHARS = 200
#: The shortest axis drawn (seconds): a run read the instant it was created still has one.
MIN_SPAN_S = 1.0
#: At most this many ticks on the axis.
MAX_TICKS = 8
#: Tick steps (seconds) the axis chooses from, the smallest that keeps within MAX_TICKS.
TICK_STEPS = (
    *(0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30),
    *(60 * m for m in (1, 2, 5, 10, 15, 30)),
    *(3600 * h for h in (1, 2, 3, 6, 12)),
    *(86400 * d for d in (1, 2, 7, 14, 30, 90, 180, 365)),
)
#: States in which a task is finished (its open backoff ends).
FINISHED = frozenset({"SUCCEEDED", "DEAD", "CANCELLED"})
DECIMALS = 3
ELLIPSIS = "\u2026"


@dataclass(frozen=True)
class Segment:
    """One stretch of a row: ``kind``, its instants and seconds from the axis start; an
    ``attempt`` segment also its number, outcome, failure reason, worker and the first line of
    its error (untrusted text: the page shows it as text)."""

    kind: SegmentKind
    start: datetime
    end: datetime
    start_s: float
    end_s: float
    open: bool
    attempt: int | None = None
    outcome: str | None = None
    failure_reason: str | None = None
    worker: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Row:
    """One line of the chart.

    ``kind``: ``task`` (a top-level task), ``item`` (a map's item, ``depth`` 1, ``map_id`` its
    map), ``more`` (a map's items left out: ``n``, ``counts`` by state, ``attempts`` in all)
    or ``omitted`` (``n`` tasks left out). ``attempts``: a task's attempt count;
    ``attempts_omitted``: how many of its first ones have no segment (the store reads the
    latest). ``retry_at``: when a task waiting to be tried again is due.
    """

    kind: RowKind
    key: str
    name: str
    label: str
    depth: int
    task_id: UUID | None = None
    map_id: UUID | None = None
    task_kind: str | None = None
    handler: str | None = None
    state: str | None = None
    failure_reason: str | None = None
    attempts: int = 0
    attempts_omitted: int = 0
    retry_at: datetime | None = None
    n: int | None = None
    counts: dict[str, int] | None = None
    segments: tuple[Segment, ...] = field(default=())


@dataclass(frozen=True)
class Tick:
    """An axis mark ``s`` seconds from the start, labelled like ``1m 30s``."""

    s: float
    label: str


@dataclass(frozen=True)
class Layout:
    """The chart: the axis from ``start`` to ``end`` (``span_s`` seconds, at least
    :data:`MIN_SPAN_S`), read at ``now``; its rows top to bottom and its ticks."""

    start: datetime
    end: datetime
    now: datetime
    span_s: float
    rows: tuple[Row, ...]
    ticks: tuple[Tick, ...]


def first_line(text: str | None, limit: int = ERROR_LINE_CHARS) -> str | None:
    """The first line of ``text`` that is not blank, stripped and cut to ``limit`` characters
    (an ellipsis marks a cut); None for none."""
    for line in (text or "").splitlines():
        stripped = line.strip()
        if stripped:
            return stripped if len(stripped) <= limit else stripped[: limit - 1] + ELLIPSIS
    return None


def duration_label(seconds: float) -> str:
    """``seconds`` as the two largest units: ``0s``, ``250ms``, ``1.5s``, ``45s``, ``1m 30s``,
    ``2h``, ``1d 4h`` (tenths below a minute, so half-second ticks read apart)."""
    if 0 < seconds < 1:
        return f"{round(seconds * 1000)}ms"
    if seconds < 60 and round(seconds, 1) != round(seconds):
        return f"{seconds:.1f}s"
    left = round(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size:
            parts.append(f"{left // size}{unit}")
            left %= size
    return " ".join(parts[:2]) or "0s"


def ticks(span_s: float, most: int = MAX_TICKS) -> tuple[Tick, ...]:
    """Marks from 0 every round step (:data:`TICK_STEPS`) to ``span_s``, at most ``most``."""
    step = next((s for s in TICK_STEPS if span_s / s < most), TICK_STEPS[-1])
    count = int(span_s / step + 1e-9) + 1  # 1.0 // 0.2 is 4.0: binary fractions fall short
    return tuple(Tick(round(i * step, DECIMALS), duration_label(i * step)) for i in range(count))


def lay_out(facts: TimelineFacts) -> Layout:
    """The chart of ``facts`` (module docstring)."""
    now = facts.now
    built = list(_rows(facts, now))
    instants = [s.start for _row, segments in built for s in segments]
    ends = [s.end for _row, segments in built for s in segments]
    start = min([facts.run.created_at, *instants])
    end = max([facts.run.finished_at or now, *ends])
    span_s = max(MIN_SPAN_S, (end - start).total_seconds())
    rows = tuple(
        replace(row, segments=tuple(_placed(s, start) for s in segments)) for row, segments in built
    )
    return Layout(start, end, now, round(span_s, DECIMALS), rows, ticks(span_s))


# A segment before it is placed on the axis: (kind, start, end or None: open, attempt).
_Piece = tuple[SegmentKind, datetime, datetime | None, Attempt | None]


@dataclass(frozen=True)
class _Unplaced:
    kind: SegmentKind
    start: datetime
    end: datetime
    open: bool
    attempt: Attempt | None


def _rows(facts: TimelineFacts, now: datetime) -> Iterator[tuple[Row, list[_Unplaced]]]:
    rests = {r.map_id: r for r in facts.rests}
    names = {t.id: t.name for t in facts.tasks if t.map_id is None}
    tasks = list(facts.tasks)
    for i, task in enumerate(tasks):
        yield _task_row(task), _ended(_pieces(task), now)
        # a map's rest follows its last shown item, or the map itself when none is shown
        owner = task.map_id or (task.id if task.kind == "map" else None)
        following = tasks[i + 1] if i + 1 < len(tasks) else None
        if owner in rests and (following is None or following.map_id != owner):
            rest = rests[owner]
            yield _more_row(rest, names.get(owner, "")), _ended(_rest_pieces(rest), now)
    omitted = facts.tasks_total - len(names)
    if omitted > 0:
        label = f"+ {omitted:,} more tasks (the first {facts.limits.tasks:,} are shown)"
        yield Row(kind="omitted", key="omitted", name="", label=label, depth=0, n=omitted), []


def _task_row(task: TimelineTask) -> Row:
    shown = task.attempts
    item = task.map_id is not None
    return Row(
        kind="item" if item else "task",
        key=str(task.id),
        name=task.name,
        label=label_for(f"[{task.item_index}]" if item else task.name, LABEL_WIDTH),
        depth=1 if item else 0,
        task_id=task.id,
        map_id=task.map_id,
        task_kind=task.kind,
        handler=task.handler,
        state=task.state,
        failure_reason=task.failure_reason,
        attempts=task.attempt,
        attempts_omitted=shown[0].attempt - 1 if shown else 0,
        retry_at=task.retry_at if task.state == "RETRYING" else None,
    )


def _more_row(rest: MapRest, map_name: str) -> Row:
    noun = "item" if rest.n == 1 else "items"
    return Row(
        kind="more",
        key=f"{rest.map_id}:more",
        name=map_name,
        label=f"+ {rest.n:,} more {noun}",
        depth=1,
        map_id=rest.map_id,
        attempts=rest.attempts,
        n=rest.n,
        counts=dict(sorted(rest.counts.items())),
    )


def _pieces(task: TimelineTask) -> list[_Piece]:
    """The segments of a task, an open one's end None."""
    finished = task.state in FINISHED
    if task.kind != "worker":
        begun = task.started_at
        pieces = _wait(task.eligible_at, begun or task.finished_at, not finished)
        if begun is not None:
            pieces.append(("span", begun, task.finished_at, None))
        return pieces
    attempts = task.attempts
    pieces = []
    if not attempts or attempts[0].attempt == 1:  # its wait is shown with its first attempt
        first = attempts[0].started_at if attempts else task.finished_at
        pieces = _wait(task.eligible_at, first, not attempts and not finished)
    previous: Attempt | None = None
    for attempt in attempts:  # in time order: a backoff before the attempt it ends with
        ended = previous.finished_at if previous else None
        if ended is not None and attempt.started_at > ended:
            pieces.append(("backoff", ended, attempt.started_at, None))
        pieces.append(("attempt", attempt.started_at, attempt.finished_at, attempt))
        previous = attempt
    if previous and previous.finished_at is not None and not finished:
        pieces.append(("backoff", previous.finished_at, None, None))  # awaits its retry
    return pieces


def _wait(since: datetime | None, until: datetime | None, waiting: bool) -> list[_Piece]:
    """A wait from ``since`` to ``until``; open (to now) when ``until`` is None and the task
    still ``waiting``; none when it could not start yet or never waited."""
    if since is None or (until is None and not waiting):
        return []
    if until is not None and until <= since:
        return []
    return [("wait", since, until, None)]


def _rest_pieces(rest: MapRest) -> list[_Piece]:
    if rest.first_started_at is None:
        return []
    end = None if rest.unfinished_started else rest.last_finished_at
    return [("items", rest.first_started_at, end, None)]


def _ended(pieces: Iterable[_Piece], now: datetime) -> list[_Unplaced]:
    """Open pieces end at ``now`` (a clock skew never makes one end before it starts)."""
    return [
        _Unplaced(kind, start, end if end is not None else max(start, now), end is None, attempt)
        for kind, start, end, attempt in pieces
    ]


def _placed(piece: _Unplaced, origin: datetime) -> Segment:
    attempt = piece.attempt
    return Segment(
        kind=piece.kind,
        start=piece.start,
        end=piece.end,
        start_s=_seconds(piece.start, origin),
        end_s=_seconds(piece.end, origin),
        open=piece.open,
        attempt=attempt.attempt if attempt else None,
        outcome=attempt.outcome if attempt else None,
        failure_reason=attempt.failure_reason if attempt else None,
        worker=attempt.worker if attempt else None,
        error=first_line(attempt.error) if attempt else None,
    )


def _seconds(instant: datetime, origin: datetime) -> float:
    return round((instant - origin).total_seconds(), DECIMALS)
