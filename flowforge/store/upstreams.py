"""The pages of a claimed task's upstream results that its claim left out (issue 22).

A claim carries upstream results inline only up to ``worker.upstream_inline_items``
(:class:`~flowforge.domain.model.Claim`); the worker's handler reads the rest here, a bounded
page per statement, on demand (:mod:`flowforge.roles.upstream`). Every page is keyset-paged —
upstream tasks by name, a list's elements by index — so reading page ``k`` costs what page 1
does (but a plain task's list, which PostgreSQL stores as one value: ``upstream_list_page``).
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from flowforge.domain.model import DEFAULT_UPSTREAM_INLINE, LargeUpstream
from flowforge.store import rows
from flowforge.store.db import Database
from flowforge.store.part import Part


class Upstreams(Part):
    """Reads of upstream results by page; ``inline`` is the claim's bound, so a list longer
    than it comes back as a :class:`LargeUpstream` here too, never whole."""

    def __init__(self, db: Database, *, inline: int = DEFAULT_UPSTREAM_INLINE) -> None:
        super().__init__(db)
        self._inline = inline

    def names_page(
        self,
        task_run_id: UUID,
        after: str | None,
        limit: int,
        *,
        name: str | None = None,
        results: bool = True,
    ) -> list[tuple[str, Any]]:
        """Up to ``limit`` of the claimed task ``task_run_id``'s upstream tasks in name order
        after ``after`` (None: from the first; ``name``: that one only), each with its result
        (None without ``results``) or, for a list longer than the bound, its
        :class:`LargeUpstream`."""
        params = {
            "id": task_run_id,
            "after": after,
            "limit": limit,
            "name": name,
            "results": results,
            "inline": self._inline,
        }
        return [
            (row["name"], rows.large_upstream(row) if row["n"] is not None else row["result"])
            for row in self._query("upstream_names_page", params)
        ]

    def items_page(self, ref: LargeUpstream, after: int, limit: int) -> list[tuple[int, Any]]:
        """Up to ``limit`` (index, element) pairs of the list ``ref`` names, in index order
        after index ``after`` (-1: from the first): a map's from its items' rows."""
        params = {"id": ref.task_run_id, "after": after, "limit": limit}
        if ref.items:
            found = self._query("upstream_map_items_page", params)
        else:
            found = self._query("upstream_list_page", params)
        return [(int(row["i"]), row["value"]) for row in found]
