"""Example handlers for the example workflows."""
