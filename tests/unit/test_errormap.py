"""The one error map (flowforge/errormap.py): every error class has a row, the command and the
API read it, and the two columns tell the caller the same thing."""

from __future__ import annotations

import importlib
import logging
import pkgutil
from collections.abc import Iterator
from http import HTTPStatus

import falcon
import pytest

import flowforge
from flowforge.api.errors import handle_flowforge_error
from flowforge.cli import commands, exitcodes
from flowforge.cli.main import main
from flowforge.errormap import ERRORS, Meaning, exit_code_for, http_status_for, meaning
from flowforge.errors import (
    BrokerUnavailableError,
    ConfigError,
    DatabaseUnavailableError,
    DefinitionError,
    DevServiceError,
    DevServiceMissingError,
    FlowForgeError,
    InputError,
    MigrationError,
    UnstorableValueError,
    ValueTooLargeError,
)

#: What a caller is told, the same through both doors.
CALLER_SIDE = {
    (exitcodes.USAGE, HTTPStatus.BAD_REQUEST),
    (exitcodes.USAGE, HTTPStatus.UNPROCESSABLE_ENTITY),
    (exitcodes.NOT_FOUND, HTTPStatus.NOT_FOUND),
    (exitcodes.REFUSED, HTTPStatus.CONFLICT),
    (exitcodes.UNAVAILABLE, HTTPStatus.SERVICE_UNAVAILABLE),
    (exitcodes.INTERNAL, HTTPStatus.INTERNAL_SERVER_ERROR),
    # a wait that ended before the run did (the api never waits: only the command raises it)
    (exitcodes.WAIT_TIMEOUT, HTTPStatus.GATEWAY_TIMEOUT),
}
#: The operator's own configuration, definitions and schema: no fault of an HTTP caller.
OPERATOR_SIDE = (ConfigError, DefinitionError, MigrationError)
#: ``flowforge dev``'s private services on this machine: an exit code each, never met by the api.
MACHINE_SIDE = {
    DevServiceError: exitcodes.SERVICE_FAILED,
    DevServiceMissingError: exitcodes.SERVICE_MISSING,
}


def _product_modules() -> Iterator[str]:
    for found in pkgutil.walk_packages(flowforge.__path__, "flowforge."):
        # the harness is not the product; __main__ would run the command
        if not found.name.startswith("flowforge.testing") and not found.name.endswith("__main__"):
            yield found.name


def _error_classes() -> set[type[FlowForgeError]]:
    for name in _product_modules():  # an error class declared anywhere in the product counts
        importlib.import_module(name)
    found: set[type[FlowForgeError]] = set()
    todo: list[type[FlowForgeError]] = [FlowForgeError]
    while todo:
        kind = todo.pop()
        if kind.__module__.startswith("flowforge.") and kind not in found:
            found.add(kind)
            todo.extend(kind.__subclasses__())
    return found


ERROR_CLASSES = sorted(_error_classes(), key=lambda kind: kind.__qualname__)


def test_every_error_class_of_the_product_has_a_row_of_its_own() -> None:
    missing = [k.__qualname__ for k in ERROR_CLASSES if k not in ERRORS]
    assert not missing, f"add these to flowforge/errormap.py ERRORS: {missing}"
    assert len(ERROR_CLASSES) > 20  # the walk found the tree, not just its root


@pytest.mark.parametrize("kind", ERROR_CLASSES, ids=lambda k: k.__qualname__)
def test_the_most_specific_row_wins(kind: type[FlowForgeError]) -> None:
    assert meaning(kind("x")) is ERRORS[kind]


@pytest.mark.parametrize(("kind", "row"), ERRORS.items(), ids=lambda k: getattr(k, "__name__", ""))
def test_the_command_and_the_api_tell_the_caller_the_same(
    kind: type[FlowForgeError], row: Meaning
) -> None:
    pair = (row.exit_code, row.status)
    if kind in MACHINE_SIDE:
        assert pair == (MACHINE_SIDE[kind], HTTPStatus.INTERNAL_SERVER_ERROR), kind
    elif issubclass(kind, OPERATOR_SIDE):
        assert row.status == HTTPStatus.INTERNAL_SERVER_ERROR, kind
        assert row.exit_code in (exitcodes.USAGE, exitcodes.REFUSED), kind
    else:
        assert pair in CALLER_SIDE, kind


def test_only_an_outage_is_exit_7_and_503() -> None:
    outages = {k for k, row in ERRORS.items() if row.status == HTTPStatus.SERVICE_UNAVAILABLE}
    sevens = {k for k, row in ERRORS.items() if row.exit_code == exitcodes.UNAVAILABLE}
    assert outages == sevens == {DatabaseUnavailableError, BrokerUnavailableError}


@pytest.mark.parametrize("kind", [InputError, UnstorableValueError, ValueTooLargeError])
def test_a_bad_input_is_exit_2_and_400(kind: type[FlowForgeError]) -> None:
    assert exit_code_for(kind("x")) == exitcodes.USAGE
    assert http_status_for(kind("x")) == HTTPStatus.BAD_REQUEST


def test_an_error_from_outside_flowforge_is_internal() -> None:
    assert exit_code_for(KeyError("x")) == exitcodes.INTERNAL
    assert http_status_for(KeyError("x")) == HTTPStatus.INTERNAL_SERVER_ERROR


@pytest.mark.parametrize("kind", ERROR_CLASSES, ids=lambda k: k.__qualname__)
def test_the_command_exits_with_the_row_of_the_error(
    kind: type[FlowForgeError], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(_args: object) -> int:
        raise kind("said plainly")

    monkeypatch.setattr(commands, "status", fail)
    try:
        assert main(["status", "x"]) == ERRORS[kind].exit_code
    finally:
        logging.disable(logging.NOTSET)  # main() silences logging without -v
    assert capsys.readouterr().err == "flowforge: said plainly\n"


@pytest.mark.parametrize("kind", ERROR_CLASSES, ids=lambda k: k.__qualname__)
def test_the_api_answers_with_the_row_of_the_error(kind: type[FlowForgeError]) -> None:
    with pytest.raises(falcon.HTTPError) as raised:
        handle_flowforge_error(None, None, kind("said plainly"), None)  # type: ignore[arg-type]
    status = ERRORS[kind].status
    assert raised.value.status == falcon.code_to_http_status(status)
    # a 500 shows only an error id; a 4xx or 503 says what went wrong
    said = "said plainly" in str(raised.value.title)
    assert said is (status != HTTPStatus.INTERNAL_SERVER_ERROR)
