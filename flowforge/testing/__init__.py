"""Public help for testing *your own* workflows and handlers with FlowForge
(docs/testing-workflows.md).

- :class:`LocalRunner` runs a workflow's handlers in-process, in dependency order, with no
  PostgreSQL and no RabbitMQ, following the engine's rules that need no services (retries,
  ``PermanentError``, the worker's result checks, ``run_if``, maps, child runs, fail-fast);
  :class:`LocalRun` is what it returns, to assert on.
- ``flowforge.testing.pytest`` is an opt-in pytest plugin (``pytest_plugins =
  ["flowforge.testing.pytest"]``) whose ``flowforge_tree`` fixture runs a real ``flowforge
  up`` tree on a database and broker you name, for integration tests; ``flowforge.testing.tree``
  is the same without pytest.

This package ships in the wheel and is a promise to users. What lands here follows the
product's rules and four more:

- it imports only ``flowforge`` and its declared dependencies, never ``tests`` (pytest only
  inside the opt-in plugin module);
- it needs no checkout: no repository paths, every location (a config, a URL) is passed in by
  the caller;
- importing it starts nothing (no server, no thread) and declares no handlers;
- it is documented as API (docs/testing-workflows.md, README "Testing your workflows").

FlowForge's own developer harness — private PostgreSQL and RabbitMQ instances, replicas,
clusters, ``scripts/bench``, ``scripts/chaos`` and their handler modules — is not public and
lives in the checkout's ``tests/harness/`` (docs/architecture.md, "The harness and
flowforge.testing").
"""

from flowforge.testing.local import LocalRunner
from flowforge.testing.results import REUSED, LocalAttempt, LocalRun, LocalTask

__all__ = ["REUSED", "LocalAttempt", "LocalRun", "LocalRunner", "LocalTask"]
