"""The HTTP api child: JSON endpoints for runs, tasks, dead tasks and the system overview,
health probes, metrics, and the dashboard pages (flowforge/dashboard/)."""
