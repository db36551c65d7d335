"""FlowForge's developer harness: never installed, run from a checkout by scripts/ and tests/.

- ``services``: private PostgreSQL and RabbitMQ instances (``scripts/services``);
- ``replication``, ``cluster``: a replicated PostgreSQL pair, a private RabbitMQ cluster;
- ``tls``: a throwaway CA, and private PostgreSQL / RabbitMQ that take TLS clients;
- ``bench`` with ``bench_handlers``: ``scripts/bench``;
- ``chaos`` with ``chaos_handlers``: ``scripts/chaos``;
- ``resources``: scratch databases, free ports, child processes.

What users need to test their own workflows is the public ``flowforge.testing`` package, not
this one (docs/architecture.md, "The harness and flowforge.testing").
"""

from __future__ import annotations

from pathlib import Path

#: The checkout this harness runs from. Sound by construction, not a guess: ``tests/`` is never
#: packaged (``[tool.setuptools.packages.find]`` includes only ``flowforge*`` and ``supervisor*``,
#: tests/integration/test_packaging.py proves it), so this file exists only at
#: ``<checkout>/tests/harness/__init__.py``, and ``tests.harness`` imports only when
#: ``<checkout>`` is on ``sys.path``.
CHECKOUT = Path(__file__).resolve().parents[2]
