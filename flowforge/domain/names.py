"""What a name of FlowForge's own may be: a workflow, task, handler or event name."""

from __future__ import annotations

import re

#: 1-128 letters, digits, ``_``, ``.`` and ``-``, not starting with ``.`` or ``-``.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
