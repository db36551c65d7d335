"""``GET /api/v1/overview`` and ``GET /api/v1/processes``: the state of the whole system."""

from __future__ import annotations

import falcon

from flowforge.api import params
from flowforge.api.errors import json_error
from flowforge.api.health import FRESH_S  # live means the same as in /health/ready
from flowforge.store import processes as registry
from flowforge.store.reads import Reads
from flowforge.views import overview_dict, to_dict

DEFAULT_POISON_THRESHOLD = 3
MAX_POISON_THRESHOLD = 1_000_000
POISON_LIST = 20


class Overview:
    """``?poison_threshold=N`` (default 3). The body is :meth:`Reads.overview`'s plus
    ``poison_threshold`` and ``fresh_s``."""

    def __init__(self, reads: Reads) -> None:
        self._reads = reads

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        threshold = _poison_threshold(req)
        data = overview_dict(self._reads.overview(threshold, FRESH_S, POISON_LIST))
        params.send(resp, {**data, "poison_threshold": threshold, "fresh_s": FRESH_S})


def _poison_threshold(req: falcon.Request) -> int:
    raw = req.get_param("poison_threshold")
    if raw is None:
        return DEFAULT_POISON_THRESHOLD
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_POISON_THRESHOLD:
        raise json_error(
            falcon.HTTP_400, f"poison_threshold must be an integer from 1 to {MAX_POISON_THRESHOLD}"
        )
    return int(raw)


class Processes:
    """``{"processes": [...], "fresh_s"}``: every registered process of every tree (host, pid,
    role, started_at, last_seen_at, silent_s) with ``live`` = seen within ``fresh_s``."""

    def __init__(self, table: registry.Processes) -> None:
        self._table = table

    def on_get(self, _req: falcon.Request, resp: falcon.Response) -> None:
        found = self._table.list_processes()
        params.send(
            resp,
            {
                "processes": [{**to_dict(p), "live": p.silent_s <= FRESH_S} for p in found],
                "fresh_s": FRESH_S,
            },
        )
