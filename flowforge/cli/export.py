"""``flowforge workflows export NAME``: a configured workflow (a file's or one defined in
Python, ``workflow_modules``) as YAML that loads back to an equal definition, same digest
(:func:`~flowforge.definitions.export_yaml`). A name no configured workflow has is one line
on stderr and exit 5 (not found), told apart from a broken definition (exit 2)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from flowforge.cli import exitcodes
from flowforge.config import load_config
from flowforge.definitions import export_yaml
from flowforge.discovery import load_config_workflows
from flowforge.errors import NotFoundError


def add_command(workflows: Any, common: argparse.ArgumentParser) -> None:
    """Register ``export`` on the ``flowforge workflows`` actions (``workflows``)."""
    p = workflows.add_parser(
        "export", help="print a configured workflow as a workflow file", parents=[common]
    )
    p.set_defaults(handler=export)
    p.add_argument("name", help="the workflow's name (flowforge workflows list)")


def export(args: argparse.Namespace) -> int:
    found = load_config_workflows(load_config(getattr(args, "config", None)))
    workflow = found.get(args.name)
    if workflow is None:
        known = ", ".join(sorted(found)) or "none"
        # main escapes the line: the name comes from the command line
        raise NotFoundError(f"no workflow is called {args.name!r} (configured: {known})")
    sys.stdout.write(export_yaml(workflow))  # printable ASCII only: export_yaml escapes
    return exitcodes.OK
