"""A generic process supervisor (it imports nothing from flowforge)."""
