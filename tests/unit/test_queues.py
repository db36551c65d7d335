"""Queues that route (issue 20, SPEC 7.4; docs/flow-control.md "Queues and pools"), the parts
without services: every statement that dispatches carries the task's queue, a task's ``queue:``
is a name RabbitMQ accepts and enters the digest only when set, a trigger's default fills the
tasks that name none, pools are validated and become one child spec each, and a queue with READY
tasks and no consumer is a warning of ``/health/ready``, never a 503.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import falcon
import falcon.testing
import pytest

from flowforge.api.health import Ready
from flowforge.config import Config, PoolConfig, load_config
from flowforge.definitions import pool_problems, workflow_from_mapping
from flowforge.domain.dag import TaskDef, WorkflowDef
from flowforge.domain.model import QueueLoad
from flowforge.domain.plan import plan_runs
from flowforge.errors import ConfigError, DefinitionError
from flowforge.store import queries
from flowforge.up import build_specs, pool_name
from flowforge.views import queues_dict

SQL = Path(queries.__file__).with_name("queries.sql").read_text()

#: Names RabbitMQ would refuse, or that would not show as declared: one per class.
BAD_QUEUES: list[Any] = [
    "",  # RabbitMQ would name it itself
    "amq.partner",  # reserved: ACCESS_REFUSED
    "q" * 256,  # over the AMQP short string
    "q" * 253,  # its band Q.p5 would be (migration 0019: priority bands)
    "é" * 127,  # 254 UTF-8 bytes
    "a\nb",  # a control character
    "a\x7fb",  # DEL
    "a\x85b",  # a C1 control
    " partner",  # surrounding whitespace
    "partner ",
    7,  # not text
    ["partner"],
]
GOOD_QUEUES = ["partner", "tenant-1.high", "q" * 252, "é" * 126, "Ünïcode queue"]


def test_every_insert_into_the_outbox_carries_the_queue_and_priority_of_its_task() -> None:
    inserts = re.findall(r"INSERT INTO outbox \(([^)]*)\)\s*SELECT ([^\n]*) FROM", SQL)
    # the release fragment, the dispatch fragment (promote_ready, admit_gated),
    # insert_tasks, release_claims, redispatch_lost, retry_task_now (an operator's retry-now)
    assert len(inserts) == len(re.findall(r"INSERT INTO outbox", SQL)) == 6
    for columns, selected in inserts:
        assert [c.strip() for c in columns.split(",")][-2:] == ["queue", "priority"], columns
        assert [c.strip() for c in selected.split(",")][-2:] == ["queue", "priority"], selected


def test_every_insert_into_task_runs_carries_a_queue() -> None:
    # insert_tasks (a trigger's) and expand_map (a map's items inherit their map's)
    inserts = re.findall(r"INSERT INTO task_runs \(([^)]*)\)", SQL)
    assert len(inserts) == 2
    for columns in inserts:
        assert "queue" in [c.strip() for c in columns.split(",")], columns
    assert "m.id, s.idx, s.item, m.queue" in SQL


def test_a_worker_is_offered_only_the_dependents_of_its_own_queue_and_band() -> None:
    finish = queries.readable()["finish"].decode()
    offered = (
        "AND (queue IS NULL OR queue = %(queue)s)\n    AND priority >= %(min_priority)s\n"
        "  ORDER BY keyless DESC LIMIT %(offer)s"
    )
    assert offered in finish


def test_lost_dispatches_are_judged_within_their_own_queue() -> None:
    lost = queries.readable()["redispatch_lost"].decode()
    # the latest claimed dispatch is found per queue (and band), and a candidate compared
    # with its own queue's
    assert lost.count("coalesce(later.queue, '') = g.queue") == 2  # unpublished, published
    assert "coalesce(o.queue, '') AS queue" in lost
    assert "JOIN latest l ON l.queue = c.queue" in lost


@pytest.mark.parametrize("queue", BAD_QUEUES, ids=repr)
def test_a_task_queue_must_be_a_name_rabbitmq_accepts(queue: Any) -> None:
    with pytest.raises(DefinitionError, match="task 'call': queue "):
        TaskDef("call", "partner.call", queue=queue)


@pytest.mark.parametrize("queue", GOOD_QUEUES)
def test_a_task_queue_may_be_any_other_name(queue: str) -> None:
    assert TaskDef("call", "partner.call", queue=queue).queue == queue


def test_a_task_that_never_executes_takes_no_queue_and_a_map_passes_it_to_its_items() -> None:
    with pytest.raises(DefinitionError, match="a sleep task takes no queue"):
        TaskDef("nap", sleep=5, queue="partner")
    mapped = TaskDef("each", "partner.call", for_each="list", queue="partner")
    assert mapped.queue == "partner"


def test_the_queue_enters_the_digest_only_when_set() -> None:
    plain = WorkflowDef("wf", (TaskDef("a", "h.a"),))
    assert "queue" not in plain.to_dict()["tasks"][0]
    assert plain.digest == WorkflowDef("wf", (TaskDef("a", "h.a", queue=None),)).digest
    routed = WorkflowDef("wf", (TaskDef("a", "h.a", queue="partner"),))
    assert routed.to_dict()["tasks"][0]["queue"] == "partner"
    assert routed.digest != plain.digest


def test_a_workflow_file_names_a_task_queue_and_a_bad_one_is_refused_at_its_key() -> None:
    data = {"name": "wf", "tasks": [{"name": "a", "handler": "h.a", "queue": "partner"}]}
    assert workflow_from_mapping(data).tasks[0].queue == "partner"
    bad = {"name": "wf", "tasks": [{"name": "a", "handler": "h.a", "queue": "amq.x"}]}
    with pytest.raises(DefinitionError, match=r"tasks\[0\].*queue must not start with 'amq.'"):
        workflow_from_mapping(bad, "wf.yaml")


def test_a_trigger_fills_the_queue_of_every_task_that_names_none() -> None:
    wf = WorkflowDef("wf", (TaskDef("a", "h.a"), TaskDef("b", "h.b", queue="partner")))
    planned = {t.name: t.queue for t in plan_runs(wf, [{}], queue="tree-a").tasks}
    assert planned == {"a": "tree-a", "b": "partner"}
    unassigned = {t.name: t.queue for t in plan_runs(wf, [{}]).tasks}
    assert unassigned == {"a": None, "b": "partner"}  # the store's own default: see plan_runs


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "flowforge.yaml"
    path.write_text(text)
    return path


def test_without_pools_a_tree_has_one_pool_of_its_workers_on_its_queue(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "broker: {queue: tree-a}\nprocesses: {workers: 3}\n"))
    assert config.pools() == (PoolConfig("tree-a", 3),)
    specs = {s.name: s.count for s in build_specs(config)}
    assert specs == {"scheduler": 1, "worker": 3, "publisher": 1}


def test_pools_each_become_a_worker_spec_with_their_queue_and_handlers(tmp_path: Path) -> None:
    config = load_config(
        write(
            tmp_path,
            "handlers: [mod_a, mod_b]\nbroker: {queue: tree-a}\n"
            "processes:\n  pools:\n    - {queue: tree-a, workers: 2}\n"
            "    - {queue: partner, workers: 1, handlers: [mod_b]}\n",
        )
    )
    specs = {s.name: s for s in build_specs(config)}
    assert list(specs) == ["scheduler", "worker", "worker:partner", "publisher"]
    assert (specs["worker"].count, specs["worker:partner"].count) == (2, 1)
    assert specs["worker:partner"].scalable and specs["worker:partner"].stop_group == 1
    partner = config.for_pool(config.pools()[1])
    assert (partner.broker.queue, partner.handlers) == ("partner", ("mod_b",))
    assert config.for_pool(config.pools()[0]).handlers == ("mod_a", "mod_b")
    assert pool_name(1, config.for_pool(config.pools()[1])) == "worker:partner"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("broker: {queue: 'amq.x'}\n", "broker: queue must not start with 'amq.'"),
        ("broker: {queue: ''}\n", "broker: queue must not be empty"),
        ('processes: {pools: [{queue: "a\\tb"}]}\n', "control characters"),
        ("processes: {pools: [{queue: a, workers: 0}]}\n", "workers must be at least 1"),
        ("processes: {pools: [{workers: 2}]}\n", r"pools\[0\].queue: required key is missing"),
        (
            "processes: {pools: [{queue: a}, {queue: a}]}\n",
            r"pools\[1\]: queue 'a' already has a pool with min_priority 0"
            r" \(processes.pools\[0\]\)",
        ),
        (
            "processes: {pools: [{queue: a, min_priority: 5}, {queue: a, min_priority: 5}]}\n",
            r"pools\[1\]: queue 'a' already has a pool with min_priority 5",
        ),
        (  # None is worker.min_priority: the same pair
            "worker: {min_priority: 1}\n"
            "processes: {pools: [{queue: a}, {queue: a, min_priority: 1}]}\n",
            r"pools\[1\]: queue 'a' already has a pool with min_priority 1",
        ),
        (
            "handlers: [m, n]\n"
            "processes: {pools: [{queue: a}, {queue: a, min_priority: 5, handlers: [m]}]}\n",
            r"pools\[1\].handlers: must be those of processes.pools\[0\] \(queue 'a'\)",
        ),
        (
            "handlers: [m]\nprocesses: {pools: [{queue: a, handlers: [n]}]}\n",
            r"pools\[0\].handlers: 'n' is not a module of handlers",
        ),
        ("processes: {pools: [{queue: a, size: 2}]}\n", r"pools\[0\].size: unknown key"),
    ],
)
def test_a_bad_pool_or_queue_is_refused_when_the_config_loads(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text))


def test_a_task_whose_queue_a_pool_here_consumes_needs_its_handler_in_that_pool() -> None:
    wf = WorkflowDef(
        "wf",
        (
            TaskDef("a", "h.a"),  # the default queue: pool tree-a imports h.a
            TaskDef("b", "h.b", queue="partner"),  # partner's pool lacks h.b
            TaskDef("c", "h.c", queue="elsewhere"),  # no pool here: another tree's to judge
            TaskDef("nap", sleep=1),
        ),
    )
    pools = {"tree-a": ("processes.pools[0]", {"h.a"}), "partner": ("processes.pools[1]", {"x"})}
    assert pool_problems({"wf": wf}, "tree-a", pools) == [
        "workflow 'wf' task 'b': handler 'h.b' goes to queue 'partner', whose pool "
        "(processes.pools[1]) does not import it"
    ]


def test_a_named_queue_with_ready_tasks_and_no_consumer_is_unserved() -> None:
    loads = (
        QueueLoad(None, 4, 0),  # tasks on no queue: any tree's publisher routes them
        QueueLoad("busy", 3, 2),
        QueueLoad("idle", 0, 0),
        QueueLoad("stranded", 5, 0),
    )
    assert [q.unserved for q in loads] == [False, False, False, True]
    assert queues_dict(loads)["unserved_queues"] == ["stranded"]


def test_an_unserved_queue_is_a_warning_of_health_ready_not_a_503() -> None:
    checks: dict[str, Any] = {
        "postgres": "ok",
        "rabbitmq": "ok",
        "scheduler": "ok",
        "publisher": "ok",
        "worker": "ok",
        "unserved_queues": ["stranded"],
    }
    app = falcon.App()
    app.add_route("/health/ready", Ready(lambda: dict(checks)))
    client = falcon.testing.TestClient(app)
    found = client.simulate_get("/health/ready")
    assert found.status_code == 200
    assert json.loads(found.text) == {"status": "ok", **checks}
    checks["worker"] = "error"
    assert client.simulate_get("/health/ready").status_code == 503


def test_a_config_without_pools_means_what_it_meant() -> None:
    config = Config()
    assert config.for_pool(config.pools()[0]) == config
