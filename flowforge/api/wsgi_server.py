"""waitress, with its own error responses (oversized or malformed requests) as JSON too.

waitress answers some requests before the application sees them — a body above its limit, a
malformed request line — in plain text. FlowForge promises a JSON body for every error, so the
channel's error task is replaced by one that writes ``{"error": ...}``.

Such an answer is sent while the client may still be sending its body. Closing a socket with
unread input makes the kernel reset the connection, and the reset can destroy the answer before
the client reads it (a client uploading 2 MiB would see "connection reset", not 413). So after
an error the channel half-closes and reads (and drops) what is still coming until the client
closes, up to LINGER_MAX_BYTES; waitress's idle-channel maintenance ends a client that never
does.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer
from waitress.task import ErrorTask

PAYLOAD_TOO_LARGE = 413
FRAMING_MARGIN = 64 * 1024  # bytes
#: After an error answer, at most this much of the rest of the request is read and dropped.
LINGER_MAX_BYTES = 16 * 1024 * 1024


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
    """A channel that closes gently after an error answer (see module docstring)."""

    error_task_class = JsonErrorTask
    linger = False  # set by an error answer: the request may not have been read to its end
    _half_closed = False
    _dropped = 0

    def handle_close(self) -> None:
        if self.linger and not self._half_closed and self.connected:
            try:
                self.socket.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            else:
                self._half_closed = True
                self.will_close = False  # maintenance sets it again for a client that lingers
                return
        super().handle_close()

    def writable(self) -> bool:
        # half-closed, the only thing left to do is to close when maintenance says so
        return bool(self.will_close) if self._half_closed else bool(super().writable())

    def readable(self) -> bool:
        return True if self._half_closed else bool(super().readable())

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


class JsonErrorServer(TcpWSGIServer):  # type: ignore[misc]
    channel_class = JsonErrorChannel
    body_limit = 0


def make_server(
    app: Any, socket_map: dict[int, Any], body_limit: int, **settings: Any
) -> JsonErrorServer:
    """A TCP waitress server on ``socket_map`` whose own errors are JSON.

    Bodies of more than ``body_limit`` bytes are refused (413) before they are buffered.
    """
    # waitress counts chunked framing as body and refuses at its limit; the application
    # enforces the exact limit, waitress a slightly larger one so nothing big is buffered
    adj = Adjustments(max_request_body_size=body_limit + FRAMING_MARGIN, **settings)
    server = JsonErrorServer(app, map=socket_map, adj=adj)
    server.body_limit = body_limit
    return server
