"""The task queue's topology and the connection parameters, shared by publisher and consumer.

Both sides declare the same durable quorum queue with the same arguments, so whichever starts
first creates it. An existing queue of another type makes the broker refuse the declaration
(406 PRECONDITION_FAILED, "inequivalent arg"); that becomes :class:`QueueTypeMismatchError`
carrying the operator's steps, and is never retried.
"""

from __future__ import annotations

import os
import ssl
from typing import Any

import pika

from flowforge.broker import tls
from flowforge.config import BrokerConfig
from flowforge.errors import QueueTypeMismatchError

PRECONDITION_FAILED = 406
CONNECT_TIMEOUT_S = 5.0
BLOCKED_CONNECTION_TIMEOUT_S = 60.0


def queue_arguments(config: BrokerConfig) -> dict[str, Any]:
    """Declaration arguments of the task queue: always a quorum queue."""
    arguments: dict[str, Any] = {"x-queue-type": "quorum"}
    if config.quorum_initial_group_size is not None:
        arguments["x-quorum-initial-group-size"] = config.quorum_initial_group_size
    return arguments


def connection_parameters(
    config: BrokerConfig, start: int | None = None
) -> list[pika.URLParameters]:
    """One parameter set per configured node, tried in turn (cluster failover).

    Each process starts at a different node (``start``, by default its pid modulo the number
    of nodes) so the connections of many trees spread over the cluster. An ``amqps://`` node
    gets the TLS of ``config.tls`` with its own host as the server name (flowforge/broker/tls.py;
    raises :class:`~flowforge.errors.BrokerConfigError` if a file of it cannot be used).
    """
    urls = list(config.url)
    first = (os.getpid() if start is None else start) % len(urls)
    params = []
    context: ssl.SSLContext | None = None  # one for every amqps:// node of this call
    for url in urls[first:] + urls[:first]:
        p = pika.URLParameters(url)
        if p.ssl_options is not None:  # amqps://; pika's own default names no server
            context = context or tls.context(config.tls)
            p.ssl_options = pika.SSLOptions(context, server_hostname=p.host)
        p.heartbeat = config.heartbeat_s
        p.connection_attempts = 1
        p.socket_timeout = CONNECT_TIMEOUT_S
        p.stack_timeout = CONNECT_TIMEOUT_S * 2
        p.blocked_connection_timeout = BLOCKED_CONNECTION_TIMEOUT_S
        p.client_properties = {"connection_name": "flowforge"}
        params.append(p)
    return params


def is_type_mismatch(reply_code: int, reply_text: str) -> bool:
    return reply_code == PRECONDITION_FAILED and "inequivalent arg" in reply_text


def type_mismatch_error(queue: str, reply_text: str) -> QueueTypeMismatchError:
    return QueueTypeMismatchError(
        f"queue {queue!r} exists with different arguments than the quorum queue FlowForge "
        f"needs ({reply_text}). To fix it: stop every FlowForge process; wait until the queue "
        f"is empty (rabbitmqctl list_queues name type messages); delete it (rabbitmqctl "
        f"delete_queue {queue}); start FlowForge again, which declares it as a quorum queue. "
        f"Rows still pending in the outbox are published again, so nothing is lost."
    )
