"""Reserved workers (docs/flow-control.md "Reserved workers"), without services: a worker's or a
pool's ``min_priority`` refused by class of bad value, pools of one queue apart by it, their
child names, the config each pool's workers see, and the consumer of a reserved worker (only
its bands, with a consumer priority) over recording channels."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flowforge.broker.consume import RESERVED_PRIORITY, Consumer
from flowforge.config import BrokerConfig, load_config
from flowforge.domain.names import BANDS, band
from flowforge.errors import ConfigError
from flowforge.up import build_specs

# every value that is not a band's lowest priority, by class
BAD = ["2", "4", "6", "9", "10", "-1", "true", "'5'", "1.5", "[5]", "{p: 5}"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "flowforge.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("value", BAD)
def test_a_worker_min_priority_that_is_not_a_band_s_lowest_is_refused(
    tmp_path: Path, value: str
) -> None:
    with pytest.raises(ConfigError, match=r"worker[:.] ?min_priority"):
        load_config(write(tmp_path, f"worker: {{min_priority: {value}}}\n"))


@pytest.mark.parametrize("value", BAD)
def test_a_pool_min_priority_that_is_not_a_band_s_lowest_is_refused(
    tmp_path: Path, value: str
) -> None:
    text = f"processes: {{pools: [{{queue: a}}, {{queue: a, min_priority: {value}}}]}}\n"
    with pytest.raises(ConfigError, match=r"pools\[1\]"):
        load_config(write(tmp_path, text))


def test_the_refusal_names_the_bands(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, "worker: {min_priority: 7}\n"))
    message = str(caught.value)
    assert "must be 0, 1 or 5 (the lowest priority of a band: 0, 1-4, 5-9), not 7" in message
    assert "\n" not in message


@pytest.mark.parametrize("low", BANDS)
def test_each_band_s_lowest_priority_is_a_min_priority(tmp_path: Path, low: int) -> None:
    config = load_config(write(tmp_path, f"worker: {{min_priority: {low}}}\n"))
    assert config.worker.min_priority == low
    (pool,) = config.pools()
    assert config.for_pool(pool).worker.min_priority == low


def test_a_reserved_pool_beside_a_queue_s_pool_is_a_spec_of_its_own(tmp_path: Path) -> None:
    text = (
        "broker: {queue: shop}\n"
        "processes:\n"
        "  pools:\n"
        "    - {queue: shop, workers: 3}\n"
        "    - {queue: shop, workers: 1, min_priority: 5}\n"
        "    - {queue: partner, workers: 2}\n"
        "    - {queue: partner, workers: 1, min_priority: 1}\n"
    )
    config = load_config(write(tmp_path, text))
    workers = [s for s in build_specs(config) if s.name.startswith("worker")]
    assert [(s.name, s.count) for s in workers] == [
        ("worker", 3),
        ("worker:shop:p5", 1),
        ("worker:partner", 2),
        ("worker:partner:p1", 1),
    ]
    seen = [config.for_pool(p) for p in config.pools()]
    assert [(c.broker.queue, c.worker.min_priority) for c in seen] == [
        ("shop", 0),
        ("shop", 5),
        ("partner", 0),
        ("partner", 1),
    ]


def test_a_pool_without_min_priority_takes_the_worker_s(tmp_path: Path) -> None:
    text = (
        "worker: {min_priority: 5}\nprocesses: {pools: [{queue: a}, {queue: a, min_priority: 0}]}\n"
    )
    config = load_config(write(tmp_path, text))
    assert [config.for_pool(p).worker.min_priority for p in config.pools()] == [5, 0]
    names = [s.name for s in build_specs(config) if s.name.startswith("worker")]
    assert names == ["worker", "worker:a"]


# ---------------------------------------------------------------- the consumer, over fake channels


class ConsumingChannel:
    """A band's channel: records qos, consume (with its arguments) and cancel."""

    def __init__(self, calls: list[tuple[Any, ...]], index: int) -> None:
        self.calls, self.index = calls, index

    def basic_qos(self, prefetch_count: int) -> None:
        self.calls.append(("qos", self.index, prefetch_count))

    def basic_consume(
        self, queue: str, cb: Any, auto_ack: bool = False, arguments: Any = None
    ) -> str:
        assert not auto_ack
        self.calls.append(("consume", self.index, queue, arguments))
        return f"ctag-{self.index}"

    def basic_cancel(self, tag: str) -> None:
        self.calls.append(("cancel", self.index, tag))


class IdleConnection:
    is_open = False

    def process_data_events(self, time_limit: float = 0.0) -> None:
        return None


def consumer(min_band: int) -> tuple[Consumer, list[tuple[Any, ...]]]:
    consumer = Consumer(BrokerConfig(queue="shop", prefetch=4), min_band)
    calls: list[tuple[Any, ...]] = []
    consumer._conn = IdleConnection()  # type: ignore[assignment]
    consumer._channels = [ConsumingChannel(calls, i) for i in range(len(BANDS))]  # type: ignore[misc]
    return consumer, calls


def test_a_reserved_consumer_consumes_only_its_bands_with_a_consumer_priority() -> None:
    reserved, calls = consumer(band(5))
    assert reserved.take(2, 0.0) == []
    assert calls == [
        ("qos", 2, 2),
        ("consume", 2, "shop.p5", {"x-priority": RESERVED_PRIORITY}),
    ]
    calls.clear()
    assert reserved.take(2, 0.0) == []  # the same window: nothing restarted
    assert calls == []
    reserved.take(4, 0.0)  # a wider window: only its own band's consumer is restarted
    assert calls == [
        ("cancel", 2, "ctag-2"),
        ("qos", 2, 4),
        ("consume", 2, "shop.p5", {"x-priority": RESERVED_PRIORITY}),
    ]


def test_a_consumer_for_bands_1_and_up_takes_the_highest_first() -> None:
    reserved, calls = consumer(band(1))
    reserved.take(4, 0.0)
    consumed = [c for c in calls if c[0] == "consume"]
    assert consumed == [  # the highest band first
        ("consume", 2, "shop.p5", {"x-priority": RESERVED_PRIORITY}),
        ("consume", 1, "shop.p1", {"x-priority": RESERVED_PRIORITY}),
    ]
    for index, tag in ((1, 1), (2, 1), (1, 2)):
        method = SimpleNamespace(delivery_tag=tag, redelivered=False)
        reserved._on_message(index, None, method, None, b"{}")
    assert [(d.band, d.tag) for d in reserved.take(4, 0.0)] == [(2, 1), (1, 1), (1, 2)]


def test_every_other_consumer_consumes_every_band_at_the_default_priority() -> None:
    plain, calls = consumer(0)
    plain.take(4, 0.0)
    consumed = [c for c in calls if c[0] == "consume"]
    assert consumed == [
        ("consume", 2, "shop.p5", None),
        ("consume", 1, "shop.p1", None),
        ("consume", 0, "shop", None),
    ]
