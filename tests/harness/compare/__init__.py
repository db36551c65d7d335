"""``scripts/bench --compare``: FlowForge and its peers on the same workloads, one after another.

- ``driver`` (FlowForge's ``.venv``): makes ``.venv-compare`` (the peers' pinned versions,
  ``constraints.txt`` here), runs FlowForge's workloads through ``tests/harness/bench.py``,
  runs each peer module in ``.venv-compare``, prints one table with ratios, writes the JSON;
- ``celery_bench``, ``dramatiq_bench``, ``procrastinate_bench`` (``.venv-compare``): one peer
  each, written from its documentation, with its durable settings stated in its docstring;
- ``common`` (``.venv-compare``): what the peer modules share.

Peer modules import no ``flowforge``: it is not installed where they run
(docs/performance.md, "Compared in one run").
"""
