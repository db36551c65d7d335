"""Exit codes of the ``flowforge`` command. Part of the public contract (see README)."""

OK = 0
INTERNAL = 1  # a bug or an unexpected failure
USAGE = 2  # bad command line, config, workflow definition, input or id
BOOT = 3  # ``up``: a role failed to boot
RESTART_LIMIT = 4  # ``up``: restart intensity exceeded
NOT_FOUND = 5  # no run / task run with that id
REFUSED = 6  # the request conflicts with the current state (not dead, key reused, schema ahead)
UNAVAILABLE = 7  # PostgreSQL (or RabbitMQ) cannot be reached
# ``status --wait``: the run's final state, or no final state in time
RUN_FAILED = 8  # the run ended FAILED (a task DEAD, or its deadline passed)
RUN_CANCELLED = 9  # the run ended CANCELLED
WAIT_TIMEOUT = 10  # the run was not finished within --timeout (it goes on)
SERVICE_MISSING = 11  # ``dev``: PostgreSQL or RabbitMQ is not installed here
SERVICE_FAILED = 12  # ``dev``: a private PostgreSQL or RabbitMQ could not start or stop
