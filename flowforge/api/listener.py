"""The api's listening socket, made once by ``flowforge up`` and shared by every api child.

SIGHUP replaces the api child like the others: a new one boots and is ready before the old one
stops (supervisor/tree.py). Both must accept on the same address at once, so neither binds it:
``flowforge up`` binds it before the first fork and every api child serves the socket it
inherits (gunicorn's model). A connection is then never refused during a reload: the kernel
keeps one accept queue, and whichever api child accepts first serves it; the old child stops
accepting and finishes its requests (:meth:`~flowforge.api.server.ApiServer.loop`). A bind
error (the port taken, an address not of this host) is reported when ``flowforge up`` starts,
in one line, before anything is forked.

Only the socket module here: the supervisor imports this, and the api's web stack (waitress,
falcon) must stay out of the supervisor and so out of every child it forks.
``flowforge role api`` binds by itself (waitress), as a lone process needs nothing shared.
"""

from __future__ import annotations

import socket

from flowforge.errors import BootError

#: The accept queue's length: waitress's own default (each api child listens with it too).
BACKLOG = 1024


def parse_listen(listen: str) -> tuple[str, int]:
    """``api.listen`` as (host, port); :class:`BootError` if it is not ``HOST:PORT``."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise BootError(f"api.listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def bind_listener(listen: str) -> socket.socket:
    """A TCP socket bound to ``listen`` (``HOST:PORT``) and listening, as waitress would bind
    it: the first address the name resolves to, ``SO_REUSEADDR``, IPv6 only on an IPv6
    address. :class:`BootError` (one line: the address and the system's words) if it cannot
    be bound."""
    host, port = parse_listen(listen)
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(
            host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, socket.IPPROTO_TCP, socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise BootError(f"api cannot listen on {listen}: {exc.strerror}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # waitress's choice: "::" is not 0.0.0.0 too
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise BootError(f"api cannot listen on {listen}: {exc.strerror}") from exc
    return sock
