"""waitress, with its own error responses (oversized or malformed requests) as JSON too, and
defences against slow or flooding clients.

waitress answers some requests before the application sees them — a body above its limit, a
malformed request line — in plain text. FlowForge promises a JSON body for every error, so the
channel's error task is replaced by one that writes ``{"error": ...}``.

Such an answer is sent while the client may still be sending its body. Closing a socket with
unread input makes the kernel reset the connection, and the reset can destroy the answer before
the client reads it (a client uploading 2 MiB would see "connection reset", not 413). So after
an error the channel half-closes and reads (and drops) what is still coming until the client
closes, up to LINGER_MAX_BYTES; waitress's idle-channel maintenance ends a client that never
does.

Slow clients. waitress hands a connection to a thread only once its request is complete, so a
slow client costs no thread, but it holds one of ``connection_limit`` slots; waitress then stops
accepting, and its ``channel_timeout`` is an idle timeout that a client trickling a byte a
second never reaches. So, on top of waitress (all in its event-loop thread):

- a request head (request line and headers) must arrive whole within ``head_timeout_s`` of the
  accept, or of the first byte of a later request on a kept-alive connection, and its body
  within ``body_timeout_s`` of the head: past either the connection gets a JSON 408 and is
  closed;
- at ``per_client`` connections from one address, a new one from there makes room by closing
  one of that address's connections that wait for a request: an idle one (between requests)
  if any, else the one whose head has been arriving longest; if each of them is inside a
  request, the new one is answered 429;
- at the connection limit, the same among all connections, so a new one can be accepted
  (waitress stops accepting only when none waits).

A client that sends its request at once is never the one that has waited longest, so probes and
normal reads keep answering under a flood of slow connections. After an error answer the
half-closed wait is bounded in time too (LINGER_MAX_S), so a trickle cannot hold it open.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer
from waitress.task import ErrorTask

PAYLOAD_TOO_LARGE = 413
FRAMING_MARGIN = 64 * 1024  # bytes
#: After an error answer, at most this much of the rest of the request is read and dropped,
#: for at most this long.
LINGER_MAX_BYTES = 16 * 1024 * 1024
LINGER_MAX_S = 10.0
#: How often the deadlines are checked (waitress's maintenance interval; whole seconds).
MAINTENANCE_INTERVAL_S = 1
#: Connections closed by the defences are summed up in one log line at most this often.
REPORT_INTERVAL_S = 10.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientRules:
    """The slow-client defences (module docstring). Seconds; ``per_client`` 0 means no cap."""

    head_timeout_s: float = 5.0
    body_timeout_s: float = 60.0
    per_client: int = 0


class JsonErrorTask(ErrorTask):  # type: ignore[misc]
    def execute(self) -> None:
        error = self.request.error
        if error.code == PAYLOAD_TOO_LARGE:  # the same words as the application's own 413
            message = f"request body larger than {self.channel.server.body_limit} bytes"
        else:
            message = f"{error.reason}: {error.body}".strip(": ")
        body = json.dumps({"error": message}).encode()
        self.channel.linger = True
        self.status = f"{error.code} {error.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)


class JsonErrorChannel(HTTPChannel):  # type: ignore[misc]
    """A channel that closes gently after an error answer (see module docstring) and knows
    since when it has waited for a request head."""

    error_task_class = JsonErrorTask
    linger = False  # set by an error answer: the request may not have been read to its end
    _half_closed = False
    _half_closed_at = 0.0
    _dropped = 0
    #: When the head now awaited began (monotonic): the accept, or the first byte of a later
    #: request; None between requests and once the head is whole.
    head_started: float | None = None
    #: When the head of the request whose body is now arriving was whole (monotonic), or None.
    body_started: float | None = None

    def __init__(self, server: JsonErrorServer, sock: Any, addr: Any, adj: Any, map: Any) -> None:
        self.head_started = time.monotonic()
        super().__init__(server, sock, addr, adj, map=map)
        server.admit(self)

    @property
    def client(self) -> str:
        return str(self.addr[0]) if isinstance(self.addr, tuple) else str(self.addr)

    def received(self, data: bytes) -> bool:
        if data and self.head_started is None and self.request is None:
            self.head_started = time.monotonic()
        result = bool(super().received(data))
        if self.request is None or self.request.headers_finished:
            self.head_started = None
        if self.request is None:
            self.body_started = None
        elif self.request.headers_finished and self.body_started is None:
            self.body_started = time.monotonic()
        return result

    def closing(self) -> bool:
        return bool(self.will_close or self.close_when_flushed)

    def waiting(self) -> tuple[int, float] | None:
        """How this connection waits for a request, as a sort key, smallest first to close:
        idle between requests (closing it costs its client nothing: HTTP clients open a new
        one) before a partial head, each the longest waiting first. None while a request is
        being received, served or answered, or while it is already closing."""
        if self.requests or self.total_outbufs_len or self.closing():
            return None
        if self.head_started is not None:
            return (1, self.head_started)
        if self.request is not None:  # its head is whole: the body is on its way
            return None
        return (0, self.last_activity)

    def refuse(self, status: str, message: str) -> None:
        """Answer ``status`` with ``{"error": message}`` and close. Event-loop thread only,
        and only while no request of this connection is being served."""
        body = json.dumps({"error": message}).encode()
        head = (
            f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        data = head.encode("latin-1") + body
        with self.outbuf_lock:
            self.outbufs[-1].append(data)
            self.current_outbuf_count += len(data)
            self.total_outbufs_len += len(data)
        self.head_started = self.body_started = None
        self.close_when_flushed = True

    def handle_close(self) -> None:
        if self.linger and not self._half_closed and self.connected:
            try:
                self.socket.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            else:
                self._half_closed = True
                self._half_closed_at = time.monotonic()
                self.will_close = False  # maintenance sets it again for a client that lingers
                # half-closed, all that is left is to read (and drop) what still comes, and to
                # close when maintenance says so. This channel's own answers, not the class's:
                # the event loop asks every channel both at every turn, and an override of
                # waitress's for all of them was a few per cent of the api's CPU under load
                # (docs/performance.md, "Submitting work, part 3")
                self.readable = _always
                self.writable = self._closing
                return
        super().handle_close()

    def _closing(self) -> bool:
        return bool(self.will_close)

    def lingered_too_long(self, now: float) -> bool:
        return self._half_closed and now - self._half_closed_at > LINGER_MAX_S

    def handle_read(self) -> None:
        if not self._half_closed:
            super().handle_read()
            return
        try:
            data = self.recv(self.adj.recv_bytes)  # end of input: recv() calls handle_close
        except OSError:
            super().handle_close()
            return
        self._dropped += len(data)
        if self._dropped > LINGER_MAX_BYTES and self.connected:
            super().handle_close()


def _always() -> bool:
    return True


class JsonErrorServer(TcpWSGIServer):  # type: ignore[misc]
    """waitress's TCP server with the slow-client defences of the module docstring."""

    channel_class = JsonErrorChannel
    body_limit = 0
    rules = ClientRules()
    next_channel_cleanup = 0.0  # waitress's, typed

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._closed: dict[str, int] = {}  # connections closed by a defence since the report
        self._reported_at = 0.0
        super().__init__(*args, **kwargs)

    def admit(self, channel: JsonErrorChannel) -> None:
        """A new connection: make room under the per-client cap, or refuse it (429)."""
        cap = self.rules.per_client
        if cap <= 0:
            return
        mine = [
            c
            for c in self.active_channels.values()
            if c is not channel and c.client == channel.client and not c.closing()
        ]
        if len(mine) < cap:
            return
        if self._close_one_waiting(mine, "per_client"):
            return
        self._count("refused")
        channel.refuse(
            "429 Too Many Requests",
            f"too many connections from {channel.client}: at most {cap}",
        )

    def readable(self) -> bool:
        """waitress's, but at the connection limit one connection that waits for a request is
        closed to make room (see module docstring)."""
        now = time.time()
        if now >= self.next_channel_cleanup:
            self.next_channel_cleanup = now + self.adj.cleanup_interval
            self.maintenance(now)
        if not self.accepting:
            return False
        if len(self._map) < self.adj.connection_limit:
            return True
        channels = list(self.active_channels.values())
        # one at a time: a connection told to close with nothing left to send is gone by the
        # end of this loop pass (one with output pending may wait on a client that never reads)
        if not any(c.will_close and not c.total_outbufs_len for c in channels):
            self._close_one_waiting(channels, "limit")
        return False

    def maintenance(self, now: float) -> None:
        """waitress's idle timeout, then the head and body deadlines and the linger limit."""
        super().maintenance(now)
        clock = time.monotonic()
        head_s, body_s = self.rules.head_timeout_s, self.rules.body_timeout_s
        for channel in list(self.active_channels.values()):
            if channel.requests or channel.closing():
                continue  # being served, or already on its way out
            head, body = channel.head_started, channel.body_started
            if head is not None and clock - head > head_s:
                self._count("head_timeout")
                channel.refuse(
                    "408 Request Timeout", f"the request head did not arrive within {head_s:g} s"
                )
            elif body is not None and clock - body > body_s:
                self._count("body_timeout")
                channel.refuse(
                    "408 Request Timeout", f"the request body did not arrive within {body_s:g} s"
                )
            elif channel.lingered_too_long(clock):
                channel.will_close = True
        self._report(clock)

    def _close_one_waiting(self, channels: list[JsonErrorChannel], why: str) -> bool:
        """Close the first of ``channels`` in :meth:`JsonErrorChannel.waiting` order; False
        if none of them waits for a request."""
        waiting = [(key, c) for c in channels if (key := c.waiting()) is not None]
        if not waiting:
            return False
        _, channel = min(waiting, key=lambda pair: pair[0])
        channel.will_close = True
        self._count(why)
        return True

    def _count(self, why: str) -> None:
        self._closed[why] = self._closed.get(why, 0) + 1

    def _report(self, now: float) -> None:
        """One warning line at most every REPORT_INTERVAL_S, not one per connection: a flood
        must not flood the log too."""
        if not self._closed or now - self._reported_at < REPORT_INTERVAL_S:
            return
        self._reported_at = now
        logger.warning(
            "slow or too many connections: %s",
            ", ".join(f"{n} {SHED_WORDS[why]}" for why, n in sorted(self._closed.items())),
            extra={"action": "api_connections_shed", **self._closed},
        )
        self._closed.clear()


SHED_WORDS = {
    "head_timeout": "closed with 408 (request head too slow)",
    "body_timeout": "closed with 408 (request body too slow)",
    "per_client": "closed to make room for a newer one from the same address",
    "limit": "closed to make room at the connection limit",
    "refused": "refused with 429 (every connection of that address busy)",
}


def make_server(
    app: Any,
    socket_map: dict[int, Any],
    body_limit: int,
    rules: ClientRules,
    sock: socket.socket | None = None,
    **settings: Any,
) -> JsonErrorServer:
    """A TCP waitress server on ``socket_map`` whose own errors are JSON.

    Bodies of more than ``body_limit`` bytes are refused (413) before they are buffered; slow
    and flooding clients are handled by ``rules``. ``settings`` are waitress's adjustments.
    ``sock``: a bound TCP socket to serve (waitress's ``sockets``; ``settings`` then name no
    host or port), e.g. one inherited from ``flowforge up`` (flowforge/api/listener.py);
    without it the server binds ``settings``' host and port itself.
    """
    # waitress counts chunked framing as body and refuses at its limit; the application
    # enforces the exact limit, waitress a slightly larger one so nothing big is buffered
    adj = Adjustments(
        max_request_body_size=body_limit + FRAMING_MARGIN,
        cleanup_interval=MAINTENANCE_INTERVAL_S,
        **({"sockets": [sock]} if sock is not None else {}),
        **settings,
    )
    if sock is None:
        server = JsonErrorServer(app, map=socket_map, adj=adj)
    else:  # as waitress's create_server serves each of its `sockets`
        info = (sock.family, sock.type, sock.proto, sock.getsockname())
        server = JsonErrorServer(
            app, map=socket_map, _sock=sock, adj=adj, bind_socket=False, sockinfo=info
        )
    server.body_limit = body_limit
    server.rules = rules
    return server
