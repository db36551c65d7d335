"""CPU spent by sets of processes, read from ``/proc/<pid>/stat`` (user + system time), for the
bench's CPU-per-unit figures (``scripts/bench --trees``, ``bench_submit``'s CPU per run).

A reading is a ``{pid: seconds}`` snapshot; :func:`spent` is what the processes of the second
reading spent since the first. :class:`Probe` takes named groups of pids (each a function, so a
group can be found afresh — a child restarted meanwhile counts whole) and answers the CPU of each
group between :meth:`Probe.start` and :meth:`Probe.stop`. The kernel counts in clock ticks
(``SC_CLK_TCK``, 100 a second on Linux): a figure over fewer than a few hundred ticks is noise.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
#: The machine's service processes by ``comm``, and the service each belongs to.
SERVICE_PROCESSES = {"postgres": "postgresql", "beam.smp": "rabbitmq"}
Reading = dict[int, float]


def cpu_seconds(pids: Iterable[int]) -> Reading:
    """User + system CPU (s) of each of ``pids`` as /proc says now (a process gone is left
    out)."""
    found: Reading = {}
    for pid in pids:
        try:
            # the command name, in parentheses, may hold spaces: split after its last ")"
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        found[pid] = (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime
    return found


def spent(before: Mapping[int, float], after: Mapping[int, float]) -> float:
    """CPU (s) spent between two readings by the processes of the second: a process that
    started between them counts whole, one that ended between them is not seen."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


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
