"""CPU spent by sets of processes, read from ``/proc/<pid>/stat`` (user + system time), for the
bench's CPU-per-unit figures (``scripts/bench --trees``, ``bench_submit``'s CPU per run).

A reading is a ``{pid: seconds}`` snapshot; :func:`spent` is what the processes of the second
reading spent since the first. :class:`Probe` takes named groups of pids (each a function, so a
group can be found afresh — a child restarted meanwhile counts whole) and answers the CPU of each
group between :meth:`Probe.start` and :meth:`Probe.stop`. The kernel counts in clock ticks
(``SC_CLK_TCK``, 100 a second on Linux): a figure over fewer than a few hundred ticks is noise.

Finding the processes: :func:`service_pids` (every PostgreSQL and RabbitMQ process on the
machine), :func:`backends` (one database's backends), :func:`server_pids` (every process of the
PostgreSQL server a connection is on), :func:`listener_pid` (the process listening on a port,
e.g. a private RabbitMQ node) and :func:`process_tree` (a process and all under it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import psycopg

from tests.harness.resources import child_pids

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
#: The machine's service processes by ``comm``, and the service each belongs to.
SERVICE_PROCESSES = {"postgres": "postgresql", "beam.smp": "rabbitmq"}
Reading = dict[int, float]


def stat_user_system_s(stat: str, ticks: int = TICKS_PER_S) -> tuple[float, float]:
    """User and system CPU (s) in the text of a ``/proc/<pid>/stat`` (or of a thread's,
    ``/proc/<pid>/task/<tid>/stat``): fields 14 and 15, counted after the command name's
    closing parenthesis (the name may hold spaces and parentheses)."""
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def stat_cpu_s(stat: str, ticks: int = TICKS_PER_S) -> float:
    """User + system CPU (s) in the text of a ``/proc/<pid>/stat``, its own and its reaped
    children's (fields 16 and 17, cutime and cstime). Every group read here is a root and its
    descendants (a tree, a PostgreSQL server, a RabbitMQ node), so a child that exits between
    two readings — a backend of a pool drained by store/plansize.py, a restarted worker — is
    still counted, through its parent, once: alive its own time counts, reaped its parent's
    cutime holds it, never both."""
    fields = stat.rsplit(")", 1)[1].split()
    own = sum(stat_user_system_s(stat, ticks))
    return own + (int(fields[13]) + int(fields[14])) / ticks


def cpu_seconds(pids: Iterable[int]) -> Reading:
    """User + system CPU (s) of each of ``pids`` as /proc says now (a process gone is left
    out)."""
    found: Reading = {}
    for pid in pids:
        try:
            found[pid] = stat_cpu_s(Path(f"/proc/{pid}/stat").read_text())
        except (OSError, IndexError, ValueError):
            continue
    return found


def spent(before: Mapping[int, float], after: Mapping[int, float]) -> float:
    """CPU (s) spent between two readings by a group of processes whose parents are in it too
    (a root and its descendants; :func:`stat_cpu_s`): a process that started between them
    counts whole. One that ended between them was reaped by its parent, whose reaped-children
    time now holds its whole life, so what it had spent by the first reading (its reading
    then) is taken off again: counted whole, a drained pool's backend that had lived since the
    tree started would add its past to the window."""
    grown = sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())
    return grown - sum(cpu for pid, cpu in before.items() if pid not in after)


def service_pids() -> dict[str, list[int]]:
    """The pids of the machine's PostgreSQL and RabbitMQ processes, by service."""
    found: dict[str, list[int]] = {name: [] for name in SERVICE_PROCESSES.values()}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        service = SERVICE_PROCESSES.get(comm)
        if service is not None:
            found[service].append(int(entry.name))
    return found


def backends(database: str) -> list[int]:
    """The pids of the PostgreSQL backends connected to ``database`` now (by their process
    title, ``postgres: [CLUSTER: ]USER DATABASE HOST(PORT) STATE``): a database's own share of a
    server that other databases use too (its background writers left out)."""
    found = []
    for pid in service_pids()["postgresql"]:
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            title = raw.decode(errors="replace").split()
        except OSError:
            continue
        if title[:1] == ["postgres:"] and database in title[1:4]:
            found.append(pid)
    return found


def services() -> dict[str, Callable[[], list[int]]]:
    """The groups of :func:`service_pids`, for a :class:`Probe`."""

    def of(service: str) -> Callable[[], list[int]]:
        return lambda: service_pids()[service]

    return {name: of(name) for name in SERVICE_PROCESSES.values()}


class Probe:
    """CPU of named groups of processes between :meth:`start` and :meth:`stop`.

    ``groups`` maps a name to a function that lists the group's pids now; it is called at both
    readings, and a pid listed only at the second counts whole (it started meanwhile). A pid in
    two groups is counted in each.
    """

    def __init__(self, groups: Mapping[str, Callable[[], Iterable[int]]]) -> None:
        self._groups = dict(groups)
        self._before: dict[str, Reading] = {}

    def read(self) -> dict[str, Reading]:
        """Every group's reading now."""
        return {name: cpu_seconds(pids()) for name, pids in self._groups.items()}

    def start(self) -> None:
        self._before = self.read()

    def stop(self) -> dict[str, float]:
        """CPU (s) each group spent since :meth:`start`."""
        after = self.read()
        return {name: spent(self._before.get(name, {}), now) for name, now in after.items()}


def listening_socket_inodes(table: str, port: int) -> set[str]:
    """The inodes of the sockets listening on ``port`` in the text of a ``/proc/net/tcp``
    (or ``tcp6``) table: local address ``hex_ip:hex_port``, state ``0A`` (LISTEN)."""
    found = set()
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
            found.add(fields[9])
    return found


def listener_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` on this machine (one it can see), or None."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            inodes |= listening_socket_inodes(Path(table).read_text(), port)
        except OSError:
            continue
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not wanted:
            continue
        try:
            if any(os.readlink(fd) in wanted for fd in (entry / "fd").iterdir()):
                return int(entry.name)
        except OSError:
            continue
    return None


def server_pids(conn: psycopg.Connection[Any]) -> list[int]:
    """Every process of the PostgreSQL server ``conn`` is connected to: its postmaster (the
    parent of ``conn``'s backend) and the postmaster's children, as they are now."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    status = Path(f"/proc/{row[0]}/status").read_text()
    postmaster = int(status.split("PPid:", 1)[1].split()[0])
    return process_tree(postmaster)


def process_tree(pid: int | None) -> list[int]:
    """``pid`` (a tree's supervisor) and every process under it; none for None."""
    if pid is None:
        return []
    return [pid, *child_pids(pid, recursive=True)]


def server_counters(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """(transaction ids assigned so far, WAL position in bytes), both the server's: the writing
    transactions and WAL of every database on it."""
    row = conn.execute(
        "SELECT pg_current_xact_id()::text::bigint, pg_current_wal_lsn() - '0/0'::pg_lsn"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])
