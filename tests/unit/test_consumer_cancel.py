"""The consumer's reaction to a broker ``basic.cancel`` (flowforge.broker.consume).

Against a real broker, ``test_a_worker_whose_consumer_the_broker_cancelled_subscribes_again``
(tests/integration/test_roles_delivery.py) proves a cancel of the live consumer leads to a new
subscription. A cancel for a tag this consumer had already given up itself (ours and the
broker's crossed) cannot be provoked on purpose with a real broker; the decision is checked here.
"""

from __future__ import annotations

from types import SimpleNamespace

from flowforge.broker.consume import Consumer
from flowforge.config import BrokerConfig


def cancel_frame(tag: str) -> SimpleNamespace:
    return SimpleNamespace(method=SimpleNamespace(consumer_tag=tag))


def test_a_cancel_for_the_live_consumer_makes_the_next_take_subscribe_again() -> None:
    consumer = Consumer(BrokerConfig())
    consumer._consumer_tags = ["ctag-1", "ctag-2", "ctag-3"]
    consumer._on_cancelled_by_broker(1, cancel_frame("ctag-2"))
    assert consumer._consumer_tags == ["ctag-1", None, "ctag-3"]  # that band's only


def test_a_cancel_for_a_tag_already_given_up_leaves_the_live_consumer_alone() -> None:
    consumer = Consumer(BrokerConfig())
    consumer._consumer_tags = ["ctag-1", "ctag-2", "ctag-3"]
    consumer._on_cancelled_by_broker(1, cancel_frame("ctag-0"))
    assert consumer._consumer_tags == ["ctag-1", "ctag-2", "ctag-3"]
