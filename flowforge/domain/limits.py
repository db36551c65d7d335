"""What a task may ask of flow control: a concurrency limit and a rate limit (SPEC 7.4), each
over a key template (:mod:`flowforge.domain.keys`). Validated on construction. Pure: no I/O."""

from __future__ import annotations

from dataclasses import dataclass

from flowforge.domain.keys import check_template
from flowforge.errors import DefinitionError

#: Largest concurrency limit accepted (a limit is a count of tasks READY or RUNNING at once).
MAX_CONCURRENCY = 100_000


@dataclass(frozen=True)
class Concurrency:
    """``concurrency: {key, limit}`` (SPEC 7.4): at most ``limit`` tasks whose ``key`` renders to
    the same text are READY or RUNNING at once, across every run, workflow and tree. ``key`` is a
    template over the run input like an ordering key; one without fields (``partner``) is a
    global limit for every task that names it — the per-handler limit, when a handler's tasks
    name it (docs/flow-control.md "Concurrency and rate limits")."""

    key: str
    limit: int

    def __post_init__(self) -> None:
        check_template(self.key, "concurrency.key")
        if (
            isinstance(self.limit, bool)
            or not isinstance(self.limit, int)
            or not 1 <= self.limit <= MAX_CONCURRENCY
        ):
            raise DefinitionError(
                f"concurrency.limit must be a whole number from 1 to {MAX_CONCURRENCY}"
            )


#: Most starts a rate limit allows per window (the admission counts a window's starts).
MAX_RATE_LIMIT = 100_000
#: Longest rate-limit window, in seconds (one day).
MAX_RATE_PER_S = 86_400.0


@dataclass(frozen=True)
class RateLimit:
    """``rate_limit: {limit, per, key}`` (SPEC 7.4): at most ``limit`` attempts of tasks whose
    ``key`` renders to the same text START in any window of ``per`` seconds (a sliding window,
    on the database clock), across every run, workflow and tree. ``key`` is a template over the
    run input like a concurrency key; None: the task's handler name, so the limit is the
    handler's wherever a task of it sets one (docs/flow-control.md "Rate limits")."""

    limit: int
    per: float
    key: str | None = None

    def __post_init__(self) -> None:
        if self.key is not None:
            check_template(self.key, "rate_limit.key")
        if (
            isinstance(self.limit, bool)
            or not isinstance(self.limit, int)
            or not 1 <= self.limit <= MAX_RATE_LIMIT
        ):
            raise DefinitionError(
                f"rate_limit.limit must be a whole number from 1 to {MAX_RATE_LIMIT}"
            )
        if (
            isinstance(self.per, bool)
            or not isinstance(self.per, int | float)
            or not 0 < self.per <= MAX_RATE_PER_S  # NaN fails this too
        ):
            raise DefinitionError(
                f"rate_limit.per must be more than 0 and at most {MAX_RATE_PER_S:.0f} seconds "
                "(a duration such as 1s, 10m, 1h)"
            )
