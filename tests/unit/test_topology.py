"""Connection parameters for a RabbitMQ cluster (pure: no broker needed)."""

from __future__ import annotations

from flowforge.broker.topology import connection_parameters, queue_arguments
from flowforge.config import BrokerConfig

NODES = tuple(f"amqp://guest:guest@127.0.0.1:{port}/%2F" for port in (5701, 5702, 5703))


def ports(config: BrokerConfig, start: int) -> list[int]:
    return [p.port for p in connection_parameters(config, start=start)]


def test_every_node_is_tried_once_starting_at_a_different_one_per_process() -> None:
    config = BrokerConfig(url=NODES)
    assert ports(config, 0) == [5701, 5702, 5703]
    assert ports(config, 1) == [5702, 5703, 5701]
    assert ports(config, 5) == [5703, 5701, 5702]
    assert {tuple(ports(config, s)) for s in range(3)} == {
        (5701, 5702, 5703),
        (5702, 5703, 5701),
        (5703, 5701, 5702),
    }


def test_one_node_is_always_first() -> None:
    assert ports(BrokerConfig(url=NODES[:1]), 7) == [5701]


def test_the_queue_is_quorum_with_the_configured_replication_factor() -> None:
    assert queue_arguments(BrokerConfig()) == {"x-queue-type": "quorum"}
    assert queue_arguments(BrokerConfig(quorum_initial_group_size=3)) == {
        "x-queue-type": "quorum",
        "x-quorum-initial-group-size": 3,
    }
