"""``python -m flowforge.cli`` runs the ``flowforge`` command."""

from flowforge.cli.main import entry_point

entry_point()
