"""The repository: every part of the store in one object, for callers that use several.

The statements are grouped by caller, each part a class over one execution idiom
(:mod:`flowforge.store.part`): :class:`~flowforge.store.triggers.Triggers` (new runs),
:class:`~flowforge.store.passes.Passes` (the scheduler), :class:`~flowforge.store.claims.Claims`
(the worker), :class:`~flowforge.store.outbox.Outbox` (the publisher),
:class:`~flowforge.store.processes.Processes` (the process registry),
:class:`~flowforge.store.operator.Operator` (cancel, requeue, purge) and
:class:`~flowforge.store.reads.Reads` (read models). A caller that needs one part builds that
part alone over its :class:`~flowforge.store.db.Database` (the worker builds ``Claims`` and
``Processes``); :class:`Repository` is the facade for the client, the API and the CLI, which use
most of them.

The facade inherits the parts rather than holding them: every method keeps its name, its
signature and its type for the ~100 call sites without a line of forwarding code, and each part
stays a class of its own (they share only ``Part``'s constructor, and no part defines a name
another part does).
"""

from __future__ import annotations

from flowforge.store.claims import Claims
from flowforge.store.operator import Operator
from flowforge.store.outbox import Outbox
from flowforge.store.passes import Observer, Passes
from flowforge.store.processes import Processes
from flowforge.store.reads import Reads
from flowforge.store.triggers import ORDERING_LOCK_NAMESPACE, Triggers

__all__ = ["ORDERING_LOCK_NAMESPACE", "Observer", "Repository"]


class Repository(Triggers, Passes, Claims, Outbox, Processes, Operator, Reads):
    """Every read and state change of runs and task runs (see each part for its contract).

    ``rand`` (a float in [0, 1)) feeds retry jitter; tests inject a fixed one.
    """
