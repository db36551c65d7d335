"""Private PostgreSQL and RabbitMQ instances: what ``flowforge dev`` runs for a project.

Each instance lives entirely under a base directory of its own (data, sockets, logs, config,
pid files, Erlang cookie), listens on 127.0.0.1 only, on ports chosen by the caller, and never
reads the machine's shared configuration (``/etc/postgresql``, ``/etc/rabbitmq``,
``/var/lib/rabbitmq/.erlang.cookie``). Processes are always addressed by the pid this package
recorded or read from the instance's own pid file, never by name. The test harness
(tests/harness/services.py) runs the same classes for the tests and ``scripts/services``.

Importing the package imports nothing heavy: ``postgres`` and ``rabbitmq`` are imported by
whoever starts one.
"""
