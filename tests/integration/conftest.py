"""Fixtures of the integration tests: the api tests' (tests/api_client.py holds the client and
its helpers), and a connection listening on the roles' channels."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.api_client import TOKEN, Api, StartApi, serve_here
from tests.api_here import ApiHere
from tests.e2e import Stack
from tests.trees import Tree


@pytest.fixture
def api_here(api_stack: Stack) -> Iterator[StartApi]:
    """``start(token=TOKEN, **api)``: :func:`serve_here` on ``api_stack``, stopped at the end.
    For what the server does with requests; its process and log need ``start_api``."""
    started: list[ApiHere] = []

    def start(token: str | None = TOKEN, **api: Any) -> Api:
        found, server = serve_here(api_stack, token, **api)
        started.append(server)
        return found

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def api_stack(tmp_path: Path, clean_database_url: str, broker_url: str) -> Iterator[Stack]:
    """Role processes (and an api) for one test, on a fresh queue; all stopped at the end."""
    running = Stack(tmp_path, clean_database_url, broker_url)
    try:
        yield running
    finally:
        running.stop_all()
        running.delete_queue()


@pytest.fixture
def trees() -> Iterator[list[Tree]]:
    """The ``flowforge up`` trees a test starts (tests/trees.py), stopped at the end."""
    started: list[Tree] = []
    try:
        yield started
    finally:
        for tree in started:
            tree.stop()


@pytest.fixture
def listening(clean_database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection listening on the scheduler's and the publisher's channels (read what it
    heard with tests.helpers.heard)."""
    with psycopg.connect(clean_database_url, autocommit=True) as conn:
        conn.execute("LISTEN flowforge_outbox")
        conn.execute("LISTEN flowforge_scheduler")
        yield conn
