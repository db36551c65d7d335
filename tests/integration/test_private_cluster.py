"""The private 3-node RabbitMQ cluster harness (``tests.harness.cluster``).

One cluster, on free ports in a fresh temporary directory, shared with the failover tests
(``rabbit_cluster``: tests/shared_cluster.py) and always stopped after the last of them. It
proves what failover tests rely on: all nodes run and are clustered, a quorum queue has a
replica on every node and a leader, a message confirmed by the queue survives a SIGKILL of the
leader's node and is consumed through another node (pika given every node's URL, the dead one
first), and a killed node restarts and rejoins. Nothing here contacts the
machine's broker (5672) or the dev services (26672).
"""

from __future__ import annotations

import time

import pika
import pytest
from pika.exceptions import AMQPError

from tests.harness.cluster import PrivateRabbitCluster
from tests.harness.services import DEFAULT_PORTS, ServiceError
from tests.shared_cluster import SIZE as SHARED_SIZE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SIZE = SHARED_SIZE
#: Seconds for the surviving members to elect a new leader and serve the queue again.
FAILOVER_TIMEOUT_S = 30.0
#: Seconds for the other nodes to notice a SIGKILLed node (its distribution socket closes).
NODEDOWN_TIMEOUT_S = 30.0
POLL_S = 0.2


@pytest.fixture
def healthy(rabbit_cluster: PrivateRabbitCluster) -> PrivateRabbitCluster:
    """The shared cluster (tests/shared_cluster.py) with every node running: a node a test
    left killed (here, or in tests/chaos/test_failover.py) is restarted."""
    for index, node in enumerate(rabbit_cluster.nodes):
        if not node.is_running():
            rabbit_cluster.restart(index)
    return rabbit_cluster


def _connect(urls: list[str]) -> pika.BlockingConnection:
    """A connection to the first of ``urls`` that accepts one (one attempt each)."""
    params = []
    for url in urls:
        param = pika.URLParameters(url)
        param.connection_attempts = 1
        param.socket_timeout = 5
        params.append(param)
    return pika.BlockingConnection(params)


def _declare_quorum_queue(url: str, queue: str) -> None:
    connection = _connect([url])
    try:
        connection.channel().queue_declare(
            queue,
            durable=True,
            arguments={"x-queue-type": "quorum", "x-quorum-initial-group-size": SIZE},
        )
    finally:
        connection.close()


def _publish_confirmed(url: str, queue: str, body: bytes) -> None:
    """Publish ``body`` to ``queue`` and return once the broker confirmed it (raises if not)."""
    connection = _connect([url])
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(
            "",
            queue,
            body,
            pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent),
            mandatory=True,
        )
    finally:
        connection.close()


def _get_one(urls: list[str], queue: str, timeout: float) -> bytes:
    """Poll ``basic_get`` through the first reachable of ``urls`` until a message arrives."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            connection = _connect(urls)
            try:
                channel = connection.channel()
                method, _props, body = channel.basic_get(queue)
                if method is not None:
                    channel.basic_ack(method.delivery_tag)
                    return body
            finally:
                if connection.is_open:
                    connection.close()
        except AMQPError as exc:  # e.g. the queue is still electing a leader
            last_error = exc
        time.sleep(POLL_S)
    raise AssertionError(f"no message on {queue} within {timeout}s (last error: {last_error!r})")


def _wait_running(cluster: PrivateRabbitCluster, expected: list[int]) -> None:
    deadline = time.monotonic() + NODEDOWN_TIMEOUT_S
    seen = cluster.running_nodes()
    while seen != expected:
        assert time.monotonic() < deadline, f"running nodes {seen}, expected {expected}"
        time.sleep(POLL_S)
        seen = cluster.running_nodes()


def _wait_new_leader(cluster: PrivateRabbitCluster, queue: str, dead: int) -> int:
    """The queue's leader once it is a node other than ``dead`` (bounded by the failover)."""
    deadline = time.monotonic() + FAILOVER_TIMEOUT_S
    while True:
        try:
            leader = cluster.leader(queue)
            if leader != dead:
                return leader
        except ServiceError:
            pass  # no leader reported during the election
        assert time.monotonic() < deadline, f"{queue}: no leader other than node {dead}"
        time.sleep(POLL_S)


def test_cluster_starts_with_every_node_running(healthy: PrivateRabbitCluster) -> None:
    cluster = healthy
    assert cluster.running_nodes() == list(range(SIZE))
    assert len(set(cluster.urls)) == SIZE
    assert all(node.is_running() for node in cluster.nodes)
    ports = {p for n in cluster.nodes for p in (n.amqp_port, n.dist_port)} | {cluster.epmd.port}
    assert len(ports) == 2 * SIZE + 1
    shared = {5672, 25672, 4369}  # the machine's broker: AMQP, distribution, epmd
    assert not ports & (shared | DEFAULT_PORTS), "a shared or dev port was used"


def test_quorum_queue_has_a_replica_on_every_node_and_a_leader(
    healthy: PrivateRabbitCluster,
) -> None:
    queue = "ff-cluster-replicas"
    _declare_quorum_queue(healthy.urls[0], queue)
    assert healthy.members(queue) == list(range(SIZE))
    assert healthy.leader(queue) in range(SIZE)


def test_confirmed_message_survives_sigkill_of_the_leader(healthy: PrivateRabbitCluster) -> None:
    queue = "ff-cluster-failover"
    body = b"confirmed before the leader died"
    _declare_quorum_queue(healthy.urls[0], queue)
    leader = healthy.leader(queue)
    _publish_confirmed(healthy.urls[leader], queue, body)

    healthy.kill(leader)

    assert not healthy.nodes[leader].is_running()
    others = [i for i in range(SIZE) if i != leader]
    assert _wait_new_leader(healthy, queue, leader) in others
    # the dead node's URL first: pika must fail over to the next one
    urls = [healthy.urls[leader]] + [healthy.urls[i] for i in others]
    assert _get_one(urls, queue, FAILOVER_TIMEOUT_S) == body


def test_killed_node_restarts_and_rejoins(healthy: PrivateRabbitCluster) -> None:
    queue = "ff-cluster-rejoin"
    body = b"published while node 0 was down"
    victim = 0  # the node the others joined: the hardest one to bring back
    _declare_quorum_queue(healthy.urls[1], queue)

    healthy.kill(victim)
    _wait_running(healthy, [1, 2])
    _publish_confirmed(healthy.urls[1], queue, body)

    started = time.monotonic()
    healthy.restart(victim)
    print(f"node {victim} restarted and rejoined in {time.monotonic() - started:.1f} s")

    assert healthy.running_nodes() == list(range(SIZE))
    assert healthy.members(queue) == list(range(SIZE))
    assert _get_one([healthy.urls[victim]], queue, FAILOVER_TIMEOUT_S) == body
