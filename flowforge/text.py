"""Untrusted text made safe to show: one rule for the CLI, the log lines roles write, and the
api's access log.

(``supervisor/logs.py`` has its own table-driven copy for every log line of the tree, because
``supervisor/`` imports nothing from ``flowforge/``.)
"""

from __future__ import annotations


def escape(text: str) -> str:
    """``text`` with every non-printable character — C0 and C1 controls (ESC starts every
    escape sequence; CSI is also the single C1 character U+009B), DEL, line and paragraph
    separators, format characters such as bidi overrides, lone surrogates — written as a Python
    escape (``\\x1b``, ``\\n``, ``\\u202e``): one line, nothing a terminal would act on.
    Printable text, spaces included, is unchanged."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)
