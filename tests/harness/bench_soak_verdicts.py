"""The verdicts of ``scripts/bench --soak`` (:mod:`tests.harness.bench_soak`), from its samples.

Pure: a list of samples in, a dict of verdicts out, nothing read or measured here, so that each
rule is unit-tested (tests/unit/test_bench_soak.py). A sample is a dict:

* ``t_s``: seconds since the soak's feed started;
* ``rss_kb``: RSS (kB) by process label (``title [pid]``: a restarted process is a new label);
* ``dispatch_p99_ms`` / ``hop_p99_ms``: p99 over the runs seen finished in the interval before
  the sample (None: none finished);
* ``tables``: by table, ``live`` and ``dead`` tuples, ``bytes`` (heap) and ``index_bytes``;
* ``connections``: the bench database's open connections.

Each verdict is ``{"ok": True | False | None, "why": str, ...figures}``; ``ok`` None means not
judged (too few samples, or, for bloat, autovacuum off: dead tuples then only grow).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Sample = dict[str, Any]

#: The steady state starts at minute 5, or at a sixth of a shorter soak.
STEADY_AFTER_S = 300.0


@dataclass(frozen=True)
class Limits:
    """What the verdicts allow. ``rss_growth``: RSS of every process at the end over its RSS at
    the steady start, minus one (0.05: +5%); ``p99_ratio`` and ``p99_slack_ms``: the last
    interval's p99 may be up to ``ratio`` times the first steady interval's, or ``slack_ms``
    more (whichever is larger: a few ms are noise on a loaded machine); ``dead_floor`` +
    ``dead_per_live`` * live tuples: the dead tuples a table may hold at the end (autovacuum
    starts at 50 + 0.2 * rows by default); ``connections_slack``: the open connections' median
    in the last third of the steady part may exceed the first third's by this many."""

    rss_growth: float = 0.05
    p99_ratio: float = 1.5
    p99_slack_ms: float = 5.0
    dead_floor: int = 1000
    dead_per_live: float = 0.5
    connections_slack: int = 0


def steady_start_s(duration_s: float) -> float:
    """When the steady state starts (s): minute 5, or a sixth of a soak shorter than 30 min."""
    return min(STEADY_AFTER_S, duration_s / 6)


def _steady(samples: Sequence[Sample], steady_s: float) -> list[Sample]:
    """The samples taken at or after ``steady_s``."""
    return [s for s in samples if s["t_s"] >= steady_s]


def rss_flat(samples: Sequence[Sample], steady_s: float, limits: Limits) -> dict[str, Any]:
    """Every process's RSS at the end within ``limits.rss_growth`` of its RSS at the first
    steady sample; a process there that is gone at the end (it exited or restarted) fails."""
    steady = _steady(samples, steady_s)
    if len(steady) < 2:
        return {"ok": None, "why": "fewer than two samples after the steady start"}
    first, last = steady[0]["rss_kb"], steady[-1]["rss_kb"]
    growth = {
        label: round(last[label] / kb - 1, 4) for label, kb in first.items() if label in last and kb
    }
    gone = sorted(label for label in first if label not in last)
    total_first, total_last = sum(first.values()), sum(last.values())
    slopes = {
        label: round(
            _slope([(s["t_s"], s["rss_kb"][label]) for s in steady if label in s["rss_kb"]])
        )
        for label in first
    }
    worst = max(growth.items(), key=lambda item: item[1], default=("", 0.0))
    ok = not gone and all(g <= limits.rss_growth for g in growth.values())
    why = (
        f"processes gone: {', '.join(gone)}"
        if gone
        else f"largest growth {worst[1]:+.1%} ({worst[0]}), limit {limits.rss_growth:+.0%};"
        f" steepest trend {max(slopes.values(), default=0):+d} kB/h"
    )
    return {
        "ok": ok,
        "why": why,
        "growth": growth,
        # the trend, reported and not judged: a steady climb within the limit in a short soak
        # is a leak a longer one would fail on
        "kb_per_hour": slopes,
        "gone": gone,
        "total_kb": [total_first, total_last],
        "from_s": steady[0]["t_s"],
    }


def _slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares growth of ``(seconds, kB)`` points, in kB per hour (0 for fewer than two
    distinct times)."""
    if len({t for t, _ in points}) < 2:
        return 0.0
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return 3600 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var


def p99_stable(
    samples: Sequence[Sample], steady_s: float, key: str, limits: Limits
) -> dict[str, Any]:
    """The p99 ``key`` of the last interval with one, against the first steady interval's."""
    values = [(s["t_s"], s[key]) for s in _steady(samples, steady_s) if s.get(key) is not None]
    if len(values) < 2:
        return {"ok": None, "why": f"fewer than two steady intervals with a {key}"}
    (first_t, first), (last_t, last) = values[0], values[-1]
    allowed = max(first * limits.p99_ratio, first + limits.p99_slack_ms)
    return {
        "ok": last <= allowed,
        "why": f"{last:.1f} ms at {last_t:.0f}s against {first:.1f} ms at {first_t:.0f}s"
        f" (allowed {allowed:.1f})",
        "first_ms": first,
        "last_ms": last,
        "max_ms": max(v for _, v in values),
    }


def bloat_bounded(samples: Sequence[Sample], autovacuum: bool, limits: Limits) -> dict[str, Any]:
    """Every table's dead tuples at the end within ``dead_floor + dead_per_live * live``; its
    bytes (heap and indexes) at the end are reported, not judged (a table of the runs kept
    grows with them). Not judged with autovacuum off: dead tuples then only grow."""
    if not samples:
        return {"ok": None, "why": "no samples"}
    last = samples[-1]["tables"]
    tables: dict[str, Any] = {}
    over = []
    for name, t in last.items():
        allowed = limits.dead_floor + limits.dead_per_live * t["live"]
        tables[name] = {
            "dead": t["dead"],
            "live": t["live"],
            "allowed_dead": round(allowed),
            "bytes": t["bytes"] + t["index_bytes"],
            "max_dead": max(s["tables"].get(name, {}).get("dead", 0) for s in samples),
        }
        if t["dead"] > allowed:
            over.append(name)
    if not autovacuum:
        return {
            "ok": None,
            "why": "not judged: autovacuum is off on this server",
            "tables": tables,
        }
    why = f"dead tuples over the bound: {', '.join(over)}" if over else "every table within"
    return {"ok": not over, "why": why, "tables": tables}


def connections_flat(samples: Sequence[Sample], steady_s: float, limits: Limits) -> dict[str, Any]:
    """No growth in open connections: the median of the last third of the steady samples is no
    more than the first third's (plus the slack). Not the peak: a pool grows for a burst and
    closes what stays idle for its ``max_idle`` (10 min), and a size class crossed drains a
    pool (store/plansize.py: new sessions replace the old ones), so a count may rise for a while
    and come back; a leak does not come back."""
    steady = _steady(samples, steady_s)
    if len(steady) < 3:
        return {"ok": None, "why": "fewer than three samples after the steady start"}
    third = len(steady) // 3
    early = statistics.median(s["connections"] for s in steady[:third])
    late = statistics.median(s["connections"] for s in steady[-third:])
    peak = max(s["connections"] for s in steady)
    return {
        "ok": late <= early + limits.connections_slack,
        "why": f"median {early:g} in the first third of the steady part, {late:g} in the last"
        f" (at most {peak}, {steady[-1]['connections']} at the end)",
        "first": early,
        "max": peak,
        "last": late,
    }


def verdicts(
    samples: Sequence[Sample], duration_s: float, autovacuum: bool, limits: Limits | None = None
) -> dict[str, Any]:
    """Every verdict of a soak of ``duration_s`` seconds."""
    limits = limits or Limits()
    steady_s = steady_start_s(duration_s)
    return {
        "steady_from_s": steady_s,
        "rss": rss_flat(samples, steady_s, limits),
        "dispatch_p99": p99_stable(samples, steady_s, "dispatch_p99_ms", limits),
        "hop_p99": p99_stable(samples, steady_s, "hop_p99_ms", limits),
        "bloat": bloat_bounded(samples, autovacuum, limits),
        "connections": connections_flat(samples, steady_s, limits),
    }
