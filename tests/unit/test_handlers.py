"""Handler declaration (@task) and collection from modules listed in the config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flowforge.errors import ConfigError, DefinitionError
from flowforge.handlers import MARK, collect, task
from tests.modules import module_dir, unique, write_module

__all__ = ["module_dir"]  # a fixture: used by name


def test_task_marks_function_and_returns_it_unchanged() -> None:
    def charge(ctx: object) -> str:
        return "ok"

    marked = task("payments.charge")(charge)
    assert marked is charge
    assert getattr(charge, MARK) == "payments.charge"
    assert charge(None) == "ok"


@pytest.mark.parametrize("name", ["", "has space", "a/b", "x" * 129, 42])
def test_task_refuses_invalid_handler_name(name: object) -> None:
    with pytest.raises(DefinitionError, match="handler name"):
        task(name)  # type: ignore[arg-type]


def test_collect_imports_module_from_search_path_and_returns_handlers(module_dir: Path) -> None:
    name = unique("handlers_mod")
    write_module(
        module_dir,
        name,
        """
        from flowforge.handlers import task

        @task("payments.charge")
        def charge(ctx):
            return {"charged": True}

        @task("shipping.ship")
        def ship(ctx):
            return "shipped"

        def helper(ctx):
            return None
        """,
    )
    found = collect([name], search_path=str(module_dir))
    assert sorted(found) == ["payments.charge", "shipping.ship"]
    assert found["payments.charge"](None) == {"charged": True}
    assert found["shipping.ship"].__name__ == "ship"
    assert str(module_dir) in sys.path


def test_collect_result_is_read_only(module_dir: Path) -> None:
    name = unique("ro_mod")
    write_module(
        module_dir,
        name,
        "from flowforge.handlers import task\n\n@task('a')\ndef a(ctx):\n    return 1\n",
    )
    found = collect([name], search_path=str(module_dir))
    with pytest.raises(TypeError):
        found["b"] = found["a"]  # type: ignore[index]


def test_collect_merges_several_modules(module_dir: Path) -> None:
    first, second = unique("mod_a"), unique("mod_b")
    write_module(
        module_dir,
        first,
        "from flowforge.handlers import task\n\n@task('one')\ndef one(ctx):\n    return 1\n",
    )
    write_module(
        module_dir,
        second,
        f"from {first} import one\n"
        "from flowforge.handlers import task\n\n"
        "@task('two')\ndef two(ctx):\n    return 2\n",
    )
    found = collect([first, second], search_path=str(module_dir))
    assert sorted(found) == ["one", "two"]


def test_collect_refuses_two_handlers_with_one_name(module_dir: Path) -> None:
    first, second = unique("dup_a"), unique("dup_b")
    for module in (first, second):
        write_module(
            module_dir,
            module,
            "from flowforge.handlers import task\n\n@task('same')\ndef fn(ctx):\n    return 1\n",
        )
    with pytest.raises(ConfigError, match="two handlers are named 'same'"):
        collect([first, second], search_path=str(module_dir))


def test_collect_turns_missing_module_into_config_error(module_dir: Path) -> None:
    name = unique("does_not_exist")
    with pytest.raises(ConfigError, match=f"cannot import '{name}'"):
        collect([name], search_path=str(module_dir))


def test_collect_turns_import_time_exception_into_config_error(module_dir: Path) -> None:
    name = unique("boom_mod")
    write_module(module_dir, name, "raise RuntimeError('boom at import')\n")
    with pytest.raises(ConfigError) as info:
        collect([name], search_path=str(module_dir))
    assert name in str(info.value) and "boom at import" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_collect_turns_syntax_error_into_config_error(module_dir: Path) -> None:
    name = unique("syntax_mod")
    write_module(module_dir, name, "def broken(:\n")
    with pytest.raises(ConfigError, match=name):
        collect([name], search_path=str(module_dir))


def test_collect_of_no_modules_is_empty() -> None:
    assert dict(collect([])) == {}
