"""The three roles — scheduler, publisher, worker — and the loop that keeps each one alive."""
