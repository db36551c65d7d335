"""Named SQL queries and shipped migrations (no database needed)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import psycopg
import pytest

import flowforge.store as store_package
from flowforge.store import queries
from flowforge.store.migrate import available_migrations
from flowforge.store.part import PASSES, PREPARED

STORE = Path(store_package.__file__).parent
#: The store's parts: every module that runs named queries (all but the connection, error,
#: listener and migration code, and the execution helper itself).
PART_MODULES = sorted(
    path
    for path in STORE.glob("*.py")
    if path.stem not in {"__init__", "db", "pgerrors", "notify", "migrate", "queries", "part"}
)
PARTS_SOURCE = "\n".join(path.read_text(encoding="utf-8") for path in PART_MODULES)
#: A named query run through the one execution idiom: ``self._query("name"`` or, inside a
#: transaction, ``tx.all("name"`` / ``one`` / ``count`` / ``send`` / ``notify``.
DIRECT_KEY = re.compile(
    r"""\b(?:_query|all|one|count|send|notify|later)\(\s*["']([a-z_][a-z0-9_]*)["']"""
)
#: A way of running SQL other than the idiom's (a cursor, the pool, the Database's own calls).
OTHER_IDIOM = re.compile(r"""\bcur\.execute\(|\b_db\.|\.transaction\(|\b_q\[""")
#: Queries the store selects by name through a variable (``_ROUTING``, the purge ages, ...).
INDIRECT_NAMES = (
    "lock_failed",
    "apply_routing",
    "lock_expired_leases",
    "apply_reap",
    "purge_runs",
    "purge_outbox",
    "purge_keys",
    "purge_gate_audit",
    "purge_breaker_transitions",
    "purge_idle_breakers",
)
#: Queries store/plansize.py runs itself on a checked-out connection (its NAMES).
PART_NAMES = ("plan_table_pages",)
PLACEHOLDER = re.compile(r"%\((?P<name>[a-z_][a-z0-9_]*)\)s")


def test_parse_splits_named_queries_and_drops_the_header() -> None:
    text = (
        "-- a header comment that belongs to no query\n"
        "-- name: first\nSELECT 1;\n\n"
        "--name:second  \n-- what it does\nSELECT %(x)s\n-- comment inside\n  FROM t;\n"
    )
    parsed = queries.parse(text, compacted=False)
    assert list(parsed) == ["first", "second"]
    assert parsed["first"] == b"SELECT 1;"
    # the comment that documents a query stays in the file; one inside its SQL is readable
    assert parsed["second"] == b"SELECT %(x)s\n-- comment inside\n  FROM t;"
    # and neither is sent
    assert queries.parse(text)["second"] == b"SELECT %(x)s FROM t;"


def test_parse_returns_bytes_in_read_only_mapping() -> None:
    parsed = queries.parse("-- name: q\nSELECT 1;\n")
    assert isinstance(parsed["q"], bytes)
    with pytest.raises(TypeError):
        parsed["other"] = b""  # type: ignore[index]


def test_parse_refuses_duplicate_names() -> None:
    with pytest.raises(ValueError, match="duplicate query or fragment name 'q'"):
        queries.parse("-- name: q\nSELECT 1;\n-- name: q\nSELECT 2;\n")
    with pytest.raises(ValueError, match="duplicate query or fragment name 'q'"):
        queries.parse("-- fragment: q(x)\nSELECT 1;\n-- name: q\nSELECT 2;\n")


def test_parse_expands_a_fragment_with_its_parameter_without_its_comments() -> None:
    text = (
        "-- fragment: pick(source)\n-- what it does\nx AS (SELECT id FROM {source})\n"
        "-- ------------ next section\n\n"
        "-- name: q\nWITH a AS (SELECT 1 AS id),\n-- use: pick(a)\nSELECT * FROM x;\n"
    )
    parsed = queries.parse(text, compacted=False)
    assert list(parsed) == ["q"]
    assert parsed["q"] == b"WITH a AS (SELECT 1 AS id),\nx AS (SELECT id FROM a)\nSELECT * FROM x;"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("-- name: q\n-- use: missing(a)\nSELECT 1;\n", "unknown fragment 'missing'"),
        ("-- fragment: f\nSELECT 1;\n-- name: q\nSELECT 1;\n", "fragment 'f' names no parameter"),
    ],
)
def test_parse_refuses_a_fragment_misused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        queries.parse(text)


def test_every_fragment_use_is_expanded_in_the_shipped_queries() -> None:
    leftovers = [
        name
        for name, body in queries.load().items()
        if b"-- use:" in body or b"{source}" in body or b"-- fragment:" in body
    ]
    assert leftovers == []


def test_insert_tasks_decides_ready_by_the_expression_of_the_ready_by_itself_column() -> None:
    """insert_tasks cannot read task_runs.ready_by_itself (the row does not exist yet): it
    repeats the column's expression (or the trigger admitted the task through its keys), and
    this keeps the two the same."""
    defining = [
        m
        for m in available_migrations()
        if "ready_by_itself boolean" in m.sql and "GENERATED" in m.sql
    ]
    assert defining, "no migration generates task_runs.ready_by_itself"
    generated = re.search(
        r"ready_by_itself boolean NOT NULL\s+GENERATED ALWAYS AS \((.*?)\) STORED",
        defining[-1].sql,
        re.S,
    )
    assert generated is not None
    columns = re.findall(r"([a-z_]+) IS NULL", generated.group(1))
    assert {"sleep_s", "concurrency_key", "rate_key"} <= set(columns), generated.group(1)
    insert = queries.readable()["insert_tasks"].decode()
    ready = re.search(
        r"SELECT t\.pending_deps = 0 AND t\.ordering_key IS NULL\s+AND \(t\.admitted OR \((.*?)\)\)"
        r"\s+\) AS k\(ready\)",
        insert,
        re.S,
    )
    assert ready is not None
    assert re.findall(r"t\.([a-z_]+) IS NULL", ready.group(1)) == columns


def test_parse_of_text_without_names_is_empty() -> None:
    assert dict(queries.parse("SELECT 1;\n")) == {}


def test_load_is_cached() -> None:
    assert queries.load() is queries.load()


def test_load_has_no_empty_query() -> None:
    empty = [name for name, body in queries.load().items() if not body.strip()]
    assert empty == []


def referenced_names() -> set[str]:
    return set(DIRECT_KEY.findall(PARTS_SOURCE))


def test_the_parts_reference_queries_by_name() -> None:
    names = referenced_names()
    assert len(names) >= 20  # the regex really finds the parts' lookups
    assert {"claim", "finish", "notify_scheduler"} <= names


def test_the_store_parts_run_sql_through_the_one_idiom_only() -> None:
    assert {path.stem for path in PART_MODULES} >= {
        "triggers",
        "passes",
        "claims",
        "outbox",
        "processes",
        "operator",
        "reads",
        "runs",
    }
    for path in PART_MODULES:
        other = OTHER_IDIOM.findall(path.read_text(encoding="utf-8"))
        assert other == [], f"{path.name} runs SQL outside store/part.py's helpers: {other}"


def test_the_idiom_guard_catches_a_cursor_and_the_database() -> None:
    assert OTHER_IDIOM.search('cur.execute(self._q["claim"], params)')
    assert OTHER_IDIOM.search("self._db.execute(q, params)")
    assert OTHER_IDIOM.search("with self._db.transaction() as cur:")
    assert not OTHER_IDIOM.search('tx.all("claim", params)')


def test_every_query_the_parts_name_exists() -> None:
    missing = sorted(referenced_names() - set(queries.load()))
    assert missing == []


def test_every_indirectly_named_query_is_in_the_source_and_exists() -> None:
    for name in INDIRECT_NAMES:
        assert f'"{name}"' in PARTS_SOURCE, name
    assert sorted(set(INDIRECT_NAMES) - set(queries.load())) == []


def test_every_query_plansize_py_runs_itself_is_in_its_source_and_exists() -> None:
    source = (STORE / "plansize.py").read_text(encoding="utf-8")
    for name in PART_NAMES:
        assert f'"{name}"' in source, name
    assert sorted(set(PART_NAMES) - set(queries.load())) == []


def test_no_query_is_unused_by_the_parts() -> None:
    used = referenced_names() | set(INDIRECT_NAMES) | set(PART_NAMES)
    assert sorted(set(queries.load()) - used) == []


@pytest.mark.parametrize("name", sorted(queries.load()))
def test_query_uses_only_named_placeholders(name: str) -> None:
    text = queries.load()[name].decode()
    stray = PLACEHOLDER.sub("", text).replace("%%", "")
    assert "%" not in stray, f"{name}: Python %-formatting other than %(name)s: {text!r}"


def test_placeholder_guard_catches_string_building() -> None:
    bad = "SELECT * FROM t WHERE id = %s AND name = '%d'"
    assert "%" in PLACEHOLDER.sub("", bad)


def test_available_migrations_are_numbered_from_one_without_gaps() -> None:
    migrations = available_migrations()
    assert migrations, "no migration shipped"
    versions = [m.version for m in migrations]
    assert versions == list(range(1, len(versions) + 1))


def test_available_migrations_have_names_sql_and_distinct_checksums() -> None:
    migrations = available_migrations()
    assert migrations[0].name == "initial"
    for migration in migrations:
        assert re.fullmatch(r"[a-z0-9_]+", migration.name)
        assert re.search(r"\b(CREATE|ALTER)\b", migration.sql.upper()), migration.name
        assert len(migration.checksum) == 64
    assert len({m.checksum for m in migrations}) == len(migrations)


#: Statements with more than one execution call site, and why.
SEVERAL_CALLS = {
    "claim_many": "a keyed claim takes a transaction of its own, rolled back if its key is busy",
    "finish_many": "one call per path: a plain finish is one statement (the hot path, no "
    "BEGIN/COMMIT), a finish that claims the next steps one transaction",
    "requeue_dead_matching": "one transaction per task, so a failure part-way leaves each "
    "requeued and audited or untouched",
    "items_page": "one statement either way: a map's page from its items' rows, another "
    "task's from its stored list",
}
HELPERS = {"_query", "_transaction"}


def part_methods() -> dict[str, ast.FunctionDef]:
    """Every method of every public class of the store's parts, by ``Class.method``."""
    found: dict[str, ast.FunctionDef] = {}
    for path in PART_MODULES:
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        found[f"{node.name}.{item.name}"] = item
    return found


def self_calls(method: ast.FunctionDef) -> list[str]:
    """The names of the ``self.<name>(...)`` calls in ``method``, once per call site."""
    return [
        node.func.attr
        for node in ast.walk(method)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    ]


def executing(methods: dict[str, ast.FunctionDef]) -> set[str]:
    """The method names that run SQL: a helper, or a method that calls one (transitively)."""
    names = set(HELPERS)
    while True:
        more = {
            key.split(".")[1] for key, method in methods.items() if names & set(self_calls(method))
        } - names
        if not more:
            return names
        names |= more


def test_each_statement_is_a_docstring_and_one_execution_call() -> None:
    """store/part.py's idiom (procrastinate's manager.py): a public method of a part states its
    contract, checks its input, and runs SQL through one call of ``_query`` or ``_transaction``
    (or of one other statement); mapping rows is store/rows.py's."""
    methods = part_methods()
    assert len(methods) >= 30  # the parser really finds the parts' methods
    runs_sql = executing(methods)
    several: dict[str, list[str]] = {}
    undocumented: list[str] = []
    for key, method in methods.items():
        name = key.split(".")[1]
        if name.startswith("_"):
            continue
        if ast.get_docstring(method) is None:
            undocumented.append(key)
        calls = [c for c in self_calls(method) if c in runs_sql]
        if len(calls) > 1 and name not in SEVERAL_CALLS:
            several[key] = calls
    assert undocumented == []
    assert several == {}


def test_the_one_call_guard_catches_a_second_round_trip() -> None:
    source = (
        "class Demo:\n"
        "    def act(self, x):\n"
        '        """Doc."""\n'
        "        self._transaction(work, x)\n"
        "        return self.read(x)\n"
        "    def read(self, x):\n"
        '        """Doc."""\n'
        '        return self._query("q", {"x": x})\n'
    )
    demo = ast.parse(source).body[0]
    assert isinstance(demo, ast.ClassDef)
    methods = {f"Demo.{m.name}": m for m in demo.body if isinstance(m, ast.FunctionDef)}
    runs_sql = executing(methods)
    assert [c for c in self_calls(methods["Demo.act"]) if c in runs_sql] == ["_transaction", "read"]


def test_every_failure_reason_the_queries_write_is_one_the_domain_names() -> None:
    """Failure reasons have no database CHECK (docs/failure-model.md, "Failure reasons"): the
    queries write them as literals or parameters, and this keeps every literal in the domain's
    closed set — including the ones chosen by a CASE on the same line or the next."""
    from flowforge.domain.reasons import FailureReason, RunFailureReason

    known = {str(r) for r in FailureReason} | {str(r) for r in RunFailureReason}
    text = (Path(store_package.__file__).parent / "queries.sql").read_text(encoding="utf-8")
    lines = text.splitlines()
    written: set[str] = set()
    for i, line in enumerate(lines):
        if re.search(r"failure_reason\s*=", line) and not line.lstrip().startswith("--"):
            window = " ".join(lines[i : i + 2])
            assignment = window[window.index("failure_reason") :]
            written.update(re.findall(r"^failure_reason\s*=\s*'([a-z_]+)'", assignment))
            written.update(re.findall(r"(?:THEN|ELSE)\s*'([a-z_]+)'", assignment))
    assert "event_timeout" in written and "cancelled" in written  # the scan sees them
    assert written - known == set()


def test_a_fragment_may_use_another_with_its_own_parameter_in_place() -> None:
    text = (
        "-- fragment: inner(x)\n{x}.a = 1\n"
        "-- fragment: outer(y)\n{y}.b = 2 AND\n-- use: inner({y})\n"
        "-- name: q\nSELECT 1 FROM t WHERE\n-- use: outer(t)\n;\n"
    )
    assert (
        queries.parse(text, compacted=False)["q"]
        == b"SELECT 1 FROM t WHERE\nt.b = 2 AND\nt.a = 1\n;"
    )
    assert queries.parse(text)["q"] == b"SELECT 1 FROM t WHERE t.b=2 AND t.a=1 ;"


def test_a_fragment_that_uses_itself_is_refused() -> None:
    text = "-- fragment: loop(x)\n-- use: loop({x})\n-- name: q\n-- use: loop(t)\n"
    with pytest.raises(ValueError, match="fragment 'loop' uses itself"):
        queries.parse(text)


@pytest.mark.parametrize(
    ("written", "sent"),
    [
        ("SELECT a  =  1 -- why\n  FROM t", "SELECT a=1 FROM t"),
        ("WHERE x IN ( 1, 2 ) AND y <= %(y)s", "WHERE x IN(1,2)AND y<=%(y)s"),
        # quoted text is kept whole, comment marks and spaces in it too
        ("SELECT 'a -- b''s  c' AS q, 'x' = y", "SELECT 'a -- b''s  c' AS q,'x'=y"),
        # a minus before a minus keeps its space (no comment made), as does a named argument
        ("SELECT a - -1, b - 1, f(x => 2)", "SELECT a - -1,b-1,f(x=>2)"),
        ("SELECT a = -1, n <> 'x'", "SELECT a = -1,n<>'x'"),
    ],
)
def test_compact_drops_comments_and_needless_spaces_only(written: str, sent: str) -> None:
    assert queries.compact(written) == sent


def test_the_hot_paths_statements_are_parsed_once_per_process() -> None:
    """psycopg caches its parse of a query's text (``%(name)s`` to ``$n``) only up to 4,096
    bytes (``psycopg._queries.MAX_CACHED_STATEMENT_LENGTH``); a longer one is parsed again at
    every execution, on the caller's CPU — ``finish``, at 4,351 bytes, cost the worker 80-200
    µs a finish (docs/performance.md "Chain hop and CPU per task", "The finish under psycopg's
    cache of parsed queries"). Every prepared statement of a trigger, a claim, a finish and the
    publisher either fits, or is one :func:`queries.numbered` converts (once) for a
    ``RawCursor`` (store/db.py ``run_statement``): no placeholder of psycopg's left in it."""
    hot = PREPARED - PASSES
    assert {"claim", "finish", "insert_tasks", "lock_outbox"} <= hot
    assert psycopg._queries.MAX_CACHED_STATEMENT_LENGTH == queries.PARSE_CACHED_BYTES
    for name in hot:
        query = queries.load()[name]
        if len(query) > queries.PARSE_CACHED_BYTES:
            text, names = queries.numbered(query)
            assert b"%(" not in text and names, name
            assert len(names) == len(set(re.findall(rb"%\(([a-z_0-9]+)\)s", query))), name


@pytest.mark.parametrize(
    ("query", "text", "names"),
    [
        (b"SELECT %(a)s, %(b)s, %(a)s", b"SELECT $1, $2, $1", ("a", "b")),
        (b"SELECT 1", b"SELECT 1", ()),
        (b"SELECT '%%' || %(x)s::text", b"SELECT '%' || $1::text", ("x",)),
    ],
)
def test_numbered_gives_postgresql_placeholders_in_first_appearance_order(
    query: bytes, text: bytes, names: tuple[str, ...]
) -> None:
    assert queries.numbered(query) == (text, names)


def test_every_query_is_sent_as_its_readable_text_compacted() -> None:
    readable = queries.readable()
    assert {n: queries.compact(sql.decode()).encode() for n, sql in readable.items()} == dict(
        queries.load()
    )
