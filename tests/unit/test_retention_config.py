"""Retention settings: defaults, and a key retention that could not outlive its runs refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowforge.config import SchedulerConfig, load_config
from flowforge.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def load(tmp_path: Path, text: str) -> SchedulerConfig:
    path = tmp_path / "flowforge.yaml"
    path.write_text(text, encoding="utf-8")
    return load_config(path, env={}).scheduler


def test_runs_are_kept_30_days_and_keys_90() -> None:
    config = SchedulerConfig()
    assert (config.retention_days, config.idempotency_retention_days) == (30.0, 90.0)


def test_the_example_config_states_both_retentions() -> None:
    text = (REPO / "config" / "flowforge.example.yaml").read_text(encoding="utf-8")
    assert "retention_days: 30" in text and "idempotency_retention_days: 90" in text
    scheduler = load_config(REPO / "config" / "flowforge.example.yaml", env={}).scheduler
    assert (scheduler.retention_days, scheduler.idempotency_retention_days) == (30.0, 90.0)


def test_key_retention_of_twice_the_run_retention_is_accepted(tmp_path: Path) -> None:
    text = "scheduler:\n  retention_days: 45\n  idempotency_retention_days: 90\n"
    assert load(tmp_path, text).idempotency_retention_days == 90.0


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        ("scheduler:\n  retention_days: 60\n", "idempotency_retention_days (90) must be at least"),
        ("scheduler:\n  idempotency_retention_days: 59\n", "at least twice retention_days (30)"),
        ("scheduler:\n  retention_days: 0\n", "retention_days must be a positive"),
        ("scheduler:\n  retention_days: -1\n", "retention_days must be a positive"),
        ("scheduler:\n  retention_days: .nan\n", "retention_days: must be a finite"),
        ("scheduler:\n  idempotency_retention_days: .inf\n", "retention_days: must be a finite"),
    ],
)
def test_a_retention_that_would_lose_a_promise_is_a_config_error(
    tmp_path: Path, text: str, detail: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    message = str(info.value)
    assert "scheduler" in message and detail in message and "\n" not in message
