"""A role's registration: a process that never registered has nothing to take back, so a boot
that failed before it (a database refusing TLS) does not wait on that database to leave."""

from __future__ import annotations

from uuid import UUID

from flowforge.roles.presence import Presence


class Recording:
    def __init__(self) -> None:
        self.calls: list[tuple[str, UUID]] = []

    def register_process(
        self, process_id: UUID, host: str, pid: int, role: str, queue: str | None = None
    ) -> None:
        self.calls.append(("register", process_id))

    def deregister_process(self, process_id: UUID) -> None:
        self.calls.append(("deregister", process_id))


def test_a_process_that_never_registered_leaves_without_a_call() -> None:
    registry = Recording()
    Presence(registry, "worker").leave()
    assert registry.calls == []


def test_a_registered_process_deregisters_when_it_leaves() -> None:
    registry = Recording()
    presence = Presence(registry, "worker")
    presence.announce()
    presence.leave()
    assert registry.calls == [("register", presence.id), ("deregister", presence.id)]
