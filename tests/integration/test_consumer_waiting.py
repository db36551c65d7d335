"""``Consumer.waiting`` on real RabbitMQ (flowforge/broker/consume.py): what the worker asks at
the broker's turn during a chain (``Intake.owed``). A message in the queue is seen waiting once
the broker pushed it; nothing waits in an empty queue; a consumer not consuming (never started,
or paused by a hand-back) always owes a take, as it cannot see the queue."""

from __future__ import annotations

import pytest

from flowforge.broker.consume import Consumer
from flowforge.config import load_config
from flowforge.domain.names import band_queue
from tests.delivery import broker_channel
from tests.e2e import Stack
from tests.helpers import wait_for

pytestmark = pytest.mark.integration


def test_a_consumer_sees_a_message_waiting_and_nothing_in_an_empty_queue(stack: Stack) -> None:
    consumer = Consumer(load_config(stack.config_path(), env={}).broker)
    consumer.connect()
    try:
        assert consumer.waiting()  # not consuming yet: the queue is unseen
        assert consumer.take(1, 0.0) == []  # consuming, with a prefetch of 1
        assert not consumer.waiting()
        with broker_channel(stack) as channel:
            channel.basic_publish("", band_queue(stack.queue, 0), b"one")
        wait_for(consumer.waiting, timeout=10, what="the message pushed to the consumer")
        [delivery] = consumer.take(1, 0.0)
        assert delivery.body == b"one"
        consumer.ack([delivery])
        assert not consumer.waiting()
        consumer.hand_back()  # a slow handler: consuming stops
        assert consumer.waiting()
    finally:
        consumer.close()
        stack.delete_queue()
