"""Probes of the tests that stop running handlers on real role processes
(tests/integration/test_cancel_delivery.py, test_task_control_processes.py): when a handler
``e2e.cancel_seen`` saw its ``ctx.cancelled``, how many workers LISTEN for cancellations, and
the ``flowforge`` command run as an operator runs it against the stack."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg

from tests.e2e import REPO, Stack

Sql = psycopg.Connection[tuple[Any, ...]]

#: Renewal far away: only a notification can deliver a cancel within a second.
SLOW_RENEWAL = {"lease_s": 90.0, "heartbeat_s": 30.0}
#: The promise: a cancel reaches the handler within this (seconds, database clock).
PROMPT_S = 1.0
LISTENER_APP = "flowforge-listen-flowforge_cancel"


def seen_at(sql: Sql, task_id: UUID) -> datetime | None:
    """When (database clock) ``e2e.cancel_seen`` saw the task's ``ctx.cancelled``; None yet."""
    row = sql.execute(
        "SELECT at FROM test_executions WHERE task_run_id = %s AND handler = %s",
        (task_id, "e2e.cancel_seen:seen"),
    ).fetchone()
    return None if row is None else row[0]


def listeners(sql: Sql) -> int:
    """Cancel listeners connected to this test's database, LISTENing."""
    row = sql.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = %s AND query ILIKE 'LISTEN%%'",
        (LISTENER_APP,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def cli(stack: Stack, *args: str) -> str:
    """``flowforge -c <the stack's config> ARGS`` in a process of its own; it must succeed.
    Its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "flowforge.cli", "-c", str(stack.config_path()), *args],
        cwd=REPO,
        env=stack.env(),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()
