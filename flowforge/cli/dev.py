"""``flowforge dev [-c CONFIG]``: the laptop loop (docs/dev.md).

Private PostgreSQL and RabbitMQ for the project (or, with ``--use-config-urls``, the configured
ones), migrate, the tree, a reload of the workers whenever a source file changes; Ctrl-C or
SIGTERM stops the tree, then the services.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowforge.config import ENV_CONFIG, Config, load_config
from flowforge.errors import InputError
from flowforge.redact import redact_url
from flowforge.text import escape

if TYPE_CHECKING:  # imported where used: every other command parses this one's options only
    import threading

    from flowforge.devloop import StopSignals
    from flowforge.watch import WatchSet

#: The project's state directory, beside the config, unless ``--state-dir`` says otherwise.
STATE_DIR_NAME = ".flowforge-dev"
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.1, 10.0


def _port(text: str) -> int:
    if not text.isdigit() or not 1024 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"not a port from 1024 to 65535: {text!r}")
    return int(text)


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not MIN_INTERVAL_S <= value <= MAX_INTERVAL_S:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"not a number of seconds from {MIN_INTERVAL_S} to {MAX_INTERVAL_S}: {text!r}"
        )
    return value


def add_command(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register ``dev`` on the ``flowforge`` subcommands (``sub``)."""
    p = sub.add_parser(
        "dev",
        help="private services, migrate, the tree, and a reload on every code change",
        parents=[common],
    )
    p.set_defaults(handler=dev)
    p.add_argument(
        "--use-config-urls",
        action="store_true",
        help="use the configured database and broker; start no private services",
    )
    p.add_argument(
        "--state-dir", type=Path, default=None, help=f"default: {STATE_DIR_NAME}/ beside the config"
    )
    for name in ("pg", "amqp", "dist"):
        p.add_argument(
            f"--{name}-port", type=_port, default=None, help="default: as recorded, else a free one"
        )
    p.add_argument(
        "--watch",
        action="append",
        type=Path,
        default=[],
        help="also watch this file or folder (repeatable)",
    )
    p.add_argument(
        "--interval", type=_interval, default=0.5, help="seconds between scans (default 0.5)"
    )


def _say(text: str) -> None:
    sys.stderr.write(f"flowforge dev: {text}\n")
    sys.stderr.flush()


def _watch_set(config: Config, config_path: Path, state_dir: Path, extra: list[Path]) -> WatchSet:
    """The config, its folder (handler modules and workflows beside it), the workflow paths and
    whatever ``--watch`` named."""
    from flowforge.watch import WatchSet

    folder = config_path.parent
    paths = [p.absolute() for p in (*config.workflow_paths(), *extra)]
    outside = [p for p in paths if not p.is_relative_to(folder)]
    return WatchSet(
        files=(config_path, *(p for p in outside if not p.is_dir())),
        dirs=(folder, *(p for p in outside if p.is_dir())),
        excluded=(state_dir,),
    )


def dev(args: argparse.Namespace) -> int:
    import threading

    from flowforge.devloop import StopSignals, dev_token, install_stop_handlers, tree_environment

    path = getattr(args, "config", None) or os.environ.get(ENV_CONFIG)
    if not path:
        raise InputError("flowforge dev needs a config file: -c CONFIG (or $FLOWFORGE_CONFIG)")
    ports = (args.pg_port, args.amqp_port, args.dist_port)
    if args.use_config_urls and any(ports):
        raise InputError("--pg-port, --amqp-port and --dist-port are for the private services")
    config_path = Path(path).absolute()
    config = load_config(config_path)  # a bad config: one line, exit 2, nothing started
    state_dir = (args.state_dir or config_path.parent / STATE_DIR_NAME).absolute()
    wake = threading.Event()
    stops = StopSignals(wake=wake.set)
    restore = install_stop_handlers(stops)
    services = started = None
    try:
        if not args.use_config_urls:
            from flowforge.devservices.project import ProjectServices

            services = ProjectServices.for_project(state_dir, *ports)
        urls = (services.database_url, services.broker_url) if services else None
        token = None
        if config.api is not None and config.api.token is None:
            state_dir.mkdir(mode=0o755, exist_ok=True)
            token = (config.api.token_env, dev_token(state_dir))
        env = tree_environment(os.environ, urls, token)
        config = load_config(config_path, env=env)  # the tree's own view, refused before a start
        if services is not None:
            services.check_installed()
            _say(f"starting PostgreSQL and RabbitMQ in {escape(str(state_dir))}")
            started = services
            started.start()  # bounded; a stop meanwhile is acted on once they are up
        if stops.count:
            return 0
        return _run_tree(args, config, config_path, env, state_dir, stops, wake, token)
    finally:
        if started is not None:
            _say("stopping PostgreSQL and RabbitMQ")
            for failure in started.stop():
                _say(f"could not stop {escape(failure)}")
        restore()


def _run_tree(
    args: argparse.Namespace,
    config: Config,
    config_path: Path,
    env: dict[str, str],
    state_dir: Path,
    stops: StopSignals,
    wake: threading.Event,
    token: tuple[str, str] | None,
) -> int:
    import time

    from flowforge.devloop import DevLoop, TreeProcess, check_code
    from flowforge.store.migrate import migrate
    from flowforge.watch import Watcher, scan

    applied = migrate(config.database.url)
    _say(f"database {redact_url(config.database.url)} ({len(applied)} migration(s) applied)")
    _say(f"broker   {', '.join(redact_url(u) for u in config.broker.url)}")
    if config.api is not None:
        _say(f"dashboard http://{config.api.listen}/ui/")
        if token is not None:
            _say(f"api token (made for dev, in {escape(str(state_dir))}/api-token): {token[1]}")
    watched = _watch_set(config, config_path, state_dir, args.watch)
    watcher = Watcher(lambda: scan(watched), time.monotonic)

    def wait(seconds: float) -> None:
        wake.wait(seconds)
        wake.clear()

    loop = DevLoop(
        start_tree=lambda: TreeProcess(config_path, env),
        check=lambda: check_code(config_path, env),
        changes=watcher.poll,
        wait=wait,
        clock=time.monotonic,
        say=_say,
        stops=stops,
        config_path=config_path,
        drain_timeout_s=config.processes.drain_timeout_s,
        interval_s=args.interval,
    )
    _say(f"watching {len(scan(watched))} file(s); Ctrl-C stops the tree, then the services")
    return loop.run()
