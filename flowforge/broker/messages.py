"""The dispatch message: ids only, never code to import and never a pickle."""

from __future__ import annotations

import json
from dataclasses import dataclass
from uuid import UUID

from flowforge.domain.model import Dispatch
from flowforge.errors import BrokerError

CONTENT_TYPE = "application/json"
VERSION = 1


class MessageError(BrokerError):
    """A delivery whose body is not a FlowForge dispatch message."""


@dataclass(frozen=True)
class TaskMessage:
    """Run the task run ``task_run_id`` if it is still READY with ``token``."""

    task_run_id: UUID
    token: int


def encode(dispatch: Dispatch) -> bytes:
    return json.dumps(
        {"v": VERSION, "task_run_id": str(dispatch.task_run_id), "token": dispatch.fencing_token},
        separators=(",", ":"),
    ).encode()


def decode(body: bytes) -> TaskMessage:
    """Parse a delivery body strictly; :class:`MessageError` for anything else."""
    try:
        data = json.loads(body)
        if not isinstance(data, dict) or data.get("v") != VERSION:
            raise ValueError("not a version 1 dispatch message")
        token = data["token"]
        if isinstance(token, bool) or not isinstance(token, int):
            raise ValueError("token is not an integer")
        return TaskMessage(UUID(str(data["task_run_id"])), token)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise MessageError(f"undecodable dispatch message: {exc}") from exc
