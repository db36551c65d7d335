"""The worker's seams against what implements them (no services).

``roles/seams.py`` restates the signatures of the store's statements (``WorkerStore``,
``Registry``) and of the pool (``Pool``); ``broker/consume.py``'s ``Deliveries`` those of the
consumer. The production classes and the fast tests' fakes (tests/stubs.py) must each match
them exactly — names, kinds, defaults and annotations — or a fake could keep passing tests
the real class would fail, and the protocol would document what nobody implements.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

import pytest

from flowforge.broker.consume import Consumer, Deliveries
from flowforge.roles.seams import Pool, Registry, WorkerStore
from flowforge.roles.worker import WorkerStatements
from flowforge.store.db import Database
from tests.stubs import FakeStore, NullPool, StubBroker

#: (protocol, implementation): the production class first, then the fake of the fast tests.
IMPLEMENTATIONS = [
    (WorkerStore, WorkerStatements),
    (WorkerStore, FakeStore),
    (Pool, Database),
    (Pool, NullPool),
    (Deliveries, Consumer),
    (Deliveries, StubBroker),
]


def protocol_methods(protocol: type) -> dict[str, Callable[..., Any]]:
    """The public methods ``protocol`` declares, its protocol bases' included."""
    methods: dict[str, Callable[..., Any]] = {}
    for cls in reversed(protocol.__mro__):
        if cls is Protocol or not getattr(cls, "_is_protocol", False):
            continue
        for name, value in vars(cls).items():
            if not name.startswith("_") and callable(value):
                methods[name] = value
    return methods


def signature(function: Callable[..., Any]) -> inspect.Signature:
    """The signature with its annotations evaluated (the modules use postponed annotations)."""
    return inspect.signature(function, eval_str=True)


def test_the_worker_store_declares_the_claims_and_the_registry() -> None:
    assert set(protocol_methods(WorkerStore)) == {
        "claim_many",
        "finish_many",
        "release_claims",
        "renew_leases",
        "write_output",
        "register_process",
        "deregister_process",
    }
    assert set(protocol_methods(Registry)) == {"register_process", "deregister_process"}
    assert set(protocol_methods(Pool)) == {"open", "reset", "close"}


@pytest.mark.parametrize(
    ("protocol", "implementation"),
    IMPLEMENTATIONS,
    ids=[f"{p.__name__}-{i.__name__}" for p, i in IMPLEMENTATIONS],
)
def test_the_implementation_matches_every_signature_of_its_protocol(
    protocol: type, implementation: type
) -> None:
    for name, declared in protocol_methods(protocol).items():
        implemented = getattr(implementation, name, None)
        assert callable(implemented), f"{implementation.__name__} has no {name}"
        assert signature(implemented) == signature(declared), (
            f"{implementation.__name__}.{name}{signature(implemented)} differs from "
            f"{protocol.__name__}.{name}{signature(declared)}"
        )


def test_a_drifted_signature_is_caught() -> None:
    class Drifted:
        def renew_leases(self, claims: list[tuple[int, int]], lease_s: float) -> dict[Any, bool]:
            return {}

    declared = protocol_methods(WorkerStore)["renew_leases"]
    assert signature(Drifted.renew_leases) != signature(declared)
