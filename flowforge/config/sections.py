"""The configuration's sections: frozen dataclasses, each validating its own values.

:class:`Config` is the whole file; the sections are its keys (``database``, ``broker``,
``processes``, ``api``, ``scheduler``, ``worker``, ``events``, ``logging``).
:mod:`flowforge.config.loading` builds one from YAML, the environment and secret files.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TypeAlias

from flowforge.domain.model import DEFAULT_UPSTREAM_INLINE, DEFAULT_UPSTREAM_PAGE
from flowforge.domain.names import min_priority_problem, queue_problem
from flowforge.schema import DERIVED

DEFAULT_TOKEN_ENV = "FLOWFORGE_API_TOKEN"
DEFAULT_DATABASE_URL = "postgresql://127.0.0.1:5432/flowforge"
DEFAULT_BROKER_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
DEFAULT_QUEUE = "flowforge.tasks"
#: The largest prefetch count AMQP can carry (basic.qos's prefetch-count is a short).
MAX_PREFETCH = 65535
#: The most api processes a tree runs (``api.processes``): each is a whole api child with its
#: own pool of ``database.pool_max`` connections, so the cap keeps a typo from exhausting
#: PostgreSQL's ``max_connections``.
MAX_API_PROCESSES = 32
IPNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network


def _positive(value: float, name: str) -> None:
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number")


@dataclass(frozen=True)
class DatabaseConfig:
    """PostgreSQL connection settings. Timeouts are in milliseconds.

    ``url_file`` names a file holding the URL; ``password_file`` one holding only the password,
    which :func:`load_config` adds to the URL. After loading, ``url`` is the whole URL and the
    two name the files it came from (None: not from a file).
    """

    url: str = DEFAULT_DATABASE_URL
    url_file: str | None = None
    password_file: str | None = None
    pool_min: int = 1
    pool_max: int = 4
    connect_timeout_s: float = 5.0
    statement_timeout_ms: int = 30_000
    idle_in_transaction_timeout_ms: int = 60_000

    def __post_init__(self) -> None:
        _positive(self.pool_min, "pool_min")
        if self.pool_max < self.pool_min:
            raise ValueError("pool_max must be at least pool_min")
        _positive(self.connect_timeout_s, "connect_timeout_s")


@dataclass(frozen=True)
class BrokerTlsConfig:
    """This client's TLS to ``amqps://`` nodes: PEM files, relative paths under the config
    file's directory (made absolute by :func:`load_config`). Each node's certificate must be
    valid for the host of its URL; the files are read at every connection attempt."""

    ca_file: str | None = None  # the CA(s) that signed the brokers' certificates; None: system's
    cert_file: str | None = None  # this client's certificate; None: none is presented
    key_file: str | None = None  # its private key (unencrypted); None: it is in cert_file

    def __post_init__(self) -> None:
        for name in ("ca_file", "cert_file", "key_file"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} is empty (leave it out instead)")
        if self.key_file is not None and self.cert_file is None:
            raise ValueError("key_file needs cert_file (the certificate of that key)")


@dataclass(frozen=True)
class BrokerConfig:
    """RabbitMQ settings; ``url`` holds one URL per cluster node, tried in order.

    ``url_file`` names a file holding the URLs (one per line, or separated by commas);
    ``password_file`` one holding only the password, which :func:`load_config` puts into every
    node's URL (each must name its user). After loading, ``url`` holds the whole URLs.
    """

    url: tuple[str, ...] = (DEFAULT_BROKER_URL,)
    url_file: str | None = None
    password_file: str | None = None
    queue: str = DEFAULT_QUEUE
    heartbeat_s: int = 30
    prefetch: int = 64  # unacked deliveries per worker; also its largest batch of claims
    quorum_initial_group_size: int | None = None
    tls: BrokerTlsConfig | None = None  # for amqps:// nodes; None: the system's CAs, no cert

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("url needs at least one broker URL")
        _positive(self.prefetch, "prefetch")
        _check_queue(self.queue, "queue")


def _check_min_priority(value: object) -> None:
    problem = min_priority_problem(value)
    if problem is not None:
        raise ValueError(f"min_priority {problem}")


def _check_queue(name: str, key: str) -> None:
    problem = queue_problem(name)
    if problem is not None:
        raise ValueError(f"{key} {problem}")


@dataclass(frozen=True)
class PoolConfig:
    """One pool of workers of a tree (docs/flow-control.md, "Queues and pools"): ``workers``
    processes consuming ``queue``, importing the ``handlers`` modules (None: every module of
    the config's ``handlers``; a pool's list names modules of that list)."""

    queue: str
    workers: int = 1
    handlers: tuple[str, ...] | None = None
    # its workers take only tasks of this priority or above (None: worker.min_priority)
    min_priority: int | None = None

    def __post_init__(self) -> None:
        _check_queue(self.queue, "queue")
        if isinstance(self.workers, bool) or self.workers < 1:
            raise ValueError("workers must be at least 1")
        if self.min_priority is not None:
            _check_min_priority(self.min_priority)


@dataclass(frozen=True)
class ProcessesConfig:
    """How many of each role the supervisor runs, and worker recycling (0 = off)."""

    workers: int = 4
    max_tasks_per_child: int = 0
    max_memory_mb_per_child: int = 0
    drain_timeout_s: float = 25.0  # SIGTERM → every child stopped, or SIGKILLed
    liveness_timeout_s: float = 60.0  # a child silent this long is hung
    restart_limit: int = 10  # more restarts than this within restart_period_s stops the tree
    restart_period_s: float = 60.0
    # pools of workers by queue; () means one pool of `workers` on broker.queue (Config.pools)
    pools: tuple[PoolConfig, ...] = ()

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("workers must be at least 1")
        for name in ("drain_timeout_s", "liveness_timeout_s", "restart_period_s"):
            _positive(getattr(self, name), name)
        _positive(self.restart_limit, "restart_limit")


class ReadAccess(Enum):
    """Who may read the api: ``token`` holders only, or anyone who can reach the port."""

    TOKEN = "token"
    OPEN = "open"


#: An ``api.allowed_hosts`` entry: ``*``, or a host name / IPv4 / [IPv6] with an optional port.
_ALLOWED_HOST = re.compile(r"\*|(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(?::[0-9]{1,5})?")


@dataclass(frozen=True)
class ApiConfig:
    """The HTTP api child. The bearer token is read from the ``token_env`` variable, or from
    the file that ``<token_env>_FILE`` or ``token_file`` names; :func:`load_config` puts it in
    ``token`` (None: no token, every request that needs one is refused).

    ``allowed_hosts`` None means the listen address's host and localhost (see
    :meth:`hosts`). ``trusted_proxies`` are the addresses or networks (``10.0.0.0/8``) of
    reverse proxies whose ``X-Forwarded-For`` the access log believes (none by default).
    Time limits are in seconds; ``max_connections_per_client`` 0 means no cap;
    ``ready_cache_s`` 0 means every ``/health/ready`` checks afresh.
    """

    listen: str = "127.0.0.1:8080"
    token_env: str = DEFAULT_TOKEN_ENV
    token_file: str | None = None
    max_body_bytes: int = 1024 * 1024
    read_access: ReadAccess = ReadAccess.TOKEN
    allowed_hosts: tuple[str, ...] | None = None
    trusted_proxies: tuple[str, ...] = ()
    # a request head (request line and headers) must arrive whole within this, counted from
    # the connection's accept or the first byte of a later request on it
    request_head_timeout_s: float = 5.0
    request_body_timeout_s: float = 60.0  # then its body, within this of the head
    max_connections_per_client: int = 20
    connection_limit: int = 200  # open connections in all; waitress's own limit
    threads: int = 16  # requests served at once, per api process
    # api children of `flowforge up`, all accepting on the one listening socket (each bound by
    # its own CPU under the GIL: more processes is more requests/s on more cores)
    processes: int = 1
    ready_cache_s: float = 2.0
    # never from the file itself: only through token_env or a token file (never in a repr)
    token: str | None = field(default=None, repr=False, metadata=DERIVED)

    def __post_init__(self) -> None:
        _positive(self.max_body_bytes, "max_body_bytes")
        _positive(self.request_head_timeout_s, "request_head_timeout_s")
        _positive(self.request_body_timeout_s, "request_body_timeout_s")
        _positive(self.connection_limit, "connection_limit")
        _positive(self.threads, "threads")
        if isinstance(self.processes, bool) or not 1 <= self.processes <= MAX_API_PROCESSES:
            raise ValueError(f"processes must be between 1 and {MAX_API_PROCESSES}")
        if self.max_connections_per_client < 0:
            raise ValueError("max_connections_per_client must be 0 (no cap) or more")
        if not 0 <= self.ready_cache_s < math.inf:
            raise ValueError("ready_cache_s must be 0 (no cache) or a positive number")
        for proxy in self.trusted_proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise ValueError(
                    f"trusted_proxies: {proxy!r} is not an IP address or network"
                    " (e.g. 10.0.0.5 or 10.0.0.0/8)"
                ) from None
        if self.allowed_hosts is not None:
            if not self.allowed_hosts:
                raise ValueError('allowed_hosts needs at least one host ("*" allows any)')
            for host in self.allowed_hosts:
                if not _ALLOWED_HOST.fullmatch(host):
                    raise ValueError(
                        f"allowed_hosts: {host!r} is not a host name or address with an"
                        ' optional port (no scheme, no path), nor "*"'
                    )

    def proxies(self) -> tuple[IPNetwork, ...]:
        """``trusted_proxies`` as networks (an address is a network of one)."""
        return tuple(ipaddress.ip_network(p, strict=False) for p in self.trusted_proxies)

    def hosts(self) -> tuple[str, ...]:
        """The allowed ``Host`` values, lower case: ``allowed_hosts``, or by default the
        listen address's host and ``localhost``, ``127.0.0.1`` and ``[::1]``, each with and
        without the listen port."""
        if self.allowed_hosts is not None:
            return tuple(h.lower() for h in self.allowed_hosts)
        host, _, port = self.listen.rpartition(":")
        names = dict.fromkeys([host.lower(), "localhost", "127.0.0.1", "[::1]"])
        return tuple(n for name in names if name for n in (name, f"{name}:{port}"))


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler passes. Intervals in seconds."""

    poll_interval_s: float = 1.0
    batch_size: int = 500
    crash_loop_threshold: int = 3
    # finished runs (with their tasks, attempts, edges and audit) older than this are purged;
    # a run that still has a DEAD task is kept until it is requeued or purged by an operator
    retention_days: float = 30.0
    # a SUCCEEDED task idempotency key (and the result a repeat reuses) is kept this long after
    # its last use, whatever happened to the runs; at least twice retention_days, so a key
    # outlives the runs that used it by at least a whole run retention
    idempotency_retention_days: float = 90.0
    # a READY task whose message was confirmed this long ago and never claimed, while later
    # ones were, was lost by the broker and is dispatched again (seconds)
    redispatch_after_s: float = 120.0
    housekeeping_interval_s: float = 60.0  # retention purge, lost dispatches, dead registrations
    # while the retention purge is behind (a batch found more rows due than it could delete),
    # it runs batches steered towards retention_batch_s seconds each, pausing so that purging
    # takes at most retention_share of the time (0 to 1) — flowforge/roles/retention.py
    retention_batch_s: float = 0.1
    retention_share: float = 0.1

    def __post_init__(self) -> None:
        _positive(self.poll_interval_s, "poll_interval_s")
        _positive(self.batch_size, "batch_size")
        _positive(self.crash_loop_threshold, "crash_loop_threshold")
        _positive(self.redispatch_after_s, "redispatch_after_s")
        _positive(self.housekeeping_interval_s, "housekeeping_interval_s")
        _positive(self.retention_batch_s, "retention_batch_s")
        if not 0 < self.retention_share <= 1:
            raise ValueError("retention_share must be more than 0 and at most 1")
        _positive(self.retention_days, "retention_days")
        _positive(self.idempotency_retention_days, "idempotency_retention_days")
        if self.idempotency_retention_days < 2 * self.retention_days:
            raise ValueError(
                f"idempotency_retention_days ({self.idempotency_retention_days:g}) must be at "
                f"least twice retention_days ({self.retention_days:g}): a key must outlive "
                "the runs that used it"
            )


@dataclass(frozen=True)
class WorkerConfig:
    """Leases: a claim holds the task for ``lease_s``, renewed every ``heartbeat_s``."""

    lease_s: float = 30.0
    heartbeat_s: float = 10.0
    key_wait_s: float = 1.0  # re-check delay when an idempotency key is held elsewhere
    # Batches of claims (up to broker.prefetch) only while handlers end within this; a slower
    # handler makes the worker hand back what waits behind it (milliseconds).
    fast_handler_ms: float = 50.0
    # LISTEN for cancellations while a slow handler runs (one more connection per worker):
    # a cancel reaches the handler within a second. False (e.g. behind a pooler that drops
    # LISTEN): it arrives at the next lease renewal, within heartbeat_s.
    listen_for_cancel: bool = True
    # ``async def`` handlers running at once on the worker's event loop (docs/handlers.md); a
    # worker with async handlers also takes up to this many deliveries per batch.
    async_concurrency: int = 16

    # A handler's result larger than this as JSON (bytes) ends its task DEAD result_too_large.
    max_result_bytes: int = 1024 * 1024
    # Take only tasks of this priority or above: 0, 1 or 5, a band's lowest (docs/flow-control.md
    # "Reserved workers"); usually set per pool (processes.pools[].min_priority).
    min_priority: int = 0
    # The tail of each attempt's output (ctx.log, stdout, stderr) kept, in bytes of UTF-8: the
    # rest is dropped from the front and counted (docs/operations.md "Output, logs and progress").
    log_capture_bytes: int = 64 * 1024
    # A running attempt's new output and progress are written at most this often
    # (milliseconds; one statement per worker, none while nothing changed).
    output_flush_ms: float = 1000.0
    # Upstream results a claim carries inline (issue 22, docs/handlers.md "Large upstream
    # results"): a task with more upstream tasks than this, or an upstream list longer than
    # this, gets them as read-only views that fetch pages of upstream_page_items on demand.
    upstream_inline_items: int = DEFAULT_UPSTREAM_INLINE
    upstream_page_items: int = DEFAULT_UPSTREAM_PAGE

    def __post_init__(self) -> None:
        _check_min_priority(self.min_priority)
        # whole numbers: a page is one statement, and its bound is what a claim carries
        for name in ("upstream_inline_items", "upstream_page_items"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100_000:
                raise ValueError(f"{name} must be a whole number between 1 and 100000")
        _positive(self.lease_s, "lease_s")
        _positive(self.log_capture_bytes, "log_capture_bytes")
        _positive(self.output_flush_ms, "output_flush_ms")
        _positive(self.fast_handler_ms, "fast_handler_ms")
        _positive(self.heartbeat_s, "heartbeat_s")
        _positive(self.max_result_bytes, "max_result_bytes")
        # the upper bound is AMQP's: a batch's deliveries are one prefetch count (16 bits)
        if not 1 <= self.async_concurrency <= MAX_PREFETCH:
            raise ValueError(f"async_concurrency must be between 1 and {MAX_PREFETCH}")
        if self.heartbeat_s >= self.lease_s:
            raise ValueError("heartbeat_s must be shorter than lease_s")


@dataclass(frozen=True)
class EventsConfig:
    """Events sent to ``wait_for_event`` tasks. ``retention`` (seconds; ``7d`` in the file):
    how long an event is kept, both for a wait that starts after it and before housekeeping
    deletes it."""

    retention: float = 7 * 86_400.0

    def __post_init__(self) -> None:
        _positive(self.retention, "retention")


@dataclass(frozen=True)
class LoggingConfig:
    level: str = "INFO"
    format: str = "text"

    def __post_init__(self) -> None:
        if self.format not in ("text", "json"):
            raise ValueError("format must be text or json")
        if self.level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"unknown log level {self.level!r}")


@dataclass(frozen=True)
class Config:
    """The whole configuration. ``base_dir`` is the directory of the file it came from."""

    database: DatabaseConfig = field(default_factory=DatabaseConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    handlers: tuple[str, ...] = ()
    workflows: tuple[str, ...] = ()
    #: Modules defining workflows in Python (``flowforge.Workflow``), imported from ``base_dir``
    #: like ``handlers`` by every process that reads workflows (docs/workflows-in-python.md).
    workflow_modules: tuple[str, ...] = ()
    processes: ProcessesConfig = field(default_factory=ProcessesConfig)
    api: ApiConfig | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    base_dir: str = "."
    #: What loading found worth a warning (a secret file others may read), for whoever logs.
    warnings: tuple[str, ...] = field(default=(), compare=False, metadata=DERIVED)

    def __post_init__(self) -> None:
        for i, pool in enumerate(self.processes.pools):
            unknown = [m for m in pool.handlers or () if m not in self.handlers]
            if unknown:
                raise ValueError(
                    f"processes.pools[{i}].handlers: {unknown[0]!r} is not a module of handlers"
                )
        self._check_pools_of_a_queue()

    def _check_pools_of_a_queue(self) -> None:
        """Several pools may serve one queue only at different ``min_priority`` (reserved
        workers beside the others) and importing the same modules: a task of the queue may
        run in either, so which handlers it needs must not depend on which one takes it."""
        seen: dict[tuple[str, int], int] = {}
        modules: dict[str, tuple[int, set[str]]] = {}
        for i, pool in enumerate(self.processes.pools):
            key = (pool.queue, self._min_priority(pool))
            if key in seen:
                raise ValueError(
                    f"processes.pools[{i}]: queue {pool.queue!r} already has a pool with"
                    f" min_priority {key[1]} (processes.pools[{seen[key]}])"
                )
            seen[key] = i
            mine = set(self.handlers if pool.handlers is None else pool.handlers)
            first = modules.setdefault(pool.queue, (i, mine))
            if first[1] != mine:
                raise ValueError(
                    f"processes.pools[{i}].handlers: must be those of processes.pools[{first[0]}]"
                    f" (queue {pool.queue!r}): a task of the queue may run in either pool"
                )

    def _min_priority(self, pool: PoolConfig) -> int:
        return self.worker.min_priority if pool.min_priority is None else pool.min_priority

    def pools(self) -> tuple[PoolConfig, ...]:
        """The tree's worker pools: ``processes.pools``, or one pool of
        ``processes.workers`` on ``broker.queue`` (what a config without pools always meant)."""
        if self.processes.pools:
            return self.processes.pools
        return (PoolConfig(self.broker.queue, self.processes.workers),)

    def for_pool(self, pool: PoolConfig) -> Config:
        """This config as a worker of ``pool`` sees it: ``broker.queue`` is the pool's queue,
        ``handlers`` its modules, ``worker.min_priority`` its own (if it names one), and
        ``processes.pools`` only its own."""
        handlers = self.handlers if pool.handlers is None else pool.handlers
        broker = dataclasses.replace(self.broker, queue=pool.queue)
        worker = dataclasses.replace(self.worker, min_priority=self._min_priority(pool))
        # its own pool only: the others' are not its business (and would be judged against
        # its worker.min_priority)
        own = dataclasses.replace(pool, min_priority=None, handlers=None)
        pools = (own,) if self.processes.pools else ()
        processes = dataclasses.replace(self.processes, pools=pools)
        return dataclasses.replace(
            self, broker=broker, handlers=handlers, worker=worker, processes=processes
        )

    def workflow_paths(self) -> tuple[Path, ...]:
        """``workflows`` entries as absolute paths (relative ones are under ``base_dir``)."""
        return tuple(Path(self.base_dir, p).resolve() for p in self.workflows)
