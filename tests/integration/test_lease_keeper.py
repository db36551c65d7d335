"""Leases outlive a blocked main thread, against real PostgreSQL and the real reaper.

A worker's main thread can be held up in a broker call for longer than a lease: RabbitMQ
answers a quorum queue's ``basic.cancel`` (the worker's hand-back behind a slow handler) only
once the queue has a leader, and waits up to 30 s per node while one is elected. When the
renewals waited for the main thread, the lease of a handler that had already run lapsed, the
scheduler reaped the task, and another worker ran it a second time (the RabbitMQ failover test
caught it). Here the broker is a stub whose hand-back blocks for several leases while the
scheduler's reaper runs against the database: the task must end SUCCEEDED on its first attempt.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import psycopg
import pytest

from flowforge.config import BrokerConfig, DatabaseConfig, WorkerConfig, load_config
from flowforge.roles.context import TaskContext
from flowforge.roles.worker import Worker
from flowforge.store.db import Database
from flowforge.store.passes import Passes
from tests.helpers import single, wait_for
from tests.store import Store
from tests.stubs import StubBroker

pytestmark = pytest.mark.integration

LEASE_S = 1.0
HEARTBEAT_S = 0.2
#: The hand-back stays blocked this many leases (the reaper sweeps all along).
BLOCKED_LEASES = 3
REAP_EVERY_S = 0.05


def test_a_lease_outlives_a_broker_call_blocked_for_several_leases(
    db: Database, repo: Store, clean_database_url: str
) -> None:
    base = load_config(env={})
    config = dataclasses.replace(
        base,
        database=DatabaseConfig(url=clean_database_url, pool_min=1, pool_max=4),
        broker=BrokerConfig(prefetch=4),
        worker=WorkerConfig(
            lease_s=LEASE_S, heartbeat_s=HEARTBEAT_S, fast_handler_ms=50, listen_for_cancel=False
        ),
    )
    run = repo.trigger(single("blocked-broker", "slow"), {})
    task = repo.get_run(run.run_id).tasks[0]
    stop = threading.Event()
    broker = StubBroker(on_idle=stop.set)
    broker.publish(task.id, task.fencing_token)
    executions: list[int] = []

    def slow(ctx: TaskContext) -> str:
        executions.append(ctx.attempt)
        time.sleep(0.1)  # slower than fast_handler_ms, so the worker hands back behind it
        return "done"

    blocked_until: list[float] = []
    handed_back = StubBroker.hand_back

    def blocked_hand_back() -> int:
        # what a quorum queue's basic.cancel does while its leader is being elected
        time.sleep(BLOCKED_LEASES * LEASE_S)  # the blocked call itself, not a wait for a state
        blocked_until.append(time.monotonic())
        return handed_back(broker)

    broker.hand_back = blocked_hand_back  # type: ignore[method-assign]
    reaped: list[int] = []
    sweeping = threading.Event()

    def reaper() -> None:
        passes = Passes(db, rand=lambda: 0.5)
        while not sweeping.wait(REAP_EVERY_S):
            reaped.append(passes.reap_expired(100))

    sweeper = threading.Thread(target=reaper, name="reaper", daemon=True)
    sweeper.start()
    worker = Worker(config, handlers={"slow": slow}, broker=broker)
    try:
        worker.initialize()
        worker.loop(stop, lambda: None)
    finally:
        worker.shutdown()
        sweeping.set()
        sweeper.join(10)
    assert blocked_until, "the hand-back never ran: the handler was not slow"
    assert len(reaped) > BLOCKED_LEASES * LEASE_S / REAP_EVERY_S / 2, "the reaper barely swept"
    assert sum(reaped) == 0, "a lease lapsed while the worker held it"
    assert executions == [1]
    attempts = [(a.attempt, a.outcome) for a in repo.attempts(task.id)]
    assert attempts == [(1, "succeeded")]
    with psycopg.connect(clean_database_url, autocommit=True) as conn:
        row = conn.execute("SELECT state FROM task_runs WHERE id = %s", (task.id,)).fetchone()
    assert row == ("SUCCEEDED",)
    wait_for(lambda: not sweeper.is_alive(), timeout=10, what="the reaper thread to end")
