"""A handler's output becomes tagged, escaped records (flowforge/roles/output.py).

``capture`` takes over descriptors 1 and 2 of its process, so each case runs in a child
interpreter (a few hundred milliseconds) whose stderr is read here: every line must be one
JSON record, attributed to the handler call that wrote it, with no raw control character.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

from flowforge.roles import output

REPO = Path(__file__).resolve().parents[2]

#: What the child runs: two handler calls that write every way a handler can, then output
#: written outside any call. ``TASK_A``/``TASK_B``/``RUN``/``SINKS`` are filled in; each call's
#: per-attempt sink is written to the file ``SINKS`` names, as JSON.
CHILD = """
import json, logging, os, subprocess, sys, uuid
from supervisor import logs
logs.configure("worker-1", "json")
from flowforge.roles import output
from flowforge.roles.attemptlog import AttemptOutput
from flowforge.roles.output import attributed, capture
capture()
capture()  # a second call changes nothing
logging.getLogger("flowforge.worker").info("the worker's own record")
sink_a, sink_b = AttemptOutput(100_000), AttemptOutput(100_000)
with attributed("first", uuid.UUID(TASK_A), uuid.UUID(RUN), sink_a):
    print("2026-01-01 00:00:00.000 INFO scheduler[1] flowforge: \\x1b[31mforged\\x1b[0m")
    sys.stderr.write("to stderr\\rover it\\n")
    os.write(2, b"straight to fd 2\\n")
    os.write(1, "\\u009b\\x07bytes ".encode() + b"\\xff not utf-8\\n")
    subprocess.run(["sh", "-c", "echo from a subprocess; echo its stderr >&2"], check=True)
    logging.getLogger().warning("logged by the handler")
    logging.getLogger("flowforge.worker").info("the worker's record inside a call")
    print("x" * 5000)
    print("no newline at the end", end="")
with attributed("second", uuid.UUID(TASK_B), uuid.UUID(RUN), sink_b):
    print("the next call, at once")
print("outside any call")
output.drain()
with open(SINKS, "w") as sinks:
    json.dump([sink.final().output.text for sink in (sink_a, sink_b)], sinks)
"""


def _child_records(code: str) -> tuple[list[dict[str, Any]], bytes]:
    """Run ``code`` in a child interpreter: its stderr as JSON records, and as bytes."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        timeout=30,
        check=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert done.stdout == b"", "nothing may reach the real stdout"
    return [json.loads(line) for line in done.stderr.decode().splitlines()], done.stderr


def _run_child(sinks: Path) -> tuple[list[dict[str, Any]], str, str, str, bytes]:
    task_a, task_b, run = (str(uuid.uuid4()) for _ in range(3))
    code = (
        f"TASK_A, TASK_B, RUN, SINKS = {task_a!r}, {task_b!r}, {run!r}, {str(sinks)!r}\n"
        + textwrap.dedent(CHILD)
    )
    records, raw = _child_records(code)
    return records, task_a, task_b, run, raw


def test_every_write_of_a_handler_is_its_own_tagged_record(tmp_path: Path) -> None:
    records, task_a, task_b, run, raw = _run_child(tmp_path / "sinks.json")
    assert b"\x1b" not in raw and b"\r" not in raw and b"\x07" not in raw
    assert b"\xc2\x9b" not in raw  # nor a C1 control, UTF-8 encoded

    def of(task_run_id: str) -> list[tuple[str, str]]:
        return [
            (r["stream"], r["msg"])
            for r in records
            if r.get("task_run_id") == task_run_id and r["logger"] == "flowforge.handler"
        ]

    first = of(task_a)
    assert (
        "stdout",
        r"2026-01-01 00:00:00.000 INFO scheduler[1] flowforge: \x1b[31mforged\x1b[0m",
    ) in first
    assert ("stderr", r"to stderr\rover it") in first
    assert ("stderr", "straight to fd 2") in first
    assert ("stdout", "\\x9b\\x07bytes \ufffd not utf-8") in first
    assert ("stdout", "from a subprocess") in first
    assert ("stderr", "its stderr") in first
    assert ("stdout", "no newline at the end") in first  # the call's, though unterminated
    long_pieces = [m for s, m in first if set(m) == {"x"}]
    assert [len(m) for m in long_pieces] == [output.MAX_LINE_BYTES, output.MAX_LINE_BYTES, 904]
    assert of(task_b) == [("stdout", "the next call, at once")]

    for record in records:
        if record["logger"] == "flowforge.handler" and record.get("task_run_id"):
            assert record["run_id"] == run and record["action"] == "handler_output"
            assert record["level"] == ("INFO" if record["stream"] == "stdout" else "WARNING")
            assert record["task"] == ("first" if record["task_run_id"] == task_a else "second")

    [logged] = [r for r in records if r["msg"] == "logged by the handler"]
    assert (logged["logger"], logged["task_run_id"], logged["task"]) == ("root", task_a, "first")
    own, inside = [r for r in records if r["logger"] == "flowforge.worker"]
    assert "task_run_id" not in own
    assert inside["task_run_id"] == task_a  # tagged in the tree's log, not kept in the sink
    [outside] = [r for r in records if r["msg"] == "outside any call"]
    assert outside["stream"] == "stdout" and "task_run_id" not in outside


def test_every_line_of_a_handler_call_is_also_kept_in_its_attempt_s_sink(tmp_path: Path) -> None:
    """The per-attempt sink (SPEC 7.5) gets each line the call's record got, raw (escaping is
    for the terminal that shows it), and nothing of the other call or of no call."""
    _run_child(tmp_path / "sinks.json")
    first, second = json.loads((tmp_path / "sinks.json").read_text())
    lines = first.splitlines()
    assert "2026-01-01 00:00:00.000 INFO scheduler[1] flowforge: \x1b[31mforged\x1b[0m" in lines
    assert "straight to fd 2" in lines and "from a subprocess" in lines
    assert "its stderr" in lines and "no newline at the end" in lines
    assert [len(line) for line in lines if set(line) == {"x"}] == [2048, 2048, 904]
    assert "the next call, at once" not in first and "outside any call" not in first
    assert second == "the next call, at once\n"
    # its logging records too, as ctx.log's lines are kept; FlowForge's own are not
    assert "WARNING logged by the handler" in lines
    assert not any("the worker's record" in line for line in lines)


#: Two async calls on one event loop, their writes interleaved at every await, beside a sync
#: call on another thread: each line must be its own call's. ``TASKS``/``RUN`` are filled in.
ASYNC_CHILD = """
import asyncio, logging, sys, threading, uuid
from supervisor import logs
logs.configure("worker-1", "json")
from flowforge.roles import output
from flowforge.roles.output import attributed, attributed_async, capture
capture()
run = uuid.UUID(RUN)

async def call(name, task):
    with attributed_async(name, uuid.UUID(task), run):
        for step in range(3):
            print(f"{name} line {step}")
            await asyncio.sleep(0.01)
        sys.stderr.write(f"{name} err ")
        await asyncio.sleep(0.01)
        sys.stderr.write("continued\\n")
        logging.getLogger("user").warning(f"{name} logged")
        print(f"{name} unterminated", end="")

def sync_call():
    with attributed("sync", uuid.UUID(TASKS[2]), run):
        for step in range(3):
            print(f"sync line {step}")
            threading.Event().wait(0.01)

async def main():
    thread = threading.Thread(target=sync_call)
    thread.start()
    await asyncio.gather(call("a", TASKS[0]), call("b", TASKS[1]))
    thread.join()

asyncio.run(main())
print("outside any call")
output.drain()
"""


def test_concurrent_async_calls_each_own_their_python_writes_and_records() -> None:
    tasks = [str(uuid.uuid4()) for _ in range(3)]
    run = str(uuid.uuid4())
    code = f"TASKS, RUN = {tasks!r}, {run!r}\n" + textwrap.dedent(ASYNC_CHILD)
    records, _ = _child_records(code)

    def of(task_run_id: str) -> list[str]:
        return sorted(r["msg"] for r in records if r.get("task_run_id") == task_run_id)

    for name, task in zip("ab", tasks, strict=False):
        assert of(task) == sorted(
            [
                *(f"{name} line {step}" for step in range(3)),
                f"{name} err continued",
                f"{name} logged",
                f"{name} unterminated",
            ]
        )
    assert of(tasks[2]) == [f"sync line {step}" for step in range(3)]
    [outside] = [r for r in records if r["msg"] == "outside any call"]
    assert "task_run_id" not in outside
