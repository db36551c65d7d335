"""One private 3-node RabbitMQ cluster for every test that asks for ``rabbit_cluster``.

tests/integration/test_private_cluster.py (the harness itself) and tests/chaos/test_failover.py
(trees failing over) need the same cluster: three nodes of
:class:`~tests.harness.cluster.PrivateRabbitCluster` with the broker's defaults. Each booted
its own (about 30 s each on 2 cores, in CI's serial pass); now the first of them boots it and
the others reuse it. ``tests/conftest.py`` runs the tests that use it one after another
(:func:`group_users`) and stops it after the last (:func:`last_user`), so it does not idle
beside the tests that follow; a later user (under xdist, or a test selected apart) boots it
again.

Each test leaves the cluster as it found it or its fixture restores it first: a killed node is
restarted (``healthy`` in test_private_cluster, ``services`` in test_failover), and each test
declares queues of its own name, never one another test reads.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.harness.cluster import PrivateRabbitCluster
from tests.harness.services import ServiceUnavailable

#: The fixture's name: a test uses the shared cluster when it (or a fixture it uses) asks.
FIXTURE = "rabbit_cluster"
SIZE = 3


class SharedCluster:
    """The cluster, booted on first :meth:`get` and stopped by :meth:`stop` (idempotent)."""

    def __init__(self) -> None:
        self._cluster: PrivateRabbitCluster | None = None
        self._base_dir: Path | None = None
        self._failure: BaseException | None = None

    def get(self) -> PrivateRabbitCluster:
        """The running cluster (booting it now if none runs). A boot that failed fails every
        later ``get`` of the same run with the same error instead of booting again."""
        if self._failure is not None:
            raise self._failure
        if self._cluster is None:
            base_dir = Path(tempfile.mkdtemp(prefix="ff-cluster-"))
            base_dir.chmod(0o755)  # mkdtemp makes 0700: the rabbitmq account could not enter
            cluster = PrivateRabbitCluster(base_dir, SIZE)
            try:
                cluster.start()
            except ServiceUnavailable as exc:
                # imported here: tests.chaos.support imports tests/conftest.py, which imports us
                from tests.chaos.support import unavailable

                _remove(cluster, base_dir)
                unavailable(str(exc))
            except BaseException as exc:
                _remove(cluster, base_dir)
                self._failure = exc
                raise
            self._cluster, self._base_dir = cluster, base_dir
        return self._cluster

    def stop(self) -> None:
        """Stop the cluster and remove its files, if one runs."""
        cluster, base_dir = self._cluster, self._base_dir
        self._cluster = self._base_dir = None
        if cluster is not None and base_dir is not None:
            _remove(cluster, base_dir)


def _remove(cluster: PrivateRabbitCluster, base_dir: Path) -> None:
    try:
        cluster.stop()
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)


def uses(item: pytest.Item | None) -> bool:
    """Whether ``item`` uses the shared cluster (directly or through its fixtures)."""
    return item is not None and FIXTURE in getattr(item, "fixturenames", ())


def group_users(items: Sequence[pytest.Item]) -> list[pytest.Item]:
    """``items`` with the cluster's users moved up to the first one, in their own order, so
    that they run one after another and the cluster boots once; the rest keep their order."""
    users = [item for item in items if uses(item)]
    if not users:
        return list(items)
    grouped: list[pytest.Item] = []
    for item in items:
        if item is users[0]:
            grouped.extend(users)
        elif not uses(item):
            grouped.append(item)
    return grouped


def last_user(item: pytest.Item, nextitem: pytest.Item | None) -> bool:
    """Whether ``item`` is the last user of a run of users (the cluster can stop after it)."""
    return uses(item) and not uses(nextitem)
