"""``python -m flowforge.healthcheck [-c CONFIG] [--url URL]``: is this tree's api live?

The container image's ``HEALTHCHECK`` (the image has no curl): a GET of ``/health/live`` on the
api that the config (``-c``, else ``$FLOWFORGE_CONFIG``) describes, so the probe follows
``api.listen`` wherever the mounted config puts it. A wildcard listen address (``0.0.0.0``,
``[::]``) is probed on the loopback address of its family. ``--url`` probes that URL instead.

Exit 0 when the answer is 200; otherwise one line on stderr and exit 1 (Docker reserves exit 2
of a health check, so a bad config or one without an ``api`` section is 1 too).
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

from flowforge.config import load_config
from flowforge.errors import ConfigError

PATH = "/health/live"
DEFAULT_TIMEOUT_S = 3.0
#: A listen host that means "every address", and the loopback address that reaches it.
_LOOPBACK_FOR = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


class ProbeError(Exception):
    """Why the api is not known to be live (one line)."""


def live_url(listen: str) -> str:
    """The ``/health/live`` URL of an api listening on ``listen`` (``HOST:PORT``)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ProbeError(f"api.listen must be HOST:PORT, got {listen!r}")
    bare = host.strip("[]")
    bare = _LOOPBACK_FOR.get(bare, bare)
    shown = f"[{bare}]" if ":" in bare else bare
    return f"http://{shown}:{port}{PATH}"


def configured_url(config_path: str | None) -> str:
    """The probe URL for the config at ``config_path`` (None: ``$FLOWFORGE_CONFIG``)."""
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        raise ProbeError(" ".join(str(exc).split())) from exc
    if config.api is None:
        raise ProbeError("the config has no api section: nothing to probe")
    return live_url(config.api.listen)


def probe(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Return when ``url`` answers 200 within ``timeout_s`` seconds; else :class:`ProbeError`."""
    if not url.startswith(("http://", "https://")):
        raise ProbeError(f"{url}: not an http(s) URL")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError) as exc:  # refused, timed out, unresolvable, a bad URL
        reason = getattr(exc, "reason", exc)
        raise ProbeError(f"{url}: {reason}") from exc
    if status != 200:
        raise ProbeError(f"{url}: HTTP {status}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flowforge.healthcheck", description="Probe the api's /health/live."
    )
    parser.add_argument("-c", "--config", help="config file (default: $FLOWFORGE_CONFIG)")
    parser.add_argument("--url", help="probe this URL instead of the config's api")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds")
    args = parser.parse_args(argv)
    try:
        probe(args.url or configured_url(args.config), args.timeout)
    except ProbeError as exc:
        sys.stderr.write(f"flowforge healthcheck: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
