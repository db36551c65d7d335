"""Process titles (``ps`` shows ``flowforge: worker 2/4``) when setproctitle is installed."""

from __future__ import annotations

import importlib


def set_title(title: str) -> None:
    """Set this process's title; silently a no-op without setproctitle."""
    try:
        module = importlib.import_module("setproctitle")
    except ImportError:
        return
    module.setproctitle(title)
