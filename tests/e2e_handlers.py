"""Handlers for end-to-end tests. Each execution is recorded in ``test_executions`` (in the
database named by ``FLOWFORGE_E2E_RECORD_URL``) so tests count executions in the database.

Not ``FLOWFORGE_DATABASE_URL``: a tree keeps its secret variables from its children
(flowforge/tree.py), so a worker of ``flowforge up`` does not see that one."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from flowforge import PermanentError, task
from flowforge.roles.context import TaskContext

#: Where :func:`record` writes: the test database's URL (module doc). tests/e2e.py names it
#: too: this file is copied alone into the container tests' config folder.
RECORD_URL_ENV = "FLOWFORGE_E2E_RECORD_URL"
#: Upper bound on any waiting handler (seconds): tests never hang on a forgotten gate.
MAX_WAIT_S = 120.0


def record(ctx: TaskContext, handler: str) -> None:
    with psycopg.connect(os.environ[RECORD_URL_ENV], autocommit=True) as conn:
        conn.execute(
            "INSERT INTO test_executions (task_run_id, run_id, task, handler, attempt, pid)"
            " VALUES (%s, %s, %s, %s, %s, %s)",
            (ctx.task_run_id, ctx.run_id, ctx.name, handler, ctx.attempt, os.getpid()),
        )


def _wait(ctx: TaskContext, until: Any, limit_s: float = MAX_WAIT_S, poll_s: float = 0.02) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if until():
            return True
        time.sleep(poll_s)
    return False


@task("e2e.record")
def record_only(ctx: TaskContext) -> dict[str, Any]:
    record(ctx, "e2e.record")
    return {"task": ctx.name, "attempt": ctx.attempt, "upstream": dict(ctx.upstream)}


@task("e2e.sleep")
def sleep(ctx: TaskContext) -> dict[str, Any]:
    """Sleeps ``input.seconds`` (default 1) without looking at cancellation."""
    record(ctx, "e2e.sleep")
    time.sleep(float(ctx.input.get("seconds", 1)))
    return {"slept": ctx.input.get("seconds", 1)}


@task("e2e.gate")
def gate(ctx: TaskContext) -> dict[str, Any]:
    """Waits until the file ``input.gate`` exists (tests open the gate), or cancellation."""
    record(ctx, "e2e.gate")
    _wait(ctx, lambda: Path(ctx.input["gate"]).exists() or ctx.cancelled.is_set())
    return {"gated": True}


@task("e2e.talk")
def talk(ctx: TaskContext) -> dict[str, Any]:
    """Writes ``input.text`` through ctx.log, logging, print and stderr, reports ``input.progress``
    (default 0.4) with ``input.text`` as its message, then waits like e2e.gate (if
    ``input.gate``); with ``input.print_mb``, first prints that many MB to stdout."""
    record(ctx, "e2e.talk")
    for _ in range(int(float(ctx.input.get("print_mb", 0)) * 1024)):
        sys.stdout.write(("o" * 1023) + "\n")  # 1 KiB a line
    text = ctx.input.get("text", "")
    ctx.log.info("log %s", text)
    logging.getLogger("e2e.talk").info("logging %s", text)  # kept with the attempt too
    print(f"out {text}", flush=True)
    print(f"err {text}", file=sys.stderr, flush=True)
    ctx.progress(float(ctx.input.get("progress", 0.4)), text)
    gate_file = ctx.input.get("gate")
    if gate_file is not None:
        _wait(ctx, lambda: Path(gate_file).exists() or ctx.cancelled.is_set())
    return {"talked": True}


@task("e2e.gate_first")
def gate_first(ctx: TaskContext) -> dict[str, Any]:
    """With ``input.gate``, waits like e2e.gate; without, returns at once (batch tests)."""
    record(ctx, "e2e.gate_first")
    gate_file = ctx.input.get("gate")
    if gate_file is None:
        return {"gated": False}
    _wait(ctx, lambda: Path(gate_file).exists() or ctx.cancelled.is_set())
    return {"gated": True}


@task("e2e.flaky")
def flaky(ctx: TaskContext) -> dict[str, Any]:
    """Fails until attempt ``input.succeed_on`` (default 2)."""
    record(ctx, "e2e.flaky")
    if ctx.attempt < int(ctx.input.get("succeed_on", 2)):
        raise RuntimeError(f"flaky failure on attempt {ctx.attempt}")
    return {"attempt": ctx.attempt}


@task("e2e.fail")
def fail(ctx: TaskContext) -> None:
    record(ctx, "e2e.fail")
    raise RuntimeError("this handler always fails")


@task("e2e.fail_until")
def fail_until(ctx: TaskContext) -> dict[str, Any]:
    """Fails until the file ``input.file`` exists (tests bury the task, fix it, requeue it)."""
    record(ctx, "e2e.fail_until")
    if not Path(ctx.input["file"]).exists():
        raise RuntimeError(f"{ctx.input['file']} does not exist yet")
    return {"attempt": ctx.attempt}


@task("e2e.permanent")
def permanent(ctx: TaskContext) -> None:
    record(ctx, "e2e.permanent")
    raise PermanentError("this input can never work")


@task("e2e.unserializable")
def unserializable(ctx: TaskContext) -> object:
    record(ctx, "e2e.unserializable")
    return object()


@task("e2e.honour_cancel")
def honour_cancel(ctx: TaskContext) -> dict[str, Any]:
    """Runs until asked to stop, then returns."""
    record(ctx, "e2e.honour_cancel")
    _wait(ctx, ctx.cancelled.is_set)
    return {"stopped": ctx.cancelled.is_set()}


@task("e2e.hang")
def hang(ctx: TaskContext) -> None:
    """Never returns on its own (for timeouts): only the process's end stops it."""
    record(ctx, "e2e.hang")
    time.sleep(MAX_WAIT_S * 10)


@task("e2e.sleep_logged")
def sleep_logged(ctx: TaskContext) -> dict[str, Any]:
    """Like e2e.sleep, but records its execution as a line in the file ``input.log`` instead
    of the database: for tests whose database fails over under the handler (a record whose
    commit was acknowledged to nobody would make the handler fail, and its retry count twice).
    One ``write(2)`` with O_APPEND, so concurrent processes never interleave their lines."""
    line = f"{ctx.task_run_id} {ctx.attempt} {os.getpid()}\n".encode()
    fd = os.open(ctx.input["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    time.sleep(float(ctx.input.get("seconds", 1)))
    return {"slept": ctx.input.get("seconds", 1)}


@task("e2e.cut_broker")
def cut_broker(ctx: TaskContext) -> dict[str, Any]:
    """Shuts down every TCP connection this process holds to port ``input.broker_port`` (the
    worker's own AMQP connection): the broker connection drops while the handler runs, as when
    a RabbitMQ node dies, and the worker only notices at its next broker call. Only the first
    attempt cuts."""
    record(ctx, "e2e.cut_broker")
    cut = 0
    if ctx.attempt == 1:
        for name in os.listdir("/proc/self/fd"):
            if _peer_port(int(name)) == int(ctx.input["broker_port"]):
                with socket.socket(fileno=os.dup(int(name))) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
                cut += 1
    return {"cut": cut}


def _peer_port(fd: int) -> int | None:
    """The remote port of a connected TCP socket ``fd``; None for anything else."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None  # closed meanwhile (the listing's own descriptor)
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None  # not a socket
    with sock:
        try:
            return int(sock.getpeername()[1]) if sock.family == socket.AF_INET else None
        except OSError:
            return None  # not connected


@task("e2e.fail_loud")
def fail_loud(ctx: TaskContext) -> None:
    """Always fails with an error whose text tries to colour a terminal and forge a log line."""
    record(ctx, "e2e.fail_loud")
    raise RuntimeError(
        f"card declined\x1b[31m on attempt {ctx.attempt}\n"
        "2026-01-01 00:00:00.000 INFO scheduler[1] flowforge: FORGED second line"
    )


@task("e2e.cancel_seen")
def cancel_seen(ctx: TaskContext) -> dict[str, Any]:
    """Polls ``ctx.cancelled`` every 5 ms until it is set, then records a second row (handler
    ``e2e.cancel_seen:seen``) whose ``at`` is the database clock when it saw it."""
    record(ctx, "e2e.cancel_seen")
    seen = _wait(ctx, ctx.cancelled.is_set, poll_s=0.005)
    if seen:
        record(ctx, "e2e.cancel_seen:seen")
    return {"stopped": seen}


@task("e2e.environ")
def environ(ctx: TaskContext) -> dict[str, Any]:
    """What the worker's environment holds: ``input.names`` → each one's value (None: unset)."""
    record(ctx, "e2e.environ")
    return {name: os.environ.get(name) for name in ctx.input["names"]}


@task("e2e.print")
def print_output(ctx: TaskContext) -> dict[str, Any]:
    """Writes every way a handler can: a forged log line with terminal escapes on stdout, a
    line on stderr, bytes straight to descriptor 2, and a subprocess's stdout (``input.tag``
    marks each line)."""
    tag = ctx.input["tag"]
    print(f"2026-01-01 00:00:00.000 INFO scheduler[1] flowforge: \x1b[31m{tag} forged\x1b[0m")
    print(f"{tag} on stderr\rover it", file=sys.stderr)
    os.write(2, f"{tag} straight to fd 2\n".encode())
    subprocess.run(["sh", "-c", f"echo {tag} from a subprocess"], check=True)
    record(ctx, "e2e.print")
    return {"printed": tag}


@task("e2e.gate_then_fail")
def gate_then_fail(ctx: TaskContext) -> None:
    """Waits until the file ``input.gate`` exists, then fails for good (DEAD at once)."""
    record(ctx, "e2e.gate_then_fail")
    _wait(ctx, lambda: Path(ctx.input["gate"]).exists())
    raise PermanentError("the gate opened: failing for good")


# ------------------------------------------------------------------ values PostgreSQL cannot store


def _deep(levels: int) -> Any:
    value: Any = "bottom"
    for _ in range(levels):
        value = [value]
    return value


#: What ``e2e.unstorable`` returns, by ``input.kind``: each is refused by PostgreSQL as given.
UNSTORABLE_RESULTS: dict[str, Any] = {
    "nan": lambda: {"v": float("nan")},
    "inf": lambda: {"v": [1, float("-inf")]},
    "nul": lambda: {"s": "a\x00b"},
    "surrogate": lambda: {"s": "\ud800"},
    "surrogate_key": lambda: {"\udfff": 1},
    "deep": lambda: _deep(500),
    "big": lambda: {"s": "x" * 100_000},
}


@task("e2e.unstorable")
def unstorable(ctx: TaskContext) -> Any:
    """Returns what ``input.kind`` names (see UNSTORABLE_RESULTS); for ``nul_error`` raises an
    error whose text holds a NUL and a lone surrogate; for ``ok`` returns a normal result."""
    record(ctx, "e2e.unstorable")
    kind = ctx.input["kind"]
    if kind == "ok":
        return {"i": ctx.input.get("i")}
    if kind == "nul_error":
        raise PermanentError("broken \x00 text \ud800 here")
    return UNSTORABLE_RESULTS[kind]()


@task("e2e.items")
def items(ctx: TaskContext) -> list[Any]:
    """The list a map (``for_each``) expands: ``[0, 1, ..., input.n - 1]``."""
    return list(range(int(ctx.input["n"])))


@task("e2e.item")
def item(ctx: TaskContext) -> dict[str, Any]:
    """One map item: recorded, and returned with its index (results come back in item order)."""
    record(ctx, "e2e.item")
    return {"item": ctx.item, "index": ctx.index}


@task("e2e.item_paced")
def item_paced(ctx: TaskContext) -> dict[str, Any]:
    """One map item taking ``input.item_s`` seconds (default 0.1: slow enough that a worker is
    killed while one runs), recorded first; it dies for good (PermanentError) when its index is
    in ``input.fail``."""
    record(ctx, "e2e.item_paced")
    time.sleep(float(ctx.input.get("item_s", 0.1)))
    if ctx.index in ctx.input.get("fail", ()):
        raise PermanentError(f"item {ctx.index} can never work")
    return {"item": ctx.item, "index": ctx.index}


@task("e2e.labelled_items")
def labelled_items(ctx: TaskContext) -> list[Any]:
    """The list a map expands: ``input.n`` items ``{"i": index, "label": input.label}`` (a
    label with markup, which pages must show as text)."""
    label = ctx.input.get("label", "")
    return [{"i": i, "label": label} for i in range(int(ctx.input["n"]))]


@task("e2e.dependency")
def dependency(ctx: TaskContext) -> dict[str, Any]:
    """Calls a "dependency" that is down while the file ``input.down`` exists: each call is
    recorded with what it found (handler ``e2e.dependency:down`` or ``:up``), a call while it is
    down raises (a handler failure, counted by a circuit breaker)."""
    down = Path(ctx.input["down"]).exists()
    record(ctx, "e2e.dependency:down" if down else "e2e.dependency:up")
    if down:
        raise RuntimeError("the dependency is down")
    time.sleep(float(ctx.input.get("seconds", 0.02)))
    return {"called": True}


@task("e2e.tenant_items")
def tenant_items(ctx: TaskContext) -> list[Any]:
    """The list a map expands: ``input.n`` items ``{"tenant": t, "i": index}``, the tenants of
    ``input.tenants`` taken in turn (a map whose items carry a per-tenant key)."""
    tenants = list(ctx.input["tenants"])
    return [{"tenant": tenants[i % len(tenants)], "i": i} for i in range(int(ctx.input["n"]))]
