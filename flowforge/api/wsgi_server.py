"""waitress, with its own error responses (oversized or malformed requests) as JSON too.

waitress answers some requests before the application sees them — a body above its limit, a
malformed request line — in plain text. FlowForge promises a JSON body for every error, so the
channel's error task is replaced by one that writes ``{"error": ...}``.
"""

from __future__ import annotations

import json
from typing import Any

from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer
from waitress.task import ErrorTask

PAYLOAD_TOO_LARGE = 413
FRAMING_MARGIN = 64 * 1024  # bytes


class JsonErrorTask(ErrorTask):  # type: ignore[misc]
    def execute(self) -> None:
        error = self.request.error
        if error.code == PAYLOAD_TOO_LARGE:  # the same words as the application's own 413
            message = f"request body larger than {self.channel.server.body_limit} bytes"
        else:
            message = f"{error.reason}: {error.body}".strip(": ")
        body = json.dumps({"error": message}).encode()
        self.status = f"{error.code} {error.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)


class JsonErrorChannel(HTTPChannel):  # type: ignore[misc]
    error_task_class = JsonErrorTask


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
