"""The HTTP api child: JSON endpoints for runs and dead tasks, health probes, metrics."""
