"""The retention purge's pacing (flowforge/roles/retention.py): once a minute when caught up,
batches back to back within a share of the time when behind, each steered towards its target
duration — a pure policy, driven here with a fake clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowforge.config import load_config
from flowforge.errors import ConfigError
from flowforge.roles.retention import MAX_BATCH, MIN_BATCH, RetentionPacing


def pacing(limit: int = 500, share: float = 0.1) -> RetentionPacing:
    return RetentionPacing(limit=limit, interval_s=60.0, batch_s=0.1, share=share)


def test_the_first_batch_is_due_at_once() -> None:
    assert pacing().due(0.0)
    assert pacing().wait_s(0.0) == 0.0


def test_caught_up_the_next_batch_waits_a_housekeeping_interval_and_the_size_stays() -> None:
    p = pacing()
    assert p.done(now=10.0, purged=499, elapsed_s=0.01) == 499
    assert not p.due(69.9) and p.due(70.0)
    assert p.wait_s(40.0) == pytest.approx(30.0)
    assert p.limit == 500  # a partial batch says nothing of what a full one takes


def test_behind_the_next_batch_comes_after_a_pause_that_keeps_purging_within_its_share() -> None:
    p = pacing(share=0.1)
    assert p.done(now=10.0, purged=500, elapsed_s=0.1) is None
    # 0.1 s of work, 0.9 s of pause: 10% of the time
    assert p.wait_s(10.0) == pytest.approx(0.9)
    assert p.due(10.9) and not p.due(10.8)


def test_a_full_share_runs_batches_back_to_back() -> None:
    p = pacing(share=1.0)
    p.done(now=5.0, purged=500, elapsed_s=0.3)
    assert p.due(5.0)


def test_the_batch_is_steered_towards_its_target_duration_at_most_a_doubling_a_step() -> None:
    p = pacing(limit=500)
    p.done(now=1.0, purged=500, elapsed_s=0.05)  # twice as fast as the target
    assert p.limit == 1000
    p.done(now=2.0, purged=1000, elapsed_s=0.001)  # far faster: still only doubled
    assert p.limit == 2000
    p.done(now=3.0, purged=2000, elapsed_s=0.4)  # four times too slow: halved
    assert p.limit == 1000
    p.done(now=4.0, purged=1000, elapsed_s=0.125)
    assert p.limit == 800


def test_the_batch_stays_within_its_bounds() -> None:
    p = pacing(limit=MAX_BATCH)
    p.done(now=1.0, purged=MAX_BATCH, elapsed_s=0.001)
    assert p.limit == MAX_BATCH
    p = pacing(limit=MIN_BATCH)
    p.done(now=1.0, purged=MIN_BATCH, elapsed_s=100.0)
    assert p.limit == MIN_BATCH


def test_the_rows_purged_while_behind_are_reported_once_caught_up() -> None:
    p = pacing(limit=100)
    assert p.done(now=1.0, purged=100, elapsed_s=0.1) is None
    assert p.done(now=2.0, purged=100, elapsed_s=0.1) is None
    assert p.done(now=3.0, purged=40, elapsed_s=0.05) == 240
    assert p.done(now=70.0, purged=0, elapsed_s=0.01) == 0  # the next stretch starts afresh


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        ("scheduler:\n  retention_share: 0\n", "retention_share must be more than 0 and at most 1"),
        ("scheduler:\n  retention_share: 1.5\n", "retention_share must be more than 0 and at most"),
        ("scheduler:\n  retention_batch_s: 0\n", "retention_batch_s must be a positive"),
    ],
)
def test_pacing_settings_out_of_range_are_a_config_error(
    tmp_path: Path, text: str, detail: str
) -> None:
    path = tmp_path / "flowforge.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert "scheduler" in message and detail in message and "\n" not in message
