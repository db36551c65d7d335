"""The soak's verdicts (tests/harness/bench_soak_verdicts.py) on made-up samples."""

from __future__ import annotations

from typing import Any

from tests.harness.bench_soak_verdicts import Limits, steady_start_s, verdicts

DURATION_S = 1800.0


def sample(
    t_s: float,
    rss: dict[str, int] | None = None,
    p99: float | None = 10.0,
    dead: int = 100,
    live: int = 10_000,
    connections: int = 12,
) -> dict[str, Any]:
    return {
        "t_s": t_s,
        "rss_kb": rss if rss is not None else {"worker [1]": 50_000, "scheduler [2]": 40_000},
        "dispatch_p99_ms": p99,
        "hop_p99_ms": p99,
        "tables": {"task_runs": {"live": live, "dead": dead, "bytes": 8192, "index_bytes": 8192}},
        "connections": connections,
    }


def run(**kwargs: Any) -> list[dict[str, Any]]:
    """Samples every 60 s over the soak, each made by ``sample`` with ``kwargs`` (callables of
    the time are called)."""
    return [
        sample(t, **{k: v(t) if callable(v) else v for k, v in kwargs.items()})
        for t in range(0, int(DURATION_S) + 1, 60)
    ]


def test_the_steady_state_starts_at_minute_five_or_a_sixth_of_a_short_soak() -> None:
    assert steady_start_s(1800) == 300
    assert steady_start_s(60) == 10


def test_flat_figures_pass_every_verdict() -> None:
    found = verdicts(run(), DURATION_S, autovacuum=True)
    for name in ("rss", "dispatch_p99", "hop_p99", "bloat", "connections"):
        assert found[name]["ok"] is True, (name, found[name])


def test_rss_growing_after_minute_five_fails_and_growth_before_it_does_not() -> None:
    warming = run(rss=lambda t: {"worker [1]": 50_000 + 100 * min(t, 300)})
    assert verdicts(warming, DURATION_S, autovacuum=True)["rss"]["ok"] is True
    leaking = run(rss=lambda t: {"worker [1]": 50_000 + 10 * t})  # +30% over the steady part
    found = verdicts(leaking, DURATION_S, autovacuum=True)["rss"]
    assert found["ok"] is False
    assert found["growth"]["worker [1]"] > 0.05
    assert found["kb_per_hour"]["worker [1]"] == 36_000  # 10 kB/s
    assert verdicts(warming, DURATION_S, autovacuum=True)["rss"]["kb_per_hour"]["worker [1]"] == 0


def test_a_process_gone_by_the_end_fails_the_rss_verdict() -> None:
    samples = run()
    samples[-1]["rss_kb"] = {"worker [1]": 50_000, "scheduler [3]": 40_000}  # restarted
    found = verdicts(samples, DURATION_S, autovacuum=True)["rss"]
    assert found["ok"] is False and found["gone"] == ["scheduler [2]"]


def test_a_p99_that_grows_past_the_ratio_fails() -> None:
    found = verdicts(run(p99=lambda t: 10.0 + t / 60), DURATION_S, autovacuum=True)
    assert found["dispatch_p99"]["ok"] is False and found["hop_p99"]["ok"] is False
    # a few ms more on a small p99 is within the slack
    noisy = verdicts(run(p99=lambda t: 2.0 if t < 1800 else 6.0), DURATION_S, autovacuum=True)
    assert noisy["dispatch_p99"]["ok"] is True


def test_intervals_without_finished_runs_are_not_judged() -> None:
    found = verdicts(run(p99=None), DURATION_S, autovacuum=True)
    assert found["dispatch_p99"]["ok"] is None


def test_open_connections_growing_fails() -> None:
    growing = run(connections=lambda t: 12 + t // 300)  # one more every five minutes
    found = verdicts(growing, DURATION_S, autovacuum=True)
    assert found["connections"]["ok"] is False
    assert found["connections"]["max"] == 18
    slack = Limits(connections_slack=4)  # the last third's median is 3.5 above the first's
    assert verdicts(growing, DURATION_S, True, slack)["connections"]["ok"]


def test_connections_that_rise_for_a_while_and_come_back_pass() -> None:
    """A pool grown for a burst (or drained into new sessions) closes its idle connections
    ten minutes later: not a leak."""
    bump = run(connections=lambda t: 15 if 600 <= t < 1200 else 12)
    found = verdicts(bump, DURATION_S, autovacuum=True)["connections"]
    assert found["ok"] is True and found["max"] == 15


def test_dead_tuples_past_the_bound_fail_with_autovacuum_on_and_are_not_judged_off() -> None:
    growing = run(dead=lambda t: 20 * t, live=10_000)  # 36,000 dead for 10,000 live
    on = verdicts(growing, DURATION_S, autovacuum=True)["bloat"]
    assert on["ok"] is False and "task_runs" in on["why"]
    assert on["tables"]["task_runs"]["max_dead"] == 36_000
    off = verdicts(growing, DURATION_S, autovacuum=False)["bloat"]
    assert off["ok"] is None and "autovacuum is off" in off["why"]
    kept = run(dead=lambda t: 3000 if t % 120 else 200, live=10_000)  # vacuumed now and then
    assert verdicts(kept, DURATION_S, autovacuum=True)["bloat"]["ok"] is True


def test_too_few_samples_are_not_judged() -> None:
    found = verdicts([sample(0.0)], DURATION_S, autovacuum=True)
    assert found["rss"]["ok"] is None and found["connections"]["ok"] is None
