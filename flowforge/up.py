"""``flowforge up``: the one bridge between FlowForge and the generic supervisor.

It turns the config into child specs — scheduler, workers, publisher and the api — and runs the
supervisor in the current process. Nothing here opens a connection or imports handler code or a
workflow file: each child does that itself after the fork, so a child forked by SIGHUP's rolling
restart loads them afresh. The one thing made here is the api's listening socket, bound before
the first fork and inherited by every api child (flowforge/api/listener.py).
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import logging
import os
import socket
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from flowforge import distversions
from flowforge.api.listener import bind_listener
from flowforge.broker import quiet_pika_logs
from flowforge.config import Config, log_warnings, redact_url
from flowforge.errors import BootError
from flowforge.telemetry import METRICS_DIR_ENV
from supervisor import exitcodes, logs, residency
from supervisor.child import ChildContext
from supervisor.restart import IntensityLimit
from supervisor.spec import ChildSpec, Restart
from supervisor.tree import Supervisor

logger = logging.getLogger(__name__)

TITLE_PREFIX = "flowforge"
#: Graceful stop of the scheduler, the publisher and the api (seconds): each finishes its
#: pass, the api its requests.
ROLE_SHUTDOWN_S = 10.0
#: SIGHUP replaces the children that hold handler code or workflow definitions in this order:
#: the code first, then what plans runs from the definitions, then what triggers them — so
#: a task of a new definition finds a worker with its handler. The publisher holds neither
#: and is not replaced.
ROLL_WORKERS, ROLL_SCHEDULER, ROLL_API = 0, 1, 2


def _role(
    name: str, config: Config, listener: socket.socket | None = None
) -> Callable[[ChildContext], int]:
    def target(ctx: ChildContext) -> int:
        from flowforge.boot import Given, run

        serve = listener if name == "api" else None
        if listener is not None and serve is None:
            listener.close()  # only an api child accepts on the port: no other holds it open
        given = Given(ctx.tree_readiness, serve)
        return run(name, config, beat=ctx.beat, ready=ctx.ready, given=given)

    return target


def pool_name(index: int, config: Config) -> str:
    """The child name of a worker pool (``config``: as its workers see it, ``Config.for_pool``):
    ``worker`` for the first (the only one of a config without ``processes.pools``, so its
    children keep their names), ``worker:QUEUE`` for the others, ``worker:QUEUE:pN`` for one
    reserved for priorities N and above."""
    if index == 0:
        return "worker"
    low = config.worker.min_priority
    return f"worker:{config.broker.queue}" + (f":p{low}" if low else "")


def build_specs(config: Config, listener: socket.socket | None = None) -> list[ChildSpec]:
    """The tree: stop order scheduler (0) → workers (1) → publisher (2) → api (3). Each
    worker pool is a spec of its own, whose children get the config as a worker of that pool
    sees it (:meth:`~flowforge.config.Config.for_pool`: its queue, its handler modules).
    SIGHUP replaces the workers, then the scheduler, then the api (``ROLL_*``).
    ``listener``: the api's listening socket (:func:`bind_listener`), served by every api
    child (``api.processes`` of them) and closed by every other child."""
    p = config.processes

    def role(name: str, stop_group: int, **more: Any) -> ChildSpec:
        return ChildSpec(
            more.pop("child_name", name),
            _role(name, more.pop("config", config), listener),
            restart=Restart.PERMANENT,
            shutdown_timeout_s=more.pop("shutdown_timeout_s", ROLE_SHUTDOWN_S),
            stop_group=stop_group,
            liveness_timeout_s=p.liveness_timeout_s,
            **more,
        )

    pools = [
        role(
            "worker",
            1,
            child_name=pool_name(i, seen),
            config=seen,
            count=pool.workers,
            shutdown_timeout_s=p.drain_timeout_s,
            scalable=True,
            rolling=True,
            roll_order=ROLL_WORKERS,
        )
        for i, (pool, seen) in enumerate((pool, config.for_pool(pool)) for pool in config.pools())
    ]
    scheduler = role("scheduler", 0, rolling=True, roll_order=ROLL_SCHEDULER)
    specs = [scheduler, *pools, role("publisher", 2)]
    if config.api is not None:
        # api.processes children accept on the one socket: the kernel hands each connection to
        # one of them; one that dies is restarted while the others serve on
        specs.append(role("api", 3, count=config.api.processes, rolling=True, roll_order=ROLL_API))
    return specs


def _child_setup(config: Config) -> Callable[[str], None]:
    def setup(label: str) -> None:
        logs.configure(label, config.logging.format, config.logging.level)
        quiet_pika_logs()
        faulthandler.enable()  # a hung child's SIGABRT prints where it was stuck

    return setup


def run(config: Config, config_label: str) -> int:
    """Run the whole tree in this process until it is stopped; return the exit code. An api
    address that cannot be bound is one line on stderr and exit 3 (a role cannot boot),
    before anything is started."""
    from supervisor.titles import set_title

    try:
        listener = None if config.api is None else bind_listener(config.api.listen)
    except BootError as exc:
        sys.stderr.write(f"flowforge: {exc}\n")
        return exitcodes.BOOT_FAILED
    with (
        contextlib.closing(listener) if listener is not None else contextlib.nullcontext(),
        tempfile.TemporaryDirectory(prefix="flowforge-metrics-") as metrics_dir,
    ):
        # Before the first fork: every process of the tree writes its samples here.
        os.environ[METRICS_DIR_ENV] = metrics_dir
        logs.configure("supervisor", config.logging.format, config.logging.level)
        faulthandler.enable()  # a watchdog's SIGABRT (systemd) prints where the loop was stuck
        set_title(f"{TITLE_PREFIX}: supervisor [{config_label}]")
        log_warnings(config)
        preload_driver()
        return _supervise(config, listener)


def preload_driver() -> None:
    """Load the database driver, which every child uses, once here before the first fork.

    A child then inherits psycopg with its bundled libpq and OpenSSL already loaded: the library
    pages that loading touches stay with the supervisor, and the import's garbage never enters a
    child. Measured on a tree of four workers: about 5 MiB less resident memory per child and
    some 30 MiB less for the tree, though the supervisor grows by 15 MiB (docs/performance.md,
    "Memory"). Importing opens nothing; every connection is still made after the fork.

    psycopg's version modules are served without ``importlib.metadata`` (flowforge/
    distversions.py: 7.4 MiB of the tree), and the ``idna`` codec, which pika's connection to
    the broker loads to resolve its host name in every child but the scheduler, is loaded here
    once (1 MiB of the tree).
    """
    distversions.install()
    importlib.import_module("psycopg")
    importlib.import_module("encodings.idna")


def banner(config: Config) -> str:
    """What ``flowforge up`` runs and where it connects; passwords are never shown."""
    api = f"api on http://{config.api.listen}" if config.api else "no api"
    if config.api is not None and config.api.processes > 1:
        api += f" ({config.api.processes} processes)"
    nodes = ", ".join(redact_url(u) for u in config.broker.url)
    pools = config.pools()
    workers = sum(pool.workers for pool in pools)
    queues = ", ".join(f"{pool.queue}: {pool.workers}" for pool in pools)
    line = (
        f"(queue {config.broker.queue})"
        if not config.processes.pools
        else f"(triggers to {config.broker.queue}; workers on {queues})"
    )
    return (
        f"flowforge up: 1 scheduler, 1 publisher, {workers} worker(s); {api}\n"
        f"  database {redact_url(config.database.url)}\n"
        f"  broker   {nodes} {line}\n"
    )


def give_back_start_up_pages(_readiness: object) -> None:
    """Every child is ready: unmap the library pages the supervisor touched while importing
    what its children use (OpenSSL's and libpq's start-up, :func:`preload_driver`), which it
    does not run again and no child inherited (supervisor/residency.py; docs/performance.md,
    "The tree under 250 MB again"). Called from the supervisor's loop, its one thread."""
    dropped = residency.drop_file_pages()
    logger.debug(
        "gave back %d kB of start-up pages", dropped, extra={"action": "start_up_pages_dropped"}
    )


def _supervise(config: Config, listener: socket.socket | None) -> int:
    specs = build_specs(config, listener)
    sys.stdout.write(banner(config))
    sys.stdout.flush()
    supervisor = Supervisor(
        specs,
        title_prefix=TITLE_PREFIX,
        intensity=IntensityLimit(config.processes.restart_limit, config.processes.restart_period_s),
        drain_timeout_s=config.processes.drain_timeout_s,
        child_setup=_child_setup(config),
        on_ready=give_back_start_up_pages,
    )
    return supervisor.run()
