"""Public help for testing *your own* workflows and handlers with FlowForge (reserved; empty).

This package ships in the wheel and is a promise to users, so it holds only what a user's test
suite needs and will keep relying on — for example a scratch-database fixture on a PostgreSQL
server the user names, running a workflow's tasks in-process against it, and a stub broker
for the worker. What lands here follows the product's rules and four more:

- it imports only ``flowforge`` and its declared dependencies, never ``tests`` (pytest only
  inside a function or an opt-in plugin module);
- it needs no checkout: no repository paths, every location (a base directory, a URL) is
  passed in by the caller;
- importing it starts nothing (no server, no thread) and declares no handlers;
- it is documented in the README as API.

FlowForge's own developer harness — private PostgreSQL and RabbitMQ instances, replicas,
clusters, ``scripts/bench``, ``scripts/chaos`` and their handler modules — is not public and
lives in the checkout's ``tests/harness/`` (docs/architecture.md, "The harness and
flowforge.testing").
"""
