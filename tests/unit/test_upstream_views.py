"""ctx.upstream's bounded form (issue 22) through its seam: the views over an in-memory page
source, so every fetch is counted and no database is needed (the store's pages:
tests/integration/test_upstream_pages.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace
from typing import Any
from uuid import UUID, uuid4

import pytest

from flowforge.config import WorkerConfig, load_config
from flowforge.domain.model import Claim, LargeUpstream
from flowforge.domain.states import TaskState
from flowforge.errors import FlowForgeError, UpstreamChangedError
from flowforge.roles.context import TaskContext
from flowforge.roles.upstream import InMemoryUpstream, UpstreamList, UpstreamMap, bounded
from flowforge.roles.worker import Worker
from tests.stubs import FakeStore, FakeTask, NullPool, StubBroker


def views(upstream: dict[str, Any], inline: int = 3, page: int = 2) -> tuple[Any, InMemoryUpstream]:
    source = InMemoryUpstream(inline)
    return bounded(source.claim(upstream), source, page), source


def context(upstream: Any) -> TaskContext:
    return TaskContext({}, upstream, 1, uuid4(), uuid4(), "join")


def test_within_the_bound_the_claim_carries_everything_and_nothing_is_fetched() -> None:
    given, source = views({"a": [1, 2, 3], "b": {"x": 1}})
    assert given == {"a": [1, 2, 3], "b": {"x": 1}} and type(given) is dict
    assert source.fetches == 0


def test_a_long_list_is_a_view_whose_length_costs_no_fetch() -> None:
    given, source = views({"m": list(range(7)), "s": 1})
    m = given["m"]
    assert isinstance(m, UpstreamList) and given["s"] == 1
    assert len(m) == 7 and source.fetches == 0


def test_indexing_fetches_the_page_holding_the_index_and_keeps_it() -> None:
    given, source = views({"m": list(range(10, 17))})
    m = given["m"]
    assert m[4] == 14 and source.fetches == 1
    assert m[5] == 15 and source.fetches == 1  # same page (4, 5)
    assert m[-1] == 16 and source.fetches == 2
    assert m[0] == 10 and source.fetches == 3  # one page held at a time


def test_iterating_reads_page_after_page() -> None:
    given, source = views({"m": list(range(7))}, page=3)
    assert list(given["m"]) == list(range(7))
    assert source.fetches == 3  # 3 + 3 + 1


def test_slices_negative_indexes_and_bounds_behave_as_a_list() -> None:
    values = list(range(9))
    given, _ = views({"m": values})
    m = given["m"]
    assert m[2:7:2] == values[2:7:2] and m[::-3] == values[::-3] and m[-9] == 0
    assert m.index(5) == 5 and 8 in m and 42 not in m and m.count(3) == 1
    with pytest.raises(IndexError, match="9 elements, no 9"):
        m[9]
    with pytest.raises(IndexError):
        m[-10]
    with pytest.raises(TypeError, match="integers"):
        m["1"]
    with pytest.raises(TypeError, match="integers"):
        m[True]


def test_a_view_equals_a_list_with_the_same_elements_but_is_not_json() -> None:
    given, _ = views({"m": [1, 2, 3, 4]})
    m = given["m"]
    assert m == [1, 2, 3, 4] and m == (1, 2, 3, 4) and m != [1, 2, 3] and m != [1, 2, 3, 5]
    assert m != "1234" and m == given["m"]
    with pytest.raises(TypeError):
        hash(m)
    with pytest.raises(TypeError):
        json.dumps(m)
    assert json.dumps(list(m)) == "[1, 2, 3, 4]"
    assert "4 elements" in repr(m)


class ShortSource(InMemoryUpstream):
    """Pages one element short: the upstream changed after the claim counted it."""

    def items_page(self, ref: LargeUpstream, after: int, limit: int) -> list[tuple[int, Any]]:
        return super().items_page(ref, after, limit)[:-1]


def test_a_page_that_does_not_match_the_claimed_length_is_an_error_not_a_short_list() -> None:
    source = ShortSource(3)
    m = bounded(source.claim({"m": list(range(5))}), source, 2)["m"]
    with pytest.raises(UpstreamChangedError, match="claim counted 5 elements") as raised:
        list(m)
    assert isinstance(raised.value, FlowForgeError)


def test_iterating_a_wide_fan_in_stops_at_the_claimed_count_without_an_empty_page() -> None:
    given, source = views({f"t{i}": i for i in range(6)}, inline=3, page=3)
    assert sorted(given.values()) == list(range(6)) and source.fetches == 2


def test_a_wide_fan_in_is_a_mapping_read_by_page_in_name_order() -> None:
    upstream = {f"t{i:02}": i for i in range(7)}
    given, source = views(upstream, inline=3, page=3)
    assert isinstance(given, UpstreamMap)
    assert len(given) == 7 and source.fetches == 0
    assert given["t05"] == 5 and source.fetches == 1
    assert list(given) == sorted(upstream) and source.fetches == 1 + 3  # 3 + 3 + 1
    source.fetches = 0
    assert dict(given.items()) == upstream and source.fetches == 3
    assert sorted(given.values()) == list(range(7))
    assert "t01" in given and "nope" not in given
    with pytest.raises(KeyError):
        given["nope"]
    with pytest.raises(KeyError):
        given[1]  # type: ignore[index]


def test_a_wide_fan_in_of_a_long_list_gives_a_view_for_it_too() -> None:
    upstream: dict[str, Any] = {f"t{i}": i for i in range(4)}
    upstream["t9"] = list(range(5))
    given, _ = views(upstream, inline=3, page=2)
    assert isinstance(given["t9"], UpstreamList) and list(given["t9"]) == list(range(5))
    assert isinstance(dict(given.items())["t9"], UpstreamList)


def test_a_claim_as_the_store_reads_it_becomes_the_same_views() -> None:
    ref = LargeUpstream(uuid4(), 4, items=True)
    claim = Claim(uuid4(), uuid4(), "j", "h", 1, 1, {}, {"s": 1}, upstream_large={"m": ref})
    source = InMemoryUpstream(3)
    given = bounded(claim, source, 2)
    assert given["s"] == 1 and len(given["m"]) == 4
    deferred = Claim(uuid4(), uuid4(), "j", "h", 1, 1, {}, {}, upstream_deferred=5000)
    assert len(bounded(deferred, source, 2)) == 5000


def test_upstream_items_walks_a_list_a_view_or_a_paged_mapping_from_an_event_loop() -> None:
    async def walk(ctx: TaskContext, name: str) -> list[Any]:
        return [x async for x in ctx.upstream_items(name)]

    given, _ = views({"m": list(range(5)), "s": [1, 2]})
    assert asyncio.run(walk(context(given), "m")) == list(range(5))
    assert asyncio.run(walk(context(given), "s")) == [1, 2]
    wide, _ = views({f"t{i}": [i] * 4 for i in range(4)}, inline=3)
    assert asyncio.run(walk(context(wide), "t2")) == [2, 2, 2, 2]
    with pytest.raises(KeyError):
        asyncio.run(walk(context(wide), "nope"))
    with pytest.raises(TypeError, match="not a list but dict"):
        asyncio.run(walk(context({"d": {}}), "d"))


def test_the_page_bound_is_at_least_one() -> None:
    ref = LargeUpstream(UUID(int=1), 3)
    with pytest.raises(ValueError, match="at least 1"):
        UpstreamList(InMemoryUpstream(1), ref, 0, "m")
    with pytest.raises(ValueError, match="at least 1"):
        UpstreamMap(InMemoryUpstream(1), UUID(int=1), 3, 0)


@pytest.mark.parametrize("field", ["upstream_inline_items", "upstream_page_items"])
@pytest.mark.parametrize("value", [0, -1, 100_001, 1.5, True, "10"])
def test_the_worker_bounds_are_whole_numbers_within_reason(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"{field} must be a whole number"):
        WorkerConfig(**{field: value})


class LongListStore(FakeStore):
    """Claims whose upstream ``m`` is a long list held by ``pages`` (as the claim query
    leaves one out)."""

    def __init__(self, pages: InMemoryUpstream) -> None:
        super().__init__()
        self._made = pages.claim({"m": list(range(9)), "s": 1})

    def _claim(self, task: FakeTask) -> Claim:
        made = super()._claim(task)
        return replace(made, upstream=self._made.upstream, upstream_large=self._made.upstream_large)


def test_the_worker_hands_its_handler_the_views_over_its_page_source() -> None:
    pages = InMemoryUpstream(3)
    store = LongListStore(pages)
    seen: list[Any] = []
    stop = threading.Event()

    def join(ctx: TaskContext) -> Any:
        seen.extend([type(ctx.upstream["m"]).__name__, ctx.upstream["s"], list(ctx.upstream["m"])])
        return len(ctx.upstream["m"])

    config = replace(load_config(env={}), worker=WorkerConfig(listen_for_cancel=False))
    broker = StubBroker(on_idle=stop.set)
    worker = Worker(
        replace(config, worker=replace(config.worker, upstream_page_items=4)),
        handlers={"join": join},
        broker=broker,
        store=store,
        db=NullPool(),
        pages=pages,
    )
    [task] = store.add("join")
    broker.publish(task, 1)
    try:
        worker.initialize()
        worker.loop(stop, lambda: None)
    finally:
        worker.shutdown()
    assert seen == ["UpstreamList", 1, list(range(9))]
    assert pages.fetches == 3  # 4 + 4 + 1
    assert store.tasks[task].state is TaskState.SUCCEEDED
