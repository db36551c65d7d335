"""The process tree under fire: real ``flowforge up`` processes, and generic supervisor trees.

SPEC §4. Children are SIGKILLed while work is in flight and the batch still succeeds with each
handler executed once per attempt; a child killed while logging wedges no sibling and tears no
line; boot failures and crash loops stop the tree with codes 3 and 4; SIGTERM drains, SIGKILL
of the supervisor leaves no orphan; the supervisor is a correct PID 1; hung children are
replaced; SIGTTIN/SIGTTOU scale, ``max_tasks_per_child`` recycles, SIGHUP rolls; two trees
share one database and one queue.

``flowforge up`` runs as a subprocess (:class:`Tree`). Generic trees come from
``tests/chaos/supervisor_targets.py``, also in a process of their own (:class:`GenericTree`):
a supervisor's ``waitpid(-1)`` inside pytest would reap pytest's other children. Processes are
found through ``/proc/<pid>/task/*/children`` and their titles. Everything started is stopped
by pid, with deadlines, and any child still alive at the end is SIGKILLed by pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
import pytest

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.policy import Jitter, RetryPolicy
from supervisor import exitcodes
from tests.chaos import supervisor_targets as targets
from tests.e2e import REPO, Stack
from tests.helpers import wait_for
from tests.store import Store

pytestmark = pytest.mark.chaos

Sql = psycopg.Connection[tuple[Any, ...]]

#: Retries without delay: a task whose worker was killed runs again as soon as it is reaped.
RETRY = RetryPolicy(max_attempts=5, base_delay=0.0, max_delay=0.0, jitter=Jitter.NONE)
RECORD = WorkflowDef("sup-record", (TaskDef("only", "e2e.record", retry=RETRY),))
SLEEP = WorkflowDef("sup-sleep", (TaskDef("only", "e2e.sleep", retry=RETRY),))
CHAIN = WorkflowDef(
    "sup-chain",
    (
        TaskDef("nap", "e2e.sleep", retry=RETRY),
        TaskDef("note", "e2e.record", depends_on=("nap",), retry=RETRY),
    ),
)

#: Short settings for every tree (merged under each test's own).
SETTINGS: dict[str, dict[str, Any]] = {
    "worker": {"lease_s": 2.0, "heartbeat_s": 0.5, "key_wait_s": 0.2},
    "scheduler": {"poll_interval_s": 0.2},
    "processes": {
        "workers": 2,
        "drain_timeout_s": 10.0,
        "liveness_timeout_s": 10.0,
        "restart_limit": 30,
        "restart_period_s": 60.0,
    },
    "logging": {"format": "json", "level": "INFO"},
}
#: A tree must be ready within this (seconds).
READY_S = 30.0
#: A killed child must be replaced within this (seconds).
REPLACED_S = 15.0
#: A batch must finish within this (seconds).
BATCH_S = 60.0
#: Children must be gone this long after their supervisor was SIGKILLed (seconds).
ORPHAN_S = 5.0
#: SIGTERM, then SIGKILL after this, when a test ends with its tree still running (seconds).
STOP_S = 15.0
POLL_S = 0.05
#: How often the logging child is SIGKILLed ...
KILLS = 8
#: ... after logging this many lines; its siblings must log as many again after each kill.
BURST = 200


# ------------------------------------------------------------------ processes, seen in /proc


def children_of(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(c) for c in (task / "children").read_text().split()]
    return found


def proc_state(pid: int) -> str | None:
    """The state letter of ``pid`` (``Z`` for a zombie), None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def alive(pid: int) -> bool:
    state = proc_state(pid)
    return state is not None and state != "Z"


def title_of(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def live_children(pid: int) -> dict[int, str]:
    """Children of ``pid`` that run (not zombies), with their titles."""
    return {c: title_of(c) for c in children_of(pid) if alive(c)}


def ns_pids(pid: int) -> list[int]:
    """``pid`` in each PID namespace it belongs to, outermost first (``NSpid``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(p) for p in line.split()[1:]]
    return [pid]


def signals_of(pid: int, field: str) -> set[int]:
    """The signals of a ``/proc/<pid>/status`` mask (``SigBlk``: blocked, ``SigCgt``: with a
    handler); none once ``pid`` is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return set()
    mask = next(
        int(line.split()[1], 16) for line in status.splitlines() if line.startswith(f"{field}:")
    )
    return {bit + 1 for bit in range(64) if mask >> bit & 1}


def runs_python(pid: int) -> bool:
    """Whether ``pid`` has exec'd this interpreter (its argv[0] is ``sys.executable``).

    Before that, the child of ``unshare --fork`` is unshare: already PID 1 of the new
    namespace, it shows SIGINT and SIGTERM blocked (unshare blocks them around its fork) until it
    unblocks them just before its exec, and a SIGTERM pending then meets a PID 1's default
    action and is dropped. That mask is unshare's, not flowforge's: read a mask only after this
    returned True (the exec keeps the mask, so it is the interpreter's from then on).
    """
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:
        return False
    return argv0 == os.fsencode(sys.executable)


def _kill(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        done = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "true"],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
needs_unshare = pytest.mark.skipif(
    not _unshare_works(), reason="unshare --pid --fork --mount-proc does not work here"
)


class _Process:
    """A supervisor subprocess (optionally PID 1 of a new PID namespace) and what it started."""

    prefix = "flowforge"

    def __init__(self, proc: subprocess.Popen[bytes], pid_namespace: bool) -> None:
        self.proc = proc
        self.pid_namespace = pid_namespace
        self._supervisor: int | None = None
        self.seen: dict[int, str] = {}  # every child seen, for the final clean-up

    @property
    def supervisor_pid(self) -> int:
        """The supervisor's pid as seen from here (in a namespace: the child of unshare)."""
        if self._supervisor is None:
            if not self.pid_namespace:
                self._supervisor = self.proc.pid
            else:
                self._supervisor = wait_for(
                    lambda: next(iter(children_of(self.proc.pid)), None),
                    timeout=10,
                    what="unshare to fork the supervisor",
                )
        return self._supervisor

    def running(self) -> bool:
        return self.proc.poll() is None

    def output_tail(self) -> str:
        return ""

    def assert_running(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise AssertionError(f"the supervisor exited with {code}:\n{self.output_tail()}")

    def children(self) -> dict[int, str]:
        found = live_children(self.supervisor_pid)
        self.seen.update(found)
        return found

    def pids(self, name: str) -> list[int]:
        """Live children titled ``<prefix>: <name>…``, by pid."""
        head = f"{self.prefix}: {name}"
        return sorted(p for p, t in self.children().items() if t.startswith(head))

    def signal(self, signum: int) -> None:
        if self.running():
            _kill(self.supervisor_pid, signum)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """SIGTERM, SIGKILL after :data:`STOP_S`; then SIGKILL any child of ours still alive."""
        if self.running():
            self.children()
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                _kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(STOP_S)
        for pid, title in self.seen.items():
            if alive(pid) and title_of(pid) == title:
                _kill(pid, signal.SIGKILL)


class Tree(_Process):
    """``flowforge -c CONFIG up`` with its output (JSON log lines) in a file."""

    def __init__(
        self,
        config: Path,
        env: dict[str, str],
        log: Path,
        pid_namespace: bool,
        entry: tuple[str, ...] = (),
    ) -> None:
        self.log_path = log
        self._log = log.open("ab")
        # entry: what execs the interpreter (the image's entrypoint is `env --block-signal=…`)
        command = [*entry, sys.executable, "-m", "flowforge.cli", "-c", str(config), "up"]
        proc = subprocess.Popen(
            [*UNSHARE, *command] if pid_namespace else command,
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        super().__init__(proc, pid_namespace)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def output_tail(self) -> str:
        return "\n".join(self.text().splitlines()[-40:])

    def events(self) -> list[dict[str, Any]]:
        found = []
        for line in self.text().splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    found.append(json.loads(line))
        return found

    def supervisor_events(self, action: str | None = None) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events()
            if e.get("role") == "supervisor" and (action is None or e.get("action") == action)
        ]

    def wait_ready(self, times: int = 1, timeout: float = READY_S) -> None:
        wait_for(
            lambda: len(self.supervisor_events("tree_ready")) >= times or not self.running(),
            timeout=timeout,
            interval=POLL_S,
            what="the tree to be ready",
        )
        self.assert_running()

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self._log.close()


class GenericTree(_Process):
    """A scenario of ``supervisor_targets`` with stderr read line by line as it comes.

    Every line must be JSON. Chatty children's lines are checked as they arrive (payload
    intact, numbered without gaps per pid) and only counted; other lines are kept.
    """

    def __init__(self, scenario: str, pid_namespace: bool = False) -> None:
        self.prefix = f"svtest-{uuid.uuid4().hex[:8]}"
        command = [sys.executable, "-m", "tests.chaos.supervisor_targets", scenario, self.prefix]
        proc = subprocess.Popen(
            [*UNSHARE, *command] if pid_namespace else command,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        super().__init__(proc, pid_namespace)
        self.lock = threading.Lock()
        self.lines: list[dict[str, Any]] = []  # non-chatter lines
        self.bad: list[bytes] = []  # lines that did not parse or whose payload was wrong
        self.chatter: Counter[int] = Counter()  # lines per chatty pid
        self._last_seq: dict[int, int] = {}
        self.total = 0
        self._reader = threading.Thread(target=self._read, name="tree-stderr", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        pending = b""
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            pending += chunk
            *complete, pending = pending.split(b"\n")
            with self.lock:
                for line in complete:
                    self._take(line)
        if pending:
            with self.lock:
                self.bad.append(b"unterminated: " + pending[:200])

    def _take(self, line: bytes) -> None:
        self.total += 1
        try:
            data = json.loads(line)
        except ValueError:
            self.bad.append(line[:300])
            return
        if not isinstance(data, dict):
            self.bad.append(line[:300])
            return
        if data.get("msg") != targets.CHATTER:
            self.lines.append(data)
            return
        pid, seq = data.get("pid"), data.get("seq")
        if not isinstance(pid, int) or not isinstance(seq, int):
            self.bad.append(line[:300])
            return
        if data.get("payload") != targets.payload(pid, seq, data.get("size", -1)):
            self.bad.append(b"payload mismatch: " + line[:300])
        if seq != self._last_seq.get(pid, 0) + 1:
            self.bad.append(f"pid {pid}: line {seq} after {self._last_seq.get(pid)}".encode())
        self._last_seq[pid] = seq
        self.chatter[pid] += 1

    def output_tail(self) -> str:
        with self.lock:
            return "\n".join(b.decode(errors="replace") for b in self.bad[-40:])

    def count(self, pid: int) -> int:
        with self.lock:
            return self.chatter[pid]

    def logged(self, action: str) -> list[dict[str, Any]]:
        with self.lock:
            return [e for e in self.lines if e.get("action") == action]

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self._reader.join(STOP_S)
            if self.proc.stderr is not None:
                self.proc.stderr.close()

    def finish(self, timeout: float = STOP_S) -> int:
        """SIGTERM the tree and wait for it and for the end of its output; its exit code."""
        self.signal(signal.SIGTERM)
        code = self.wait(timeout)
        self._reader.join(timeout)
        assert not self._reader.is_alive(), "the tree's stderr never reached end of file"
        return code


# ------------------------------------------------------------------ fixtures and helpers


def write_config(stack: Stack, **overrides: Any) -> Path:
    """:data:`SETTINGS` with ``overrides`` merged per section, written to a file of its own."""
    merged: dict[str, Any] = {k: dict(v) for k, v in SETTINGS.items()}
    for key, value in overrides.items():
        merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
    path = stack.config_path(**merged)
    return path.replace(path.with_name(f"up-{uuid.uuid4().hex[:8]}.yaml"))


@pytest.fixture
def up(stack: Stack, tmp_path: Path) -> Iterator[Callable[..., Tree]]:
    """Start ``flowforge up`` trees; every one still running at the end is stopped."""
    started: list[Tree] = []

    def start(config: Path, pid_namespace: bool = False, entry: tuple[str, ...] = ()) -> Tree:
        log = tmp_path / f"tree-{len(started)}.log"
        tree = Tree(config, stack.env(), log, pid_namespace, entry)
        started.append(tree)
        return tree

    yield start
    for tree in started:
        tree.stop()


@pytest.fixture
def generic() -> Iterator[Callable[..., GenericTree]]:
    """Start generic supervisor trees; every one still running at the end is stopped."""
    started: list[GenericTree] = []

    def start(scenario: str, pid_namespace: bool = False) -> GenericTree:
        tree = GenericTree(scenario, pid_namespace)
        started.append(tree)
        return tree

    yield start
    for tree in started:
        tree.stop()


def trigger(repo: Store, workflow: WorkflowDef, count: int, **run_input: Any) -> list[UUID]:
    return [repo.trigger(workflow, {"i": i, **run_input}).run_id for i in range(count)]


def wait_succeeded(sql: Sql, run_ids: list[UUID], timeout: float = BATCH_S) -> None:
    last: dict[str, int] = {}

    def done() -> bool:
        rows = sql.execute(
            "SELECT state, count(*) FROM workflow_runs WHERE id = ANY(%s) GROUP BY state",
            (run_ids,),
        ).fetchall()
        last.clear()
        last.update({str(s): int(n) for s, n in rows})
        return last.get("SUCCEEDED") == len(run_ids)

    try:
        wait_for(done, timeout=timeout, interval=0.1, what=f"{len(run_ids)} runs to succeed")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; run states now: {last}") from None


def assert_once_per_final_attempt(sql: Sql, run_ids: list[UUID]) -> dict[UUID, int]:
    """Every task SUCCEEDED; it has exactly one execution in its final attempt, none twice
    within one attempt and none in a later attempt. Returns each task's final attempt."""
    tasks = sql.execute(
        "SELECT id, state, attempt FROM task_runs WHERE run_id = ANY(%s)", (run_ids,)
    ).fetchall()
    executions = Counter(
        (UUID(str(t)), int(a))
        for t, a in sql.execute(
            "SELECT task_run_id, attempt FROM test_executions WHERE run_id = ANY(%s)", (run_ids,)
        ).fetchall()
    )
    assert tasks, "no task runs found"
    final = {UUID(str(t)): int(a) for t, _, a in tasks}
    not_succeeded = {str(t): s for t, s, _ in tasks if s != "SUCCEEDED"}
    assert not not_succeeded, f"tasks not SUCCEEDED: {not_succeeded}"
    twice = {k: n for k, n in executions.items() if n > 1}
    assert not twice, f"executed more than once within one attempt: {twice}"
    missing = [t for t, a in final.items() if executions[(t, a)] != 1]
    assert not missing, f"tasks without an execution in their final attempt: {missing}"
    later = [k for k in executions if k[1] > final[k[0]]]
    assert not later, f"executions in an attempt after the final one: {later}"
    return final


def assert_exactly_once(sql: Sql, run_ids: list[UUID]) -> None:
    """Every task SUCCEEDED in its first attempt with exactly one execution."""
    final = assert_once_per_final_attempt(sql, run_ids)
    retried = {str(t): a for t, a in final.items() if a != 1}
    assert not retried, f"tasks that needed more than one attempt: {retried}"
    executions = sql.execute(
        "SELECT count(*) FROM test_executions WHERE run_id = ANY(%s)", (run_ids,)
    ).fetchone()
    assert executions == (len(final),)


def in_flight(sql: Sql, pids: list[int] | None = None) -> list[tuple[int, UUID, int]]:
    """(pid, task run, attempt) of handlers running right now (in one of ``pids``), the most
    recently started first. Pids are as the handler saw them (inside its PID namespace)."""
    rows = sql.execute(
        "SELECT e.pid, e.task_run_id, e.attempt FROM test_executions e"
        " JOIN task_runs t ON t.id = e.task_run_id AND t.attempt = e.attempt"
        " WHERE t.state = 'RUNNING' AND (%(pids)s::int[] IS NULL OR e.pid = ANY(%(pids)s))"
        " ORDER BY e.id DESC",
        {"pids": pids},
    ).fetchall()
    return [(int(p), UUID(str(t)), int(a)) for p, t, a in rows]


def wait_replaced(tree: _Process, name: str, old: int, timeout: float = REPLACED_S) -> int:
    """Wait until ``old`` is gone and a child titled exactly like it runs; its pid."""
    title = tree.seen.get(old) or title_of(old)
    assert title, f"no title known for pid {old}"

    def replaced() -> int | None:
        tree.assert_running()
        fresh = [p for p, t in tree.children().items() if t == title and p != old]
        return fresh[0] if fresh and not alive(old) else None

    return wait_for(replaced, timeout=timeout, interval=POLL_S, what=f"{title!r} to be replaced")


def successor_of(msgs: list[str], pid: int) -> tuple[int, int]:
    """(index, pid) of the first "started <label> (pid N)" after the start of ``pid`` with the
    same label (the same slot), in the supervisor's messages ``msgs``."""
    starts = [
        (i, found.group(1), int(found.group(2)))
        for i, m in enumerate(msgs)
        if (found := re.fullmatch(r"started (\S+) \(pid (\d+)\)", m))
    ]
    (mine,) = [(i, label) for i, label, p in starts if p == pid]
    later = [(i, p) for i, label, p in starts if label == mine[1] and i > mine[0]]
    assert later, f"no successor of pid {pid} was started: {msgs}"
    return later[0]


def worker_titles(tree: Tree) -> list[str]:
    return sorted(t for t in tree.children().values() if t.startswith("flowforge: worker"))


# ------------------------------------------------------------------ config and boot failures


@pytest.mark.parametrize(
    "bad",
    [
        {"processes": {"workers": 0}},
        {"processes": {"restart_limit": "many"}},
        {"no_such_section": {"x": 1}},
    ],
)
def test_up_with_a_bad_config_exits_2_with_one_line_on_stderr(
    tmp_path: Path, bad: dict[str, Any]
) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(json.dumps(bad))  # JSON is YAML
    done = subprocess.run(
        [sys.executable, "-m", "flowforge.cli", "-c", str(config), "up"],
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("FLOWFORGE_")},
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == exitcodes.USAGE, done
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("flowforge: ") and "bad.yaml" in lines[0], lines
    assert b"flowforge up:" not in done.stdout  # nothing was started


def test_a_role_that_cannot_boot_stops_the_tree_with_3_at_once(
    stack: Stack, up: Callable[..., Tree]
) -> None:
    started = time.monotonic()
    tree = up(write_config(stack, handlers=["tests.no_such_handler_module_for_up"]))
    code = tree.wait(30)
    elapsed = time.monotonic() - started
    assert code == exitcodes.BOOT_FAILED, tree.text()
    assert elapsed < 15, f"took {elapsed:.1f}s to give up"
    events = tree.supervisor_events()
    assert any(e.get("action") == "boot_failed" for e in events), tree.text()
    starts = [e["msg"] for e in events if e.get("action") == "child_started"]
    # No storm: every child was started once and none was restarted.
    workers = SETTINGS["processes"]["workers"]
    assert len([m for m in starts if "worker" in m]) == workers, starts
    assert len(starts) == workers + 2, starts
    assert not [e["msg"] for e in events if e.get("action") == "child_died"]


def test_a_child_that_keeps_crashing_trips_the_restart_limit_with_4(
    stack: Stack, up: Callable[..., Tree]
) -> None:
    module = f"crash_on_import_{uuid.uuid4().hex[:8]}"  # found next to the config file
    (stack.directory / f"{module}.py").write_text("import os\n\nos._exit(1)  # not a boot error\n")
    limit = 3
    started = time.monotonic()
    tree = up(
        write_config(
            stack,
            handlers=[module],
            processes={"workers": 1, "restart_limit": limit, "restart_period_s": 60.0},
        )
    )
    code = tree.wait(60)
    elapsed = time.monotonic() - started
    assert code == exitcodes.RESTART_LIMIT, tree.text()
    events = tree.supervisor_events()
    worker_starts = [
        e for e in events if e.get("action") == "child_started" and "worker" in e["msg"]
    ]
    died = [e["msg"] for e in events if e.get("action") == "child_died"]
    # limit + 1 crashes: the first `limit` are restarted after 0.5, 1 and 2 s, the next trips.
    assert len(worker_starts) == limit + 1, [e["msg"] for e in worker_starts]
    assert [m.rsplit("restarting in ", 1)[-1] for m in died] == ["0.5s", "1.0s", "2.0s"], died
    assert all("exited with code 1" in m for m in died), died
    tripped = [e for e in events if e.get("action") == "restart_limit"]
    assert len(tripped) == 1, tree.text()
    window = tripped[0]["ts"] - worker_starts[0]["ts"]
    assert 3.5 <= window < 20, f"the limit tripped {window:.1f}s after the first start"
    assert elapsed < 30


# ------------------------------------------------------------------ SIGKILL of children


@pytest.mark.slow
def test_each_kind_of_child_sigkilled_in_flight_is_restarted_and_the_batch_succeeds(
    stack: Stack, up: Callable[..., Tree], repo: Store, sql: Sql
) -> None:
    tree = up(write_config(stack))
    tree.wait_ready()
    run_ids = trigger(repo, CHAIN, 16, seconds=1.0)
    wait_for(lambda: in_flight(sql, tree.pids("worker")), timeout=30, what="a handler to start")

    for role in ("scheduler", "publisher"):
        (old,) = tree.pids(role)
        _kill(old, signal.SIGKILL)
        new = wait_replaced(tree, role, old)
        assert new != old

    # A worker killed in the middle of a handler: its task runs again once the lease lapses.
    pid, victim, attempt = wait_for(
        lambda: next(iter(in_flight(sql, tree.pids("worker"))), None),
        timeout=30,
        what="a handler running in a worker",
    )
    _kill(pid, signal.SIGKILL)
    wait_replaced(tree, "worker", pid)

    wait_succeeded(sql, run_ids)
    final = assert_once_per_final_attempt(sql, run_ids)
    assert final[victim] > attempt, "the task of the killed worker was not run again"
    died = [e["msg"] for e in tree.supervisor_events("child_died")]
    assert len(died) == 3, died
    assert all("killed by SIGKILL — out of memory?" in m for m in died), died
    assert tree.running()


def test_children_sigkilled_while_logging_wedge_no_sibling_and_tear_no_line(
    generic: Callable[..., GenericTree],
) -> None:
    tree = generic("chatty")
    wait_for(lambda: len(tree.pids("chatty")) == 3, timeout=10, what="three chatty children")
    siblings = {t: p for p, t in tree.children().items() if not t.endswith(" 1/3")}
    assert len(siblings) == 2
    for p in siblings.values():
        wait_for(lambda p=p: tree.count(p) > 0, timeout=10, what=f"pid {p} to log")

    killed = []
    for _ in range(KILLS):
        (victim,) = [p for p, t in tree.children().items() if t.endswith("chatty 1/3")]
        # Killed in the middle of its stream, not while it starts.
        wait_for(lambda v=victim: tree.count(v) >= BURST, timeout=10, what="the victim to log")
        before = {p: tree.count(p) for p in siblings.values()}
        _kill(victim, signal.SIGKILL)
        killed.append(victim)
        wait_replaced(tree, "chatty", victim, timeout=10)
        for p, n in before.items():  # the siblings keep logging after each kill
            wait_for(
                lambda p=p, n=n: tree.count(p) >= n + BURST,
                timeout=10,
                what=f"sibling {p} to keep logging",
            )

    # The same siblings ran all along: none wedged, none was replaced.
    assert {t: p for p, t in tree.children().items() if not t.endswith(" 1/3")} == siblings
    assert tree.finish() == exitcodes.CLEAN
    with tree.lock:
        assert not tree.bad, f"{len(tree.bad)} torn or lost line(s), e.g. {tree.bad[:3]}"
        assert all(tree.chatter[p] > 0 for p in killed)
        total_chatter = sum(tree.chatter.values())  # checked line by line as it came
    assert total_chatter >= KILLS * BURST * 3
    died = [e["msg"] for e in tree.logged("child_died")]
    assert len(died) == len(killed), died
    assert all("killed by SIGKILL" in m for m in died)


def test_a_child_killed_by_a_signal_without_a_name_is_restarted(
    generic: Callable[..., GenericTree],
) -> None:
    tree = generic("idle")
    child = wait_for(lambda: next(iter(tree.pids("idle")), None), timeout=10, what="the child")
    _kill(child, signal.SIGRTMIN + 1)  # a real-time signal: not a member of signal.Signals
    wait_replaced(tree, "idle", child, timeout=10)
    assert tree.running(), "the supervisor died with its child"
    assert tree.finish() == exitcodes.CLEAN
    died = [e["msg"] for e in tree.logged("child_died")]
    assert len(died) == 1 and f"(pid {child}) killed by" in died[0], died
    assert not tree.bad, tree.bad


def test_a_child_that_raises_logs_its_traceback_as_json_lines_with_role_and_pid(
    generic: Callable[..., GenericTree],
) -> None:
    tree = generic("crash")
    wait_for(lambda: tree.logged("child_finished"), timeout=10, what="the crasher to be reported")
    assert tree.finish() == exitcodes.CLEAN
    assert not tree.bad, "a crash traceback broke the JSON log stream:\n" + "\n".join(
        b.decode(errors="replace") for b in tree.bad
    )
    with tree.lock:
        crash = [e for e in tree.lines if "crasher gave up" in str(e.get("msg", ""))]
    assert crash and crash[0]["role"] == "crasher", crash


# ------------------------------------------------------------------ stopping the tree


def test_sigterm_lets_in_flight_tasks_finish_and_exits_0(
    stack: Stack, up: Callable[..., Tree], repo: Store, sql: Sql
) -> None:
    tree = up(write_config(stack))
    tree.wait_ready()
    run_ids = trigger(repo, SLEEP, 2, seconds=3.0)
    running = wait_for(
        lambda: (found := in_flight(sql, tree.pids("worker"))) and len(found) == 2 and found,
        timeout=30,
        what="both handlers to run",
    )
    children = tree.children()
    started = time.monotonic()
    tree.signal(signal.SIGTERM)
    assert tree.wait(STOP_S) == exitcodes.CLEAN, tree.text()
    assert time.monotonic() - started < 9, "the drain ran into its deadline"

    states = dict(sql.execute("SELECT id, state FROM task_runs WHERE run_id = ANY(%s)", (run_ids,)))
    assert {states[t] for _, t, _ in running} == {"SUCCEEDED"}, states
    live = sql.execute(
        "SELECT count(*) FROM task_runs WHERE state = 'RUNNING' AND lease_expires_at > now()"
    ).fetchone()
    assert live == (0,)
    executions = sql.execute("SELECT count(*) FROM test_executions").fetchone()
    assert executions == (2,)
    assert not [p for p in children if alive(p)]
    # Stop order: scheduler (group 0), then the workers (1), then the publisher (2).
    stopped = [e["msg"].split(" ", 1)[0] for e in tree.supervisor_events("child_stopped")]
    assert [s.split("-")[0] for s in stopped] == [
        "scheduler",
        "worker",
        "worker",
        "publisher",
    ], stopped
    assert all("exited with code 0" in e["msg"] for e in tree.supervisor_events("child_stopped")), (
        tree.supervisor_events("child_stopped")
    )
    assert not tree.supervisor_events("drain_timeout")


def test_a_second_sigterm_kills_every_child_at_once(
    stack: Stack, up: Callable[..., Tree], repo: Store, sql: Sql
) -> None:
    tree = up(write_config(stack))
    tree.wait_ready()
    trigger(repo, SLEEP, 1, seconds=30.0)
    wait_for(
        lambda: in_flight(sql, tree.pids("worker")),
        timeout=30,
        what="a long handler to run",
    )
    children = tree.children()
    started = time.monotonic()
    tree.signal(signal.SIGTERM)  # graceful: the worker would wait for its 30 s handler
    wait_for(lambda: tree.supervisor_events("draining"), timeout=10, what="the drain to start")
    tree.signal(signal.SIGTERM)  # the second one forces the stop
    assert tree.wait(STOP_S) == exitcodes.CLEAN, tree.text()
    assert time.monotonic() - started < 10, "the fast stop waited for the handler"
    assert tree.supervisor_events("fast_stop")
    assert not [p for p in children if alive(p)]


@pytest.mark.slow
def test_sigkill_of_the_supervisor_leaves_no_orphan_and_the_next_up_finishes_the_work(
    stack: Stack, up: Callable[..., Tree], repo: Store, sql: Sql
) -> None:
    config = write_config(stack)
    first = up(config)
    first.wait_ready()
    run_ids = trigger(repo, SLEEP, 6, seconds=1.5)
    running = wait_for(
        lambda: (found := in_flight(sql, first.pids("worker"))) and len(found) == 2 and found,
        timeout=30,
        what="both workers to run a handler",
    )
    children = first.children()
    assert len(children) == 4
    _kill(first.supervisor_pid, signal.SIGKILL)
    first.wait(STOP_S)
    wait_for(
        lambda: not [p for p in children if alive(p)],
        timeout=ORPHAN_S,
        interval=POLL_S,
        what=f"every child to die with its supervisor: {children}",
    )

    second = up(config)
    second.wait_ready()
    wait_succeeded(sql, run_ids)
    final = assert_once_per_final_attempt(sql, run_ids)
    assert all(final[t] > a for _, t, a in running), "interrupted tasks must run again"


# ------------------------------------------------------------------ PID 1 of a namespace


@needs_unshare
def test_as_pid_1_of_a_pid_namespace_up_drains_on_sigterm(
    stack: Stack, up: Callable[..., Tree], repo: Store, sql: Sql
) -> None:
    tree = up(write_config(stack, processes={"workers": 1}), pid_namespace=True)
    tree.wait_ready()
    assert ns_pids(tree.supervisor_pid)[-1] == 1, "the supervisor is not PID 1 of its namespace"
    (run_id,) = trigger(repo, SLEEP, 1, seconds=2.0)
    wait_for(lambda: in_flight(sql), timeout=30, what="the handler to run")
    children = tree.children()
    tree.signal(signal.SIGTERM)
    assert tree.wait(STOP_S) == exitcodes.CLEAN, tree.text()  # unshare exits with PID 1's code
    assert sql.execute("SELECT state FROM task_runs WHERE run_id = %s", (run_id,)).fetchall() == [
        ("SUCCEEDED",)
    ]
    assert sql.execute("SELECT count(*) FROM test_executions").fetchone() == (1,)
    assert not [p for p in children if alive(p)]


@needs_unshare
def test_as_pid_1_a_sigterm_that_comes_before_the_handlers_exist_is_not_lost(
    stack: Stack, up: Callable[..., Tree]
) -> None:
    """PID 1 of a namespace ignores a signal it has no handler for: a `podman stop` in the
    first instants of a container was lost, and the engine waited for its SIGKILL. `flowforge
    up` blocks SIGTERM and SIGINT from its start (they stay pending across the exec into the
    tree) until the supervisor's handlers exist, which then drain at once. The SIGTERM goes to
    flowforge once it blocks them, not to unshare's child before its exec (runs_python)."""
    tree = up(write_config(stack, processes={"workers": 1}), pid_namespace=True)
    pid = tree.supervisor_pid
    wait_for(  # runs_python first: the mask is read only once it is the interpreter's
        lambda: (
            (runs_python(pid) and signal.SIGTERM in signals_of(pid, "SigBlk")) or not tree.running()
        ),
        timeout=READY_S,
        interval=0.002,
        what="flowforge up to block the stop signals",
    )
    assert ns_pids(pid)[-1] == 1, "not PID 1 of its namespace"
    assert not tree.supervisor_events("tree_ready"), "too late: the handlers already exist"
    _kill(pid, signal.SIGTERM)
    assert tree.wait(STOP_S) == exitcodes.CLEAN, tree.text()
    assert "draining (received SIGTERM)" in tree.text()


#: The container image's entrypoint: flowforge exec'd with the stop signals already blocked.
BLOCKING_ENTRY = ("env", "--block-signal=TERM,INT")


@needs_unshare
def test_as_pid_1_started_with_the_stop_signals_blocked_a_sigterm_at_its_exec_is_not_lost(
    stack: Stack, up: Callable[..., Tree]
) -> None:
    """The image's entrypoint blocks SIGTERM and SIGINT before it execs `flowforge up`, so the
    interpreter's own start (before `flowforge up` blocks them itself) loses no stop either:
    a SIGTERM at the first instant of the flowforge process stays pending and drains."""
    tree = up(
        write_config(stack, processes={"workers": 1}), pid_namespace=True, entry=BLOCKING_ENTRY
    )
    pid = tree.supervisor_pid
    wait_for(
        lambda: runs_python(pid) or not tree.running(),
        timeout=READY_S,
        interval=0.001,
        what="env to exec the interpreter",
    )
    assert ns_pids(pid)[-1] == 1, "not PID 1 of its namespace"
    assert signal.SIGTERM in signals_of(pid, "SigBlk"), "the entrypoint did not block it"
    assert signal.SIGTERM not in signals_of(pid, "SigCgt"), "too late: a handler exists"
    _kill(pid, signal.SIGTERM)
    assert tree.wait(STOP_S) == exitcodes.CLEAN, tree.text()
    assert "draining (received SIGTERM)" in tree.text()


@pytest.mark.parametrize(
    "pid_namespace",
    [False, pytest.param(True, marks=needs_unshare)],
    ids=["subreaper", "pid-1"],
)
def test_an_orphaned_grandchild_is_reaped_no_zombie_remains(
    generic: Callable[..., GenericTree], pid_namespace: bool
) -> None:
    tree = generic("orphan", pid_namespace=pid_namespace)
    if pid_namespace:
        assert ns_pids(tree.supervisor_pid)[-1] == 1
    # The orphaner exits at once; its grandchild is reparented to the supervisor ...
    grandchild = wait_for(
        lambda: next(iter(tree.pids("grandchild")), None),
        timeout=10,
        interval=POLL_S,
        what="the orphaned grandchild to be reparented to the supervisor",
    )
    assert not tree.pids("orphaner")
    # ... and reaped when it exits: no zombie is left behind.
    wait_for(
        lambda: proc_state(grandchild) is None,
        timeout=targets.GRANDCHILD_S + 5,
        interval=POLL_S,
        what=f"grandchild {grandchild} to be reaped (state now {proc_state(grandchild)})",
    )
    zombies = [c for c in children_of(tree.supervisor_pid) if proc_state(c) == "Z"]
    assert not zombies
    assert tree.pids("idle"), "the permanent sibling is gone"
    assert tree.finish() == exitcodes.CLEAN
    assert not tree.bad


# ------------------------------------------------------------------ hung children


def test_a_hung_child_is_aborted_or_killed_and_replaced(
    generic: Callable[..., GenericTree],
) -> None:
    tree = generic("hang")
    hanger = wait_for(lambda: next(iter(tree.pids("hanger")), None), timeout=10, what="hanger")
    stubborn = wait_for(lambda: next(iter(tree.pids("stubborn")), None), timeout=10, what="stub")
    # Silent past 1 s: SIGABRT (the hanger dies of it) ...
    wait_replaced(tree, "hanger", hanger, timeout=10)
    # ... the stubborn one ignores SIGABRT and gets SIGKILL 2 s later.
    wait_replaced(tree, "stubborn", stubborn, timeout=15)
    assert tree.finish() == exitcodes.CLEAN
    hung = [e["msg"] for e in tree.logged("child_hung")]
    assert any(f"hanger-1 (pid {hanger})" in m for m in hung), hung
    assert any(f"stubborn-1 (pid {stubborn})" in m for m in hung), hung
    died = [e["msg"] for e in tree.logged("child_died")]
    assert any(f"(pid {hanger}) killed by SIGABRT" in m for m in died), died
    assert any(f"(pid {stubborn}) killed by SIGKILL" in m for m in died), died
    assert not tree.bad


# ------------------------------------------------------------------ scaling, recycling, rolling


def test_titles_are_set_and_sigttin_sigttou_change_the_number_of_workers(
    stack: Stack, up: Callable[..., Tree]
) -> None:
    config = write_config(stack)
    tree = up(config)
    tree.wait_ready()
    assert title_of(tree.supervisor_pid) == f"flowforge: supervisor [{config.name}]"
    assert sorted(tree.children().values()) == [
        "flowforge: publisher",
        "flowforge: scheduler",
        "flowforge: worker 1/2",
        "flowforge: worker 2/2",
    ]

    def workers(n: int) -> Callable[[], bool]:
        return lambda: len(worker_titles(tree)) == n

    tree.signal(signal.SIGTTIN)
    wait_for(workers(3), timeout=REPLACED_S, what="a third worker")
    assert "flowforge: worker 3/3" in worker_titles(tree)
    tree.signal(signal.SIGTTIN)
    wait_for(workers(4), timeout=REPLACED_S, what="a fourth worker")
    for expected in (3, 2, 1):
        tree.signal(signal.SIGTTOU)
        wait_for(workers(expected), timeout=REPLACED_S, what=f"{expected} worker(s)")
    tree.signal(signal.SIGTTOU)  # never below one worker
    wait_for(
        lambda: sum("now 1 wanted" in e["msg"] for e in tree.supervisor_events("scaled")) == 2,
        timeout=10,
        what="the second scale-down to one worker to be handled",
    )
    assert worker_titles(tree) == ["flowforge: worker 1/2"]
    assert tree.running()


def sockets_of(pid: int) -> list[str]:
    fds = Path(f"/proc/{pid}/fd")
    return [t for t in (os.readlink(fds / fd) for fd in os.listdir(fds)) if t.startswith("socket:")]


def test_the_supervisor_preloads_the_database_driver_but_opens_no_connection(
    stack: Stack, up: Callable[..., Tree]
) -> None:
    """Children inherit psycopg already loaded (a memory lever); connections stay theirs."""
    tree = up(write_config(stack))
    tree.wait_ready()
    maps = Path(f"/proc/{tree.supervisor_pid}/maps").read_text()
    assert "psycopg_binary" in maps
    assert sockets_of(tree.supervisor_pid) == []
    for pid in tree.children():
        assert sockets_of(pid), f"child {pid} should hold its own connections"


def test_workers_are_recycled_after_max_tasks_per_child_and_no_task_is_lost(
    stack: Stack, up: Callable[..., Tree], repo: Store, sql: Sql
) -> None:
    per_child = 3
    tree = up(write_config(stack, processes={"max_tasks_per_child": per_child}))
    tree.wait_ready()
    first_workers = tree.pids("worker")
    run_ids = trigger(repo, RECORD, 24)
    wait_succeeded(sql, run_ids)
    assert_exactly_once(sql, run_ids)
    per_pid = Counter(
        int(p)
        for (p,) in sql.execute(
            "SELECT pid FROM test_executions WHERE run_id = ANY(%s)", (run_ids,)
        ).fetchall()
    )
    assert max(per_pid.values()) <= per_child, per_pid
    assert len(per_pid) >= len(run_ids) // per_child, per_pid
    assert not [p for p in first_workers if alive(p)], "the first workers were never recycled"
    assert len(tree.supervisor_events("child_recycled")) >= len(run_ids) // per_child - 2
    assert not tree.supervisor_events("child_died")


def test_sighup_replaces_every_worker_new_before_old_and_tasks_keep_completing(
    stack: Stack, up: Callable[..., Tree], repo: Store, sql: Sql
) -> None:
    tree = up(write_config(stack))
    tree.wait_ready()
    old = tree.pids("worker")
    assert len(old) == 2
    run_ids = trigger(repo, SLEEP, 30, seconds=0.3)
    wait_for(lambda: in_flight(sql, old), timeout=30, what="a handler to start")
    tree.signal(signal.SIGHUP)

    fewest = len(old)
    deadline = time.monotonic() + 45
    while any(alive(p) for p in old) or len(tree.pids("worker")) != len(old):
        assert time.monotonic() < deadline, f"the roll did not finish: {tree.output_tail()}"
        tree.assert_running()
        running = [p for p, t in tree.children().items() if t.startswith("flowforge: worker")]
        fewest = min(fewest, len(running))
        time.sleep(0.02)
    assert fewest >= len(old), f"only {fewest} worker(s) ran at one point of the roll"
    new = tree.pids("worker")
    assert not set(new) & set(old)

    # Each replacement started before its predecessor stopped.
    def stopped_logged() -> list[str] | None:
        msgs = [e["msg"] for e in tree.supervisor_events()]
        return msgs if all(any(f"(pid {p}) stopped" in m for m in msgs) for p in old) else None

    msgs = wait_for(stopped_logged, timeout=10, what="the old workers' exits to be logged")
    for pid in old:
        stop_at = next(i for i, m in enumerate(msgs) if f"(pid {pid}) stopped" in m)
        started_at, successor = successor_of(msgs, pid)
        assert started_at < stop_at, f"{successor} started after {pid} stopped: {msgs}"

    wait_succeeded(sql, run_ids)
    assert_exactly_once(sql, run_ids)
    by_new = sql.execute(
        "SELECT count(*) FROM test_executions WHERE pid = ANY(%s)", (new,)
    ).fetchone()
    assert by_new is not None and by_new[0] > 0, "the new workers ran nothing"
    assert not tree.supervisor_events("child_died")


def test_sighup_stops_each_old_child_only_once_its_replacement_is_ready(
    generic: Callable[..., GenericTree],
) -> None:
    tree = generic("rolling")
    wait_for(lambda: len(tree.logged("ready")) == 2, timeout=10, what="both children ready")
    old = tree.pids("roller")
    assert len(old) == 2
    tree.signal(signal.SIGHUP)
    wait_for(
        lambda: not any(alive(p) for p in old) and len(tree.logged("ready")) == 4,
        timeout=20,
        interval=POLL_S,
        what="both children to be replaced by ready ones",
    )
    new = tree.pids("roller")
    assert len(new) == 2 and not set(new) & set(old)
    assert tree.finish() == exitcodes.CLEAN
    ready_at = {e["pid"]: e["ts"] for e in tree.logged("ready")}
    signalled_at = {e["pid"]: e["signalled_at"] for e in tree.logged("terminating")}
    msgs = [e["msg"] for e in tree.logged("child_started")]
    for pid in old:
        _, successor = successor_of(msgs, pid)
        assert successor in ready_at, f"{pid}'s successor {successor} never became ready"
        assert signalled_at[pid] >= ready_at[successor], (
            f"pid {pid} got SIGTERM {ready_at[successor] - signalled_at[pid]:.2f}s "
            f"before its replacement {successor} was ready"
        )
    assert not tree.bad, tree.bad


# ------------------------------------------------------------------ two trees


@pytest.mark.slow
def test_two_trees_share_one_queue_and_sigkill_of_one_whole_tree_loses_nothing(
    stack: Stack, up: Callable[..., Tree], repo: Store, sql: Sql
) -> None:
    config = write_config(stack)
    doomed, survivor = up(config), up(config)
    doomed.wait_ready()
    survivor.wait_ready()

    warmup = trigger(repo, RECORD, 20)
    wait_succeeded(sql, warmup)
    assert_exactly_once(sql, warmup)

    run_ids = trigger(repo, SLEEP, 16, seconds=1.0)
    running = wait_for(
        lambda: in_flight(sql, doomed.pids("worker")),
        timeout=30,
        what="a handler in the tree to be killed",
    )
    children = doomed.children()
    _kill(doomed.supervisor_pid, signal.SIGKILL)
    doomed.wait(STOP_S)
    wait_for(
        lambda: not [p for p in children if alive(p)],
        timeout=ORPHAN_S,
        interval=POLL_S,
        what="the killed tree's children to die with it",
    )
    wait_succeeded(sql, run_ids)
    final = assert_once_per_final_attempt(sql, run_ids)
    assert all(final[t] > a for _, t, a in running), "interrupted tasks must run again"
    assert survivor.running()
    assert not survivor.supervisor_events("child_died")
