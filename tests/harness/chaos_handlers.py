"""Handlers of scripts/chaos: each records its execution before doing anything else."""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

from flowforge import task


def record(ctx: Any, kind: str) -> None:
    with psycopg.connect(os.environ["FLOWFORGE_CHAOS_DB"], autocommit=True) as conn:
        conn.execute(
            "INSERT INTO chaos_executions (task_run_id, attempt, kind, key, pid)"
            " VALUES (%s, %s, %s, %s, %s)",
            (ctx.task_run_id, ctx.attempt, kind, ctx.input.get("key"), os.getpid()),
        )


@task("chaos.step")
def step(ctx: Any) -> dict[str, Any]:
    record(ctx, "step")
    return {"task": ctx.name}


@task("chaos.flaky")
def flaky(ctx: Any) -> dict[str, Any]:
    record(ctx, "flaky")
    if ctx.attempt < 2:
        raise RuntimeError("flaky on purpose")
    return {"attempt": ctx.attempt}


@task("chaos.doomed")
def doomed(ctx: Any) -> None:
    record(ctx, "doomed")
    raise RuntimeError("always fails")


@task("chaos.slow")
def slow(ctx: Any) -> dict[str, Any]:
    record(ctx, "slow")
    time.sleep(float(ctx.input.get("seconds", 1.0)))
    return {"slept": ctx.input.get("seconds", 1.0)}


@task("chaos.keyed")
def keyed(ctx: Any) -> dict[str, Any]:
    record(ctx, "keyed")
    return {"key": ctx.input["key"]}
