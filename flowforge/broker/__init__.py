"""RabbitMQ: topology, message format, the confirming publisher and the consumer (pika)."""

import logging

#: The logger pika writes to. Every connection loss it logs at ERROR, with tracebacks, is also
#: raised to the role as :class:`flowforge.errors.BrokerUnavailableError`, which the role logs
#: once (``<Role> lost a connection …``) and recovers from.
PIKA_LOGGER = "pika"


def quiet_pika_logs() -> None:
    """Keep pika's own records out of a role's log (only CRITICAL passes): the role reports each
    broker failure itself, once, and an outage it rides out is not an ERROR with tracebacks.

    Sets a logger level by name: pika itself is not imported."""
    logging.getLogger(PIKA_LOGGER).setLevel(logging.CRITICAL)
