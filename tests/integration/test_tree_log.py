"""What a handler writes reaches the tree's log only as the handler's own records.

A real ``flowforge up`` tree on the session database and broker runs ``e2e.print``, which
prints a forged log line with terminal escapes, writes to stderr, writes bytes straight to
descriptor 2 and runs a subprocess that prints. The whole output of the tree is then read:
after ``flowforge up``'s banner every line is one record (JSON in json mode), the handler's
lines are attributed to its task run, and no raw escape or forged line start is anywhere.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from flowforge.domain.states import RunState
from tests.e2e import REPO, Stack
from tests.helpers import single, wait_for
from tests.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real role processes

Sql = psycopg.Connection[tuple[Any, ...]]

STOP_S = 20.0
#: A text record's start: ``time level role[pid] logger``.
TEXT_RECORD = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"[a-z]+(-\d+)?\[\d+\] \S+"
)
BANNER_LINES = 3  # flowforge up's own lines on stdout, before the tree starts


@contextlib.contextmanager
def _tree(stack: Stack, style: str) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``flowforge up`` (one worker) with its stdout and stderr in one file; stopped after."""
    config = stack.config_path(processes={"workers": 1}, logging={"format": style})
    log_path = stack.directory / f"up-{style}.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flowforge.cli", "-c", str(config), "up"],
            cwd=REPO,
            env=stack.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield proc, log_path
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(STOP_S)


def _run_printing_handler(
    stack: Stack, repo: Store, style: str
) -> tuple[bytes, str, uuid.UUID, int]:
    """The tree's whole output, the tag the handler printed, its task run id, the exit code."""
    tag = f"tag{uuid.uuid4().hex[:8]}"
    with _tree(stack, style) as (proc, log_path):
        run_id = repo.trigger(single("print", "e2e.print"), {"tag": tag}).run_id
        wait_for(
            lambda: repo.get_run(run_id).state is RunState.SUCCEEDED or proc.poll() is not None,
            timeout=60,
            what="the printing run to succeed",
        )
        assert proc.poll() is None, log_path.read_text(errors="replace")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(STOP_S)
    task_id = repo.get_run(run_id).tasks[0].id
    return log_path.read_bytes(), tag, task_id, code


def _check_no_raw_controls(raw: bytes, tag: str) -> list[str]:
    assert b"\x1b" not in raw and b"\r" not in raw, "a raw escape reached the log"
    lines = raw.decode("utf-8").split("\n")
    assert lines.pop() == "", "the output ends with a whole line"
    assert lines[0].startswith("flowforge up: ") and all(
        line.startswith("  ") for line in lines[1:BANNER_LINES]
    )
    records = lines[BANNER_LINES:]
    assert not [line for line in records if line.startswith("2026-01-01")], "a forged line"
    assert sum(tag in line for line in records) == 4, "one record per line the handler wrote"
    return records


def test_handler_output_is_one_json_record_per_line_attributed_to_the_handler(
    stack: Stack, repo: Store
) -> None:
    raw, tag, task_id, code = _run_printing_handler(stack, repo, "json")
    assert code == 0
    records = [json.loads(line) for line in _check_no_raw_controls(raw, tag)]
    assert all(isinstance(r, dict) and {"ts", "level", "role", "msg"} <= r.keys() for r in records)
    mine = [r for r in records if tag in r["msg"]]
    assert {(r["logger"], r["task_run_id"], r["task"]) for r in mine} == {
        ("flowforge.handler", str(task_id), "only")
    }
    assert all(r["role"].startswith("worker") for r in mine)
    assert sorted((r["stream"], r["msg"]) for r in mine) == sorted(
        [
            (
                "stdout",
                "2026-01-01 00:00:00.000 INFO scheduler[1] flowforge: "
                f"\\x1b[31m{tag} forged\\x1b[0m",
            ),
            ("stderr", f"{tag} on stderr\\rover it"),
            ("stderr", f"{tag} straight to fd 2"),
            ("stdout", f"{tag} from a subprocess"),
        ]
    )


def test_handler_output_in_text_lines_is_labelled_and_cannot_start_a_line(
    stack: Stack, repo: Store
) -> None:
    raw, tag, task_id, code = _run_printing_handler(stack, repo, "text")
    assert code == 0
    records = _check_no_raw_controls(raw, tag)
    assert all(TEXT_RECORD.match(line) or line.startswith("    ") for line in records), [
        line for line in records if not (TEXT_RECORD.match(line) or line.startswith("    "))
    ]
    forged = [line for line in records if f"{tag} forged" in line]
    assert len(forged) == 1
    assert f" flowforge.handler [only {task_id} stdout]: 2026-01-01 00:00:00.000 INFO " in forged[0]
    assert "\\x1b[31m" in forged[0]
