"""A private RabbitMQ node with its own epmd, Erlang cookie, config and directories.

AMQP listens on 127.0.0.1 only; the ``/usr/sbin/rabbitmq*`` wrappers are avoided on purpose
(they switch to the shared HOME, so the shared Erlang cookie, and write to the shared log), and
``/etc/rabbitmq`` is never read. Used by ``flowforge dev`` and by the test harness.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import string
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from flowforge.devservices.procs import (
    COMMAND_TIMEOUT_S,
    KILL_WAIT_S,
    LOOPBACK,
    POLL_INTERVAL_S,
    Account,
    ServiceError,
    check_traversable,
    descendants,
    ensure_base_dir,
    ensure_ports_free,
    kill_and_wait,
    make_dirs,
    pid_alive,
    port_accepts,
    port_in_use,
    proc_cmdline,
    process_env,
    read_pid_file,
    reap_descendants,
    require_executables,
    run_command,
    service_account,
    spawn_detached,
    tail,
    wait_ports_free,
    wait_until,
    which,
    write_file,
)

logger = logging.getLogger(__name__)

RABBIT_BIN_DIR = Path("/usr/lib/rabbitmq/bin")
RABBIT_PACKAGE = "rabbitmq-server"
RABBIT_USER = "rabbitmq"
EPMD_NAME = "epmd"
ERL_DIST_LOOPBACK_ARGS = "-kernel inet_dist_use_interface {127,0,0,1}"
RABBIT_START_TIMEOUT_S = 120.0
RABBIT_STOP_TIMEOUT_S = 60.0
EPMD_START_TIMEOUT_S = 10.0
PID_FILE_ATTEMPTS = 5
DEFAULT_HEARTBEAT_S = 60
COOKIE_LENGTH = 32


class PrivateEpmd:
    """A foreground epmd on 127.0.0.1:``port`` (never the shared 4369).

    Erlang nodes register with, and look each other up in, the epmd on the port they are
    told (``ERL_EPMD_PORT``): a lone ``PrivateRabbitMQ`` runs one of its own, the nodes of
    a cluster share one. Addressed only by the pid it recorded in ``pid_file`` (checked to
    still be an epmd on ``port``); its output is appended to ``log_file``.
    """

    def __init__(self, port: int, pid_file: Path, log_file: Path) -> None:
        """Describe the daemon; nothing is started until ``start()``."""
        self.port = port
        self.pid_file = pid_file
        self.log_file = log_file
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"PrivateEpmd(port={self.port})"

    @property
    def pid(self) -> int | None:
        """Pid of this epmd (recorded in ``pid_file``) if it is alive, else None."""
        pid = read_pid_file(self.pid_file)
        if pid is None or not pid_alive(pid):
            return None
        argv = proc_cmdline(pid)
        if not argv or Path(argv[0]).name != EPMD_NAME or str(self.port) not in argv:
            return None
        return pid

    def start(self, env: Mapping[str, str] | None = None) -> None:
        """Run epmd as the rabbitmq account unless it already runs; wait for its port.

        ``env``: the daemon's environment (default: a minimal one). Raises ServiceError if
        the port is taken or epmd exits, after at most EPMD_START_TIMEOUT_S seconds.
        """
        if self.pid is not None:
            return
        account = service_account(RABBIT_USER, RABBIT_PACKAGE)
        ensure_ports_free({"epmd": self.port})
        argv: list[str | Path] = [
            which(EPMD_NAME, RABBIT_PACKAGE),
            "-port",
            str(self.port),
            "-address",
            LOOPBACK,
        ]
        proc = spawn_detached(
            argv,
            account,
            env=env if env is not None else process_env({}),
            cwd=self.pid_file.parent,
            log_path=self.log_file,
        )
        self._proc = proc
        self.pid_file.write_text(f"{proc.pid}\n")
        wait_until(
            lambda: port_in_use(self.port) or proc.poll() is not None,
            EPMD_START_TIMEOUT_S,
            f"epmd on port {self.port}",
        )
        if proc.poll() is not None:
            raise ServiceError(f"epmd exited with {proc.returncode}: {tail(self.log_file)}")

    def stop(self) -> None:
        """SIGTERM epmd by its recorded pid and wait; reap it if it is our child. Idempotent."""
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            if self._proc is not None and self._proc.pid == pid:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=KILL_WAIT_S)
            wait_until(lambda: not pid_alive(pid), KILL_WAIT_S, f"epmd {pid} to exit")
        self._proc = None
        self.pid_file.unlink(missing_ok=True)


class PrivateRabbitMQ:
    """A RabbitMQ node ``<node_name>@localhost`` under ``base_dir/rabbit-<node_name>/``.

    AMQP listens on 127.0.0.1:``amqp_port``, Erlang distribution on ``dist_port`` and a
    private epmd on ``epmd_port`` (default ``dist_port + 1``); the node has its own
    cookie (in its own HOME) and never reads /etc/rabbitmq. No plugins are enabled.
    Config changes (``set_consumer_timeout``) take effect on the next start.

    For a cluster (``tests.harness.cluster``) the nodes get one ``cookie`` and, with
    ``shared_epmd``, use an epmd on ``epmd_port`` that the caller runs.
    """

    def __init__(
        self,
        base_dir: Path,
        amqp_port: int,
        dist_port: int,
        node_name: str,
        *,
        epmd_port: int | None = None,
        consumer_timeout_ms: int | None = None,
        heartbeat_s: int = DEFAULT_HEARTBEAT_S,
        extra_config: Sequence[str] = (),
        bin_dir: Path = RABBIT_BIN_DIR,
        cookie: str | None = None,
        shared_epmd: bool = False,
    ) -> None:
        """Describe the node; nothing is created or started until ``start()``.

        ``consumer_timeout_ms``: rabbitmq.conf ``consumer_timeout`` (None = broker default).
        ``heartbeat_s``: server-suggested AMQP heartbeat in seconds.
        ``extra_config``: additional raw rabbitmq.conf lines, appended last.
        ``cookie``: the Erlang cookie (letters and digits; e.g. one shared by the nodes of a
        private cluster); None = a random one, made on the first start and kept.
        ``shared_epmd``: the epmd on ``epmd_port`` is run by the caller; this node neither
        starts nor stops one, and ``start()`` fails unless something listens there.
        """
        if cookie is not None and not (cookie.isascii() and cookie.isalnum()):
            raise ValueError("cookie must be a non-empty string of ASCII letters and digits")
        self.base_dir = Path(base_dir).absolute()
        self.amqp_port = amqp_port
        self.dist_port = dist_port
        self.epmd_port = epmd_port if epmd_port is not None else dist_port + 1
        self.node_name = node_name
        self.node = f"{node_name}@localhost"
        self.consumer_timeout_ms = consumer_timeout_ms
        self.heartbeat_s = heartbeat_s
        self.extra_config = list(extra_config)
        self.bin_dir = bin_dir
        self.root = self.base_dir / f"rabbit-{node_name}"
        self.home = self.root / "home"
        self.pid_file = self.root / "rabbit.pid"
        self.epmd_pid_file = self.root / "epmd.pid"
        self.config_file = self.root / "rabbitmq.conf"
        self.log_dir = self.root / "log"
        self.ports_file = self.root / "ports.json"
        self.cookie = cookie
        self.shared_epmd = shared_epmd
        self._epmd = PrivateEpmd(self.epmd_port, self.epmd_pid_file, self.log_dir / "epmd.log")

    def __repr__(self) -> str:
        return f"PrivateRabbitMQ(node={self.node!r}, amqp_port={self.amqp_port})"

    @property
    def url(self) -> str:
        """AMQP URL for the default vhost as ``guest`` (allowed from localhost only)."""
        return f"amqp://guest:guest@{LOOPBACK}:{self.amqp_port}/%2F"

    @property
    def pid(self) -> int | None:
        """Pid of this node's live beam.smp process, or None if it is not running."""
        pid = read_pid_file(self.pid_file)
        if pid is None or not self._is_our_beam(pid):
            return None
        return pid

    def is_running(self) -> bool:
        """True if this node's Erlang VM is alive (the broker may still be booting)."""
        return self.pid is not None

    def set_consumer_timeout(self, ms: int | None) -> None:
        """Set rabbitmq.conf ``consumer_timeout`` in milliseconds (None = broker default).

        Rewrites the private config file; takes effect on the next start/restart.
        """
        self.consumer_timeout_ms = ms
        if self.root.exists():
            self._write_config(service_account(RABBIT_USER, RABBIT_PACKAGE))

    def start(self) -> None:
        """Boot the node detached and wait until AMQP accepts connections.

        Idempotent. Blocks at most about RABBIT_START_TIMEOUT_S seconds (a boot
        typically takes 5-10 s; after a SIGKILL somewhat longer).
        """
        account = self.check_installed()
        if self.is_running():
            self._check_running_ports()
            logger.info("rabbitmq node %s already running", self.node)
        else:
            wait_ports_free({"AMQP": self.amqp_port, "Erlang distribution": self.dist_port})
            self._prepare(account)
            self._boot(account)
        wait_until(
            lambda: port_accepts(self.amqp_port),
            RABBIT_START_TIMEOUT_S,
            f"AMQP port {self.amqp_port}",
        )
        logger.info("rabbitmq ready on port %s (pid %s)", self.amqp_port, self.pid)

    def stop(self) -> None:
        """``rabbitmqctl stop <pidfile>`` (SIGKILL as fallback), then stop the private epmd.

        Bounded by about RABBIT_STOP_TIMEOUT_S seconds. No-op if nothing is running.
        """
        pid = self.pid
        if pid is not None:
            try:
                self.rabbitmqctl("stop", str(self.pid_file), timeout=RABBIT_STOP_TIMEOUT_S)
                wait_until(lambda: not pid_alive(pid), KILL_WAIT_S, f"beam {pid} to exit")
            except ServiceError as exc:
                logger.warning("graceful stop of %s failed (%s); SIGKILL", self.node, exc)
                self._kill_tree(pid)
        self.pid_file.unlink(missing_ok=True)
        if not self.shared_epmd:
            self._epmd.stop()
        logger.info("rabbitmq node %s stopped", self.node)

    def kill(self) -> None:
        """SIGKILL the beam.smp process (crash simulation) and wait for it to die.

        The private epmd keeps running so ``start()`` can follow. No-op if not running.
        """
        pid = self.pid
        if pid is None:
            logger.info("rabbitmq node %s not running; nothing to kill", self.node)
            return
        logger.info("SIGKILL rabbitmq beam %s", pid)
        self._kill_tree(pid)

    def _kill_tree(self, pid: int) -> None:
        """SIGKILL beam ``pid``, then wait for its helpers and its listening ports to go."""
        helpers = descendants(pid)  # erl_child_setup, inet_gethost, ...
        kill_and_wait(pid)
        reap_descendants(helpers)
        wait_ports_free({"AMQP": self.amqp_port, "Erlang distribution": self.dist_port})

    def restart(self) -> None:
        """``stop()`` then ``start()``."""
        self.stop()
        self.start()

    def rabbitmqctl(self, *args: str, timeout: float = COMMAND_TIMEOUT_S) -> str:
        """Run ``rabbitmqctl -n <node> *args`` against this node only; return stdout.

        Uses the private cookie and epmd. Raises ServiceError on failure or after
        ``timeout`` seconds.
        """
        ctl = self.bin_dir / "rabbitmqctl"
        require_executables([ctl], RABBIT_PACKAGE)
        account = service_account(RABBIT_USER, RABBIT_PACKAGE)
        argv: list[str | Path] = [ctl, "-n", self.node, *args]
        return run_command(argv, account, env=self._env(), cwd=self.root, timeout=timeout).stdout

    # -- internals --------------------------------------------------------------------

    def check_installed(self) -> Account:
        """Raise ServiceUnavailable if binaries or account are missing; return the account."""
        require_executables(
            [self.bin_dir / n for n in ("rabbitmq-server", "rabbitmqctl")], RABBIT_PACKAGE
        )
        which(EPMD_NAME, RABBIT_PACKAGE)
        return service_account(RABBIT_USER, RABBIT_PACKAGE)

    def _prepare(self, account: Account) -> None:
        """Create the private dirs, cookie (once) and config files."""
        ensure_base_dir(self.base_dir)
        make_dirs(
            account,
            self.root,
            self.home,
            self.log_dir,
            self.root / "mnesia",
            self.root / "conf.d",
        )
        check_traversable(self.root, account)
        self._write_cookie(account)
        self._write_config(account)
        for name, content in (
            ("advanced.config", "[].\n"),
            ("enabled_plugins", "[].\n"),
            ("rabbitmq-env.conf", ""),
        ):
            write_file(self.root / name, content, account)

    def _write_cookie(self, account: Account) -> None:
        """Create HOME/.erlang.cookie (mode 0400): ``cookie`` if given, else a random one
        made once and reused across restarts."""
        path = self.home / ".erlang.cookie"
        if self.cookie is None:
            if path.exists():
                return
            value = "".join(secrets.choice(string.ascii_uppercase) for _ in range(COOKIE_LENGTH))
        else:
            with contextlib.suppress(OSError):
                if path.read_text() == self.cookie:
                    return
            path.unlink(missing_ok=True)  # read-only (0400): replace rather than rewrite
            value = self.cookie
        write_file(path, value, account, 0o400)

    def _write_config(self, account: Account) -> None:
        """(Re)write the private rabbitmq.conf from the current settings."""
        lines = [
            f"listeners.tcp.default = {LOOPBACK}:{self.amqp_port}",
            "loopback_users.guest = true",
            f"heartbeat = {self.heartbeat_s}",
        ]
        if self.consumer_timeout_ms is not None:
            lines.append(f"consumer_timeout = {self.consumer_timeout_ms}")
        lines.extend(self.extra_config)
        write_file(self.config_file, "\n".join(lines) + "\n", account)

    def _env(self) -> dict[str, str]:
        """Environment for server and CLI: every path private, epmd private, no autostart."""
        no_epmd = "-start_epmd false"
        return process_env(
            {
                "HOME": str(self.home),
                "RABBITMQ_CONF_ENV_FILE": str(self.root / "rabbitmq-env.conf"),
                "RABBITMQ_NODENAME": self.node,
                "RABBITMQ_USE_LONGNAME": "false",
                "RABBITMQ_CONFIG_FILE": str(self.config_file),
                "RABBITMQ_CONFIG_FILES": str(self.root / "conf.d"),
                "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.root / "advanced.config"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.root / "enabled_plugins"),
                "RABBITMQ_MNESIA_BASE": str(self.root / "mnesia"),
                "RABBITMQ_LOG_BASE": str(self.log_dir),
                "RABBITMQ_PID_FILE": str(self.pid_file),
                "RABBITMQ_DIST_PORT": str(self.dist_port),
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": f"{ERL_DIST_LOOPBACK_ARGS} {no_epmd}",
                "RABBITMQ_CTL_ERL_ARGS": no_epmd,
                "ERL_EPMD_PORT": str(self.epmd_port),
                "ERL_EPMD_ADDRESS": LOOPBACK,
                "ERL_CRASH_DUMP": str(self.root / "erl_crash.dump"),
            }
        )

    def _is_our_beam(self, pid: int) -> bool:
        """True if ``pid`` is a live beam.smp whose ``-home`` is this node's private HOME."""
        if not pid_alive(pid):
            return False
        argv = proc_cmdline(pid)
        if not argv or "beam" not in Path(argv[0]).name:
            return False
        homes = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "-home"]
        return str(self.home) in homes

    def _ports(self) -> dict[str, int]:
        return {"amqp": self.amqp_port, "dist": self.dist_port, "epmd": self.epmd_port}

    def _check_running_ports(self) -> None:
        """Raise ServiceError if the running node was booted with other ports than ours.

        Prevents waiting on (and so connecting to) a port this node does not own.
        """
        try:
            booted = json.loads(self.ports_file.read_text())
        except (OSError, ValueError):
            booted = None
        if booted != self._ports():
            raise ServiceError(
                f"node {self.node} is already running with ports {booted}, "
                f"not {self._ports()}; stop it first"
            )

    def _boot(self, account: Account) -> None:
        """Start epmd if needed, run ``rabbitmq-server -detached`` and ``rabbitmqctl wait``."""
        self.pid_file.unlink(missing_ok=True)  # a stale pid would confuse `rabbitmqctl wait`
        if self.shared_epmd:
            if not port_in_use(self.epmd_port):
                raise ServiceError(f"no epmd listens on shared epmd port {self.epmd_port}")
        else:
            self._epmd.start(self._env())
        write_file(self.ports_file, json.dumps(self._ports()) + "\n", account)
        started = time.monotonic()
        server: list[str | Path] = [self.bin_dir / "rabbitmq-server", "-detached"]
        launcher = spawn_detached(
            server, account, env=self._env(), cwd=self.root, log_path=self.log_dir / "detached.log"
        )
        try:
            launcher.wait(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ServiceError("rabbitmq-server -detached did not return") from None
        # rabbitmq-server writes its pid file in pieces: `rabbitmqctl wait` that reads it too
        # early fails with garbage_in_pid_file instead of waiting, so wait for a whole pid first
        wait_until(
            lambda: read_pid_file(self.pid_file) is not None,
            RABBIT_START_TIMEOUT_S,
            f"{self.pid_file} to hold a pid",
        )
        for attempt in range(1, PID_FILE_ATTEMPTS + 1):
            try:
                self.rabbitmqctl(
                    "wait",
                    "--timeout",
                    str(int(RABBIT_START_TIMEOUT_S)),
                    str(self.pid_file),
                    timeout=RABBIT_START_TIMEOUT_S + 10,
                )
                break
            except ServiceError as exc:
                if "garbage_in_pid_file" in str(exc) and attempt < PID_FILE_ATTEMPTS:
                    time.sleep(POLL_INTERVAL_S)  # caught the pid file half-written: read again
                    continue
                log = tail(self.log_dir / f"{self.node}.log")
                raise ServiceError(f"{exc}; log: {log}") from None
        logger.info("rabbitmq node %s booted in %.1f s", self.node, time.monotonic() - started)
