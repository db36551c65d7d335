"""``/metrics``: Prometheus text format.

Counters and histograms come from every process of the tree (``PROMETHEUS_MULTIPROC_DIR``);
gauges of the whole system (task runs by state, outbox backlog, live processes) are read from
PostgreSQL at scrape time, so every tree's api reports the same truth.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import falcon
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flowforge.domain.breakers import BreakerState, GateGauges, Waiting
from flowforge.errors import FlowForgeError
from flowforge.store.breakers import Gates
from flowforge.store.reads import Reads

FRESH_S = 15.0


class DatabaseCollector(Collector):
    """Gauges read from PostgreSQL on each scrape."""

    def __init__(self, reads: Reads, gates: Gates) -> None:
        self._reads = reads
        self._gates = gates

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("flowforge_database_up", "1 if PostgreSQL answered the scrape")
        try:
            states = self._reads.task_state_counts()
            outbox = self._reads.outbox_backlog()
            processes = self._reads.live_process_counts(FRESH_S)
            queues = self._reads.queue_loads(FRESH_S)
            gated = self._gates.gauges()
        except FlowForgeError:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        tasks = GaugeMetricFamily("flowforge_task_runs", "Task runs by state", labels=["state"])
        for state, n in sorted(states.items()):
            tasks.add_metric([state], n)
        yield tasks
        yield GaugeMetricFamily(
            "flowforge_outbox_pending", "Outbox rows not yet confirmed", value=outbox.pending
        )
        yield GaugeMetricFamily(
            "flowforge_outbox_oldest_pending_seconds",
            "Age of the oldest pending outbox row",
            value=outbox.oldest_s,
        )
        live = GaugeMetricFamily(
            "flowforge_processes", "Live registered processes", labels=["role"]
        )
        for role, n in sorted(processes.items()):
            live.add_metric([role], n)
        yield live
        ready = GaugeMetricFamily(
            "flowforge_queue_ready", "READY task runs per queue ('': on no queue)", labels=["queue"]
        )
        consumers = GaugeMetricFamily(
            "flowforge_queue_consumers", "Live workers consuming each queue", labels=["queue"]
        )
        for q in queues:
            ready.add_metric([q.queue or ""], q.ready)
            consumers.add_metric([q.queue or ""], q.consumers)
        yield ready
        yield consumers
        yield from _gate_metrics(gated)


#: ``flowforge_breaker_state``'s value per state (0 closed: the healthy one reads 0).
STATE_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
#: Most keyed breakers ``flowforge_breaker_state`` shows per scrape (the key is rendered from
#: run input: unbounded without this).
MAX_KEYED_SERIES = 100


def _gate_metrics(gated: GateGauges) -> Iterator[Metric]:
    """Each breaker's state (0 closed, 1 half-open, 2 open), its transitions into each state
    (a counter the database keeps: every tree's), and the tasks parked now by why.

    Keyed breakers (``circuit_breaker.key``) would make a series per rendered key, which the
    run input decides: the state gauge shows every handler-wide breaker (``key=""``) but only
    the keyed ones not closed (a key absent reads closed), at most
    :data:`MAX_KEYED_SERIES` of them (the rows come not-closed first, newest change first),
    and ``flowforge_breakers_keyed_not_closed{handler}`` counts them all; the transition
    counter is per handler, summed over its keys (those retention deleted included)."""
    state = GaugeMetricFamily(
        "flowforge_breaker_state",
        "Circuit breaker state per handler and key ('' the handler's own; keyed ones only when "
        "not closed): 0 closed, 1 half-open, 2 open",
        labels=["handler", "key"],
    )
    moved = CounterMetricFamily(
        "flowforge_breaker_transitions",
        "Circuit breaker transitions per handler (its keys' summed), by the state entered",
        labels=["handler", "to_state"],
    )
    keyed_open = GaugeMetricFamily(
        "flowforge_breakers_keyed_not_closed",
        "Keyed circuit breakers of a handler that are open or half-open",
        labels=["handler"],
    )
    totals = dict(gated.folded)  # keyed breakers retention deleted: their counts stay
    not_closed: dict[str, int] = {}
    shown = 0
    for gauge in gated.breakers:
        if not gauge.key:
            state.add_metric([gauge.handler, ""], STATE_VALUE[gauge.state])
        elif gauge.state is not BreakerState.CLOSED:
            not_closed[gauge.handler] = not_closed.get(gauge.handler, 0) + 1
            if shown < MAX_KEYED_SERIES:
                state.add_metric([gauge.handler, gauge.key], STATE_VALUE[gauge.state])
                shown += 1
        for target, n in gauge.transitions.items():
            totals[gauge.handler, target] = totals.get((gauge.handler, target), 0) + n
    for (handler, target), n in sorted(totals.items()):
        moved.add_metric([handler, str(target)], n)
    for handler, n in sorted(not_closed.items()):
        keyed_open.add_metric([handler], n)
    yield state
    yield moved
    yield keyed_open
    parked = GaugeMetricFamily(
        "flowforge_parked_tasks",
        "Tasks held back at their claim, by waiting_on (circuit_open, paused)",
        labels=["waiting_on"],
    )
    for why in Waiting:
        parked.add_metric([str(why)], gated.parked.get(str(why), 0))
    yield parked


class Metrics:
    def __init__(self, reads: Reads, gates: Gates) -> None:
        self._registry = CollectorRegistry()
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            multiprocess.MultiProcessCollector(self._registry)  # type: ignore[no-untyped-call]
        self._registry.register(DatabaseCollector(reads, gates))

    def on_get(self, _req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = CONTENT_TYPE_LATEST
        resp.data = generate_latest(self._registry)
