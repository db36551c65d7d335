"""The cost readings of the bench's harnesses (tests/harness/bench_cost.py) without a tree: how a
``/proc/<pid>/stat`` is read and how two readings become a cost per task."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import bench_cost, cpuprobe

#: A stat line whose command name holds a space and a closing parenthesis (fields 14 and 15,
#: utime and stime, are 250 and 50 ticks).
STAT = "4242 (my (odd) cmd) S 1 4242 4242 0 -1 4194304 500 0 0 0 250 50 0 0 20 0 3 0 100 0 0"


def test_cpu_of_a_stat_line_is_user_plus_system_counted_after_the_name() -> None:
    assert cpuprobe.stat_cpu_s(STAT, ticks=100) == 3.0


def test_cpu_of_a_stat_line_counts_the_reaped_children_too() -> None:
    # cutime and cstime (fields 16 and 17) 120 and 30 ticks: children that exited
    reaped = STAT.replace(" 250 50 0 0 ", " 250 50 120 30 ")
    assert cpuprobe.stat_cpu_s(reaped, ticks=100) == 4.5


def test_a_child_reaped_between_two_readings_counts_only_what_it_spent_between_them() -> None:
    # the root (1) spends 2 s; its child (2), 3 s old at the first reading, spends 1 s more and
    # exits: the root's reaped-children time grows by the child's whole life, 4 s
    before = {1: 10.0, 2: 3.0}
    after = {1: 10.0 + 2.0 + 4.0}
    assert cpuprobe.spent(before, after) == 3.0
    started = {1: 10.0 + 2.0 + 4.0, 3: 0.5}  # and one started meanwhile counts whole
    assert cpuprobe.spent(before, started) == 3.5


def test_a_truncated_stat_line_is_refused() -> None:
    with pytest.raises(IndexError):
        cpuprobe.stat_cpu_s("4242 (cmd) S 1 2", ticks=100)


def reading(trees: list[dict[int, float]], pg: dict[int, float], xid: int, lsn: int) -> Any:
    return bench_cost.Reading(trees, {"postgresql": pg, "rabbitmq": {9: 1.0}}, (xid, lsn))


def test_two_readings_give_each_groups_cpu_and_the_servers_counters_per_task() -> None:
    before = reading([{1: 1.0, 2: 2.0}], {5: 10.0}, 100, 8_000)
    after = reading([{1: 1.5, 2: 2.25, 3: 0.25}], {5: 10.5, 6: 0.5}, 300, 48_000)

    spent = bench_cost.cost(before, after)

    assert spent.trees_s == [1.0] and spent.services_s == {"postgresql": 1.0, "rabbitmq": 0.0}
    assert spent.total_s == 2.0
    assert spent.per_task(1000) == {
        "trees cpu ms": 1.0,
        "postgresql cpu ms": 1.0,
        "rabbitmq cpu ms": 0.0,
        "cpu ms": 2.0,
        "xacts": 0.2,
        "wal bytes": 40.0,
    }


class Probe:
    def __init__(self) -> None:
        self.readings = iter(
            [reading([{1: 0.0}], {5: 0.0}, 0, 0), reading([{1: 0.2}], {5: 0.3}, 10, 500)]
        )

    def read(self) -> Any:
        return next(self.readings)


def test_costed_reads_before_and_after_the_work_only() -> None:
    calls: list[str] = []
    probe: Any = Probe()
    result, per_task = bench_cost.costed(probe, 10, lambda: calls.append("work") or "done")
    assert result == "done" and calls == ["work"]
    assert per_task["cpu ms"] == pytest.approx(50.0) and per_task["wal bytes"] == 50.0


#: A /proc/net/tcp table: port 0x8F80 (36736) listening (0A), port 5672 (0x1628) established.
TCP = """  sl  local_address rem_address st tx_queue rx_queue tr tm->when retrnsmt uid timeout inode
   0: 0100007F:8F80 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1
   1: 0100007F:1628 0100007F:D2A4 01 00000000:00000000 00:00000000 00000000     0        0 222 1
   2: 00000000:1628 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 333 1
"""


def test_the_sockets_listening_on_a_port_are_found_by_their_inodes() -> None:
    assert cpuprobe.listening_socket_inodes(TCP, 0x8F80) == {"111"}
    assert cpuprobe.listening_socket_inodes(TCP, 5672) == {"333"}  # not the connected one
    assert cpuprobe.listening_socket_inodes(TCP, 1) == set()


@pytest.mark.parametrize(
    ("url", "port"),
    [
        ("amqp://guest:guest@127.0.0.1:36672/%2F", 36672),
        ("amqp://guest:guest@localhost/%2F", 5672),
        ("amqps://u:p@broker.example/vh", 5671),
    ],
)
def test_the_broker_port_is_the_urls_or_its_schemes_default(url: str, port: int) -> None:
    assert bench_cost.amqp_port(url) == port
