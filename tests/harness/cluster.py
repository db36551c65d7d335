"""A private RabbitMQ 3.10 cluster for failover tests.

``PrivateRabbitCluster`` runs ``size`` :class:`~tests.harness.services.PrivateRabbitMQ`
nodes (``<prefix>-<pid>-<tag>-<i>@localhost``) on free 127.0.0.1 ports, in a directory of
its own under ``base_dir``. The nodes share one Erlang cookie made for this cluster (never
the machine's) and one private epmd on a free port, so neither a node nor ``rabbitmqctl``
can reach the machine's broker (5672) or the dev services (26672, ``flowforge-dev``), even
with a mistyped node name. Processes are only ever addressed by the pids the nodes
recorded. Every wait is bounded by a deadline and polls.

Measured on 2 cores: the nodes boot in parallel in 9-12 s and joining nodes 1 and 2 to
node 0 (one after the other: stop_app, join_cluster, start_app) takes about 5 s; ``kill``
takes about 0.1 s, a ``restart`` that rejoins 4-6 s, ``stop`` about 4 s.

    cluster = PrivateRabbitCluster(base_dir)
    cluster.start()
    try:
        urls = cluster.urls                   # one amqp:// URL per node
        cluster.kill(cluster.leader("q"))     # the quorum queue fails over
        ...
    finally:
        cluster.stop()
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import string
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from tests.harness.resources import free_ports
from tests.harness.services import (
    PrivateEpmd,
    PrivateRabbitMQ,
    ServiceError,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_SIZE = 3
DEFAULT_NAME_PREFIX = "ff-cluster"
COOKIE_LENGTH = 32
#: Seconds for every node to show up in ``cluster_status`` after start / restart.
CLUSTER_FORM_TIMEOUT_S = 90.0
#: Seconds for one ``rabbitmqctl`` call (its own start-up costs about a second).
CTL_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.2


class PrivateRabbitCluster:
    """``size`` private RabbitMQ nodes clustered with node 0; not thread-safe.

    Node ``i`` is ``self.nodes[i]`` (a ``PrivateRabbitMQ``: ``url``, ``pid``,
    ``rabbitmqctl``, ``log_dir``...). Everything lives in ``self.root``
    (``base_dir/<prefix>-<pid>-<tag>``), which ``stop()`` removes.
    """

    def __init__(
        self,
        base_dir: Path,
        size: int = DEFAULT_SIZE,
        *,
        consumer_timeout_ms: int | None = None,
        name_prefix: str = DEFAULT_NAME_PREFIX,
    ) -> None:
        """Describe the cluster and pick its free ports; nothing starts until ``start()``.

        ``base_dir`` must exist (or its parent must) and be searchable by the ``rabbitmq``
        account (e.g. mode 0755; pytest's tmp dirs are 0700). ``consumer_timeout_ms`` is
        every node's rabbitmq.conf ``consumer_timeout`` (None = broker default).
        """
        if size < 1:
            raise ValueError("a cluster needs at least one node")
        self.base_dir = Path(base_dir).absolute()
        self.name = f"{name_prefix}-{os.getpid()}-{secrets.token_hex(2)}"
        self.root = self.base_dir / self.name
        epmd_port, *node_ports = free_ports(1 + 2 * size)
        cookie = "".join(secrets.choice(string.ascii_uppercase) for _ in range(COOKIE_LENGTH))
        self.epmd = PrivateEpmd(epmd_port, self.root / "epmd.pid", self.root / "epmd.log")
        self.nodes = [
            PrivateRabbitMQ(
                self.root,
                node_ports[2 * i],
                node_ports[2 * i + 1],
                f"{self.name}-{i}",
                epmd_port=epmd_port,
                consumer_timeout_ms=consumer_timeout_ms,
                cookie=cookie,
                shared_epmd=True,
            )
            for i in range(size)
        ]
        self._created_root = False

    def __repr__(self) -> str:
        return f"PrivateRabbitCluster(name={self.name!r}, size={len(self.nodes)})"

    def __enter__(self) -> PrivateRabbitCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- public API ----------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """One AMQP URL per node (``guest``, default vhost), in node order."""
        return [node.url for node in self.nodes]

    def start(self) -> None:
        """Boot every node in parallel, join nodes 1.. to node 0, wait until all run.

        Idempotent: running nodes are left alone, clustered ones are not joined again.
        Bounded by the nodes' start timeout plus CLUSTER_FORM_TIMEOUT_S. On failure every
        node started so far is stopped again (files are kept for ``stop()``) and the error
        is raised. Raises ServiceUnavailable if rabbitmq-server is not installed.
        """
        started = time.monotonic()
        self.nodes[0].check_installed()  # ServiceUnavailable before anything is made
        if not self.root.exists():
            self.base_dir.mkdir(mode=0o755, exist_ok=True)  # kept: it may be shared
            self.root.mkdir()
            self.root.chmod(0o755)  # the rabbitmq account must be able to enter it
            self._created_root = True
        try:
            self.epmd.start()
            _in_parallel([node.start for node in self.nodes])
            booted = time.monotonic()
            clustered = set(self.running_nodes())  # fresh nodes: node 0 sees only itself
            for index in range(1, len(self.nodes)):
                if index not in clustered:
                    self._join(index)
            self._wait_running(range(len(self.nodes)))
        except BaseException:
            self._stop_processes()
            raise
        logger.info(
            "cluster %s: booted in %.1f s, clustered in %.1f s",
            self.name,
            booted - started,
            time.monotonic() - booted,
        )

    def stop(self, *, keep_files: bool = False) -> None:
        """Stop every node (gracefully, SIGKILL by pid as fallback) and the epmd; then
        remove ``self.root`` if this object created it, unless ``keep_files``. Idempotent."""
        self._stop_processes()
        if self._created_root and not keep_files:
            shutil.rmtree(self.root, ignore_errors=True)
            self._created_root = False

    def kill(self, index: int) -> None:
        """SIGKILL node ``index``'s beam.smp (its pid from its own pid file) and wait until
        it, its helper processes and its ports are gone. No-op if it is not running."""
        self.nodes[index].kill()

    def restart(self, index: int) -> None:
        """Boot node ``index`` again (after ``kill``) and wait until the cluster lists it
        as running: a node that was clustered rejoins from its own mnesia directory.

        Needs another node running: a node that was not the last of its cluster to go down
        waits at boot for its peers' tables (up to the node's start timeout).
        """
        self.nodes[index].start()
        self._wait_running([index])

    def running_nodes(self) -> list[int]:
        """Indexes of the nodes ``rabbitmqctl cluster_status`` reports running, as seen by
        the first node whose beam is alive; [] if none is."""
        viewer = self._viewer()
        if viewer is None:
            return []
        status = self._ctl_json(viewer, "cluster_status")
        names = status.get("running_nodes", []) if isinstance(status, dict) else []
        return sorted(self._index_of(name) for name in names if self._has_node(name))

    def leader(self, queue: str) -> int:
        """Index of the node leading quorum queue ``queue`` (default vhost).

        Raises ServiceError if the queue does not exist or has no known leader yet.
        """
        info = self._queue_info(queue)
        leader = info.get("leader")
        if not isinstance(leader, str) or not self._has_node(leader):
            raise ServiceError(f"quorum queue {queue!r} has no leader: {info}")
        return self._index_of(leader)

    def members(self, queue: str) -> list[int]:
        """Indexes of the nodes holding a replica of quorum queue ``queue`` (default vhost)."""
        members = self._queue_info(queue).get("members")
        if not isinstance(members, list):
            raise ServiceError(f"queue {queue!r} has no members (not a quorum queue?)")
        return sorted(self._index_of(name) for name in members if self._has_node(name))

    # -- internals ---------------------------------------------------------------------

    def _join(self, index: int) -> None:
        """Make node ``index`` (freshly booted, empty) a disc member of node 0's cluster."""
        node = self.nodes[index]
        node.rabbitmqctl("stop_app", timeout=CTL_TIMEOUT_S)
        node.rabbitmqctl("join_cluster", self.nodes[0].node, timeout=CTL_TIMEOUT_S)
        node.rabbitmqctl("start_app", timeout=CTL_TIMEOUT_S)

    def _wait_running(self, indexes: Sequence[int] | range) -> None:
        """Poll ``cluster_status`` until nodes ``indexes`` are all running, within
        CLUSTER_FORM_TIMEOUT_S; ServiceError (with the last view) otherwise."""
        wanted = set(indexes)
        deadline = time.monotonic() + CLUSTER_FORM_TIMEOUT_S
        seen: list[int] | str = []
        while True:
            try:
                seen = self.running_nodes()
                if wanted <= set(seen):
                    return
            except ServiceError as exc:  # e.g. the viewer is still (re)starting its app
                seen = str(exc)
            if time.monotonic() >= deadline:
                raise ServiceError(
                    f"cluster {self.name}: nodes {sorted(wanted)} not all running after "
                    f"{CLUSTER_FORM_TIMEOUT_S:.0f} s; last seen {seen}"
                )
            time.sleep(POLL_INTERVAL_S)

    def _queue_info(self, queue: str) -> dict[str, Any]:
        """``list_queues name leader members`` row of ``queue`` from a live node."""
        viewer = self._viewer()
        if viewer is None:
            raise ServiceError(f"cluster {self.name}: no node is running")
        rows = self._ctl_json(viewer, "list_queues", "name", "leader", "members")
        for row in rows if isinstance(rows, list) else []:
            if isinstance(row, dict) and row.get("name") == queue:
                return row
        raise ServiceError(f"queue {queue!r} not found on cluster {self.name}")

    def _viewer(self) -> PrivateRabbitMQ | None:
        """The first node whose beam is alive (it answers for the whole cluster)."""
        return next((node for node in self.nodes if node.is_running()), None)

    @staticmethod
    def _ctl_json(node: PrivateRabbitMQ, *args: str) -> Any:
        """``rabbitmqctl -n node <args> --formatter json -q`` decoded."""
        out = node.rabbitmqctl(*args, "--formatter", "json", "-q", timeout=CTL_TIMEOUT_S)
        try:
            return json.loads(out)
        except ValueError:
            raise ServiceError(f"rabbitmqctl {args[0]}: not JSON: {out[:200]!r}") from None

    def _has_node(self, name: str) -> bool:
        return any(node.node == name for node in self.nodes)

    def _index_of(self, name: str) -> int:
        return next(i for i, node in enumerate(self.nodes) if node.node == name)

    def _stop_processes(self) -> None:
        """Stop every node in parallel, then the epmd; the first error is raised last."""
        try:
            _in_parallel([node.stop for node in self.nodes])
        finally:
            self.epmd.stop()


def _in_parallel(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Run ``calls`` in threads, wait for all; re-raise the first exception (in order)."""
    with ThreadPoolExecutor(max_workers=max(1, len(calls))) as pool:
        futures = [pool.submit(call) for call in calls]
        errors = [error for error in (f.exception() for f in futures) if error is not None]
    if errors:
        for error in errors[1:]:
            logger.error("also failed in parallel: %s", error)
        raise errors[0]
    return [f.result() for f in futures]
