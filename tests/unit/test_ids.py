"""domain/ids.py: new ids are RFC 9562 version-7 UUIDs whose first 48 bits are the millisecond
clock, so later ones sort after earlier ones."""

from __future__ import annotations

import uuid

from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.ids import new_id
from flowforge.domain.plan import plan_runs

NOW_NS = 1_796_000_000_123_456_789  # 2026-11-29, in nanoseconds since the epoch


def test_an_id_is_version_7_with_the_rfc_variant() -> None:
    made = new_id()
    assert made.version == 7 and made.variant == uuid.RFC_4122


def test_its_first_48_bits_are_the_unix_time_in_milliseconds() -> None:
    assert new_id(NOW_NS).int >> 80 == NOW_NS // 1_000_000


def test_an_id_of_a_later_millisecond_sorts_after_every_earlier_one() -> None:
    earlier = [new_id(NOW_NS) for _ in range(200)]
    later = new_id(NOW_NS + 1_000_000)
    assert all(e < later for e in earlier)
    assert all(str(e) < str(later) for e in earlier)  # as PostgreSQL compares uuids: bytewise


def test_ids_of_one_millisecond_differ_in_their_74_random_bits() -> None:
    made = {new_id(NOW_NS) for _ in range(10_000)}
    assert len(made) == 10_000
    assert len({m.int & ((1 << 62) - 1) for m in made}) == 10_000  # the low random bits vary


def test_planned_runs_and_tasks_get_time_ordered_ids() -> None:
    workflow = WorkflowDef("w", (TaskDef("a", "h"), TaskDef("b", "h", depends_on=("a",))))
    plan = plan_runs(workflow, [{}, {}])
    ids = [*plan.run_ids, *(t.id for t in plan.tasks)]
    assert len(set(ids)) == 6 and {i.version for i in ids} == {7}
