"""``ctx.upstream``'s bounded form (issue 22, docs/handlers.md "Large upstream results").

A claim carries upstream results inline only up to ``worker.upstream_inline_items``
(:class:`~flowforge.domain.model.Claim`). What it leaves out a handler reads on demand, one
page of at most ``worker.upstream_page_items`` per fetch, through two read-only views:

- :class:`UpstreamList`: an upstream list longer than the bound (a wide map's result, say).
  ``len()`` is known without a fetch; indexing fetches the page holding the index; iterating
  fetches page after page (keyset on the index) and holds one page at a time.
- :class:`UpstreamMap`: ``ctx.upstream`` itself when the task has more upstream tasks than the
  bound (a wide fan-in). ``len()`` is known; ``ctx.upstream[name]`` fetches that one result;
  iterating the names, ``items()`` and ``values()`` page by name.

Pages come from an :class:`UpstreamSource`: the store's
(:class:`~flowforge.store.upstreams.Upstreams`) in a worker, :class:`InMemoryUpstream` in
:class:`~flowforge.testing.LocalRunner` (so a handler meets the same types under test). A
fetch runs in the calling thread: in an ``async def`` handler it blocks the event loop for
one page's query, which :meth:`TaskContext.upstream_items
<flowforge.roles.context.TaskContext.upstream_items>` avoids (it fetches in a thread).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, ItemsView, Iterator, Mapping, Sequence, ValuesView
from dataclasses import replace
from typing import Any, Protocol, overload
from uuid import UUID, uuid4

from flowforge.domain.model import Claim, LargeUpstream
from flowforge.errors import UpstreamChangedError


class UpstreamSource(Protocol):
    """Where pages come from (see :class:`~flowforge.store.upstreams.Upstreams`, whose
    docstrings are the contract)."""

    def names_page(
        self,
        task_run_id: UUID,
        after: str | None,
        limit: int,
        *,
        name: str | None = None,
        results: bool = True,
    ) -> list[tuple[str, Any]]: ...

    def items_page(self, ref: LargeUpstream, after: int, limit: int) -> list[tuple[int, Any]]: ...


class UpstreamList(Sequence[Any]):
    """A read-only sequence over an upstream list the claim left out (module docstring).

    Equal (``==``) to any list, tuple or :class:`UpstreamList` with the same elements (which
    compares them all, page by page). Not JSON: ``list(value)`` materialises it, e.g. to
    return it from a handler. An :class:`UpstreamChangedError` when a page does not match the
    length the claim counted."""

    def __init__(self, source: UpstreamSource, ref: LargeUpstream, page: int, name: str) -> None:
        if page < 1:
            raise ValueError("page must be at least 1")
        self._source = source
        self._ref = ref
        self._page = page
        self._name = name
        self._held: tuple[int, list[Any]] = (-1, [])  # (first index, elements): one page

    def __len__(self) -> int:
        return self._ref.length

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"upstream list indices must be integers, not {type(index).__name__}")
        at = index + len(self) if index < 0 else index
        if not 0 <= at < len(self):
            raise IndexError(f"upstream {self._name!r} has {len(self)} elements, no {index}")
        first, held = self._held
        if not first <= at < first + len(held):
            first = at - at % self._page
            held = self._fetch(first - 1)
            self._held = (first, held)
        return held[at - first]

    def __iter__(self) -> Iterator[Any]:
        for page in self.pages():
            yield from page

    def pages(self) -> Iterator[list[Any]]:
        """The elements a page at a time, in order (one page held at a time)."""
        after = -1
        while after + 1 < len(self):
            page = self._fetch(after)
            after += len(page)
            yield page

    async def apages(self) -> AsyncIterator[list[Any]]:
        """:meth:`pages`, each fetched in a thread (the event loop is not blocked)."""
        after = -1
        while after + 1 < len(self):
            page = await asyncio.to_thread(self._fetch, after)
            after += len(page)
            yield page

    def _fetch(self, after: int) -> list[Any]:
        """The page after index ``after``, checked to be the next elements of the length the
        claim counted (a rerun or a purge meanwhile changes them)."""
        want = min(self._page, len(self) - after - 1)
        found = self._source.items_page(self._ref, after, want)
        if [i for i, _ in found] != list(range(after + 1, after + 1 + want)):
            raise UpstreamChangedError(
                f"upstream {self._name!r} changed while it was read: its claim counted "
                f"{len(self)} elements, the page after index {after} has {len(found)}"
            )
        return [value for _, value in found]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, list | tuple | UpstreamList):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # a list's equality, a list's unhashability

    def __repr__(self) -> str:
        return f"<UpstreamList {self._name!r}: {len(self)} elements, read by page>"


class UpstreamMap(Mapping[str, Any]):
    """``ctx.upstream`` of a task with more upstream tasks than the bound (module docstring):
    read-only; each lookup one fetch, iteration by page in name order. A value that is itself
    a long list is an :class:`UpstreamList`. ``dict(ctx.upstream)`` materialises it."""

    def __init__(self, source: UpstreamSource, task_run_id: UUID, count: int, page: int) -> None:
        if page < 1:
            raise ValueError("page must be at least 1")
        self._source = source
        self._task_run_id = task_run_id
        self._count = count
        self._page = page

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, name: str) -> Any:
        if not isinstance(name, str):
            raise KeyError(name)
        found = self._source.names_page(self._task_run_id, None, 1, name=name)
        if not found:
            raise KeyError(name)
        return self._value(*found[0])

    def __iter__(self) -> Iterator[str]:
        for name, _ in self._pairs(results=False):
            yield name

    def items(self) -> ItemsView[str, Any]:
        return _PagedItems(self)

    def values(self) -> ValuesView[Any]:
        return _PagedValues(self)

    def _pairs(self, *, results: bool = True) -> Iterator[tuple[str, Any]]:
        after: str | None = None
        seen = 0
        while True:
            page = self._source.names_page(self._task_run_id, after, self._page, results=results)
            for name, value in page:
                yield name, self._value(name, value) if results else None
            seen += len(page)
            # a short page is the last; so is the one that reaches the claim's count (no
            # round trip for an empty page after it)
            if len(page) < self._page or seen >= self._count:
                return
            after = page[-1][0]

    def _value(self, name: str, value: Any) -> Any:
        if isinstance(value, LargeUpstream):
            return UpstreamList(self._source, value, self._page, name)
        return value

    def __repr__(self) -> str:
        return f"<UpstreamMap: {self._count} upstream tasks, read by page>"


class _PagedItems(ItemsView[str, Any]):
    """``items()`` of an :class:`UpstreamMap`: one fetch per page, not one per name."""

    _mapping: UpstreamMap

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return self._mapping._pairs()


class _PagedValues(ValuesView[Any]):
    """``values()`` of an :class:`UpstreamMap`: one fetch per page, not one per name."""

    _mapping: UpstreamMap

    def __iter__(self) -> Iterator[Any]:
        return (value for _, value in self._mapping._pairs())


def bounded(claim: Claim, source: UpstreamSource, page: int) -> Mapping[str, Any]:
    """``ctx.upstream`` for ``claim``: its inline results as they are, an
    :class:`UpstreamMap` when it carries none for their number, an :class:`UpstreamList` for
    each list it left out."""
    if claim.upstream_deferred is not None:
        return UpstreamMap(source, claim.task_run_id, claim.upstream_deferred, page)
    if not claim.upstream_large:
        return claim.upstream
    lazy = {n: UpstreamList(source, ref, page, n) for n, ref in claim.upstream_large.items()}
    return {**claim.upstream, **lazy}


class InMemoryUpstream:
    """An :class:`UpstreamSource` over results held in memory (LocalRunner; unit tests), with
    the store's bound: :meth:`claim` makes the claim a worker would get for them."""

    def __init__(self, inline: int) -> None:
        self._inline = inline
        self._tasks: dict[UUID, dict[str, Any]] = {}
        self._lists: dict[UUID, Sequence[Any]] = {}
        self.fetches = 0  # pages served (tests count them)

    def claim(self, upstream: Mapping[str, Any], task_run_id: UUID | None = None) -> Claim:
        """The claim of a task (``task_run_id``, or a new id) whose upstream results are
        ``upstream``, bounded as the ``claim`` query bounds them."""
        tid = task_run_id or uuid4()
        self._tasks[tid] = dict(upstream)
        inline = {k: v for k, v in upstream.items() if self._large(k, v, tid) is None}
        large = {k: ref for k, v in upstream.items() if (ref := self._large(k, v, tid))}
        base = Claim(tid, uuid4(), "", "", 1, 1, {})
        if len(upstream) > self._inline:
            return replace(base, upstream_deferred=len(upstream))
        return replace(base, upstream=inline, upstream_large=large)

    def _large(self, name: str, value: Any, tid: UUID) -> LargeUpstream | None:
        if not isinstance(value, list) or len(value) <= self._inline:
            return None
        for ref_id, held in self._lists.items():
            if held is value:
                return LargeUpstream(ref_id, len(value), items=False)
        ref_id = uuid4()
        self._lists[ref_id] = value
        return LargeUpstream(ref_id, len(value), items=False)

    def names_page(
        self,
        task_run_id: UUID,
        after: str | None,
        limit: int,
        *,
        name: str | None = None,
        results: bool = True,
    ) -> list[tuple[str, Any]]:
        self.fetches += 1
        upstream = self._tasks[task_run_id]
        names = sorted(n for n in upstream if (after is None or n > after) and name in (None, n))
        page = []
        for n in names[:limit]:
            value = upstream[n] if results else None
            page.append((n, self._large(n, value, task_run_id) or value))
        return page

    def items_page(self, ref: LargeUpstream, after: int, limit: int) -> list[tuple[int, Any]]:
        self.fetches += 1
        held = self._lists[ref.task_run_id]
        return list(enumerate(held[after + 1 : after + 1 + limit], start=after + 1))
