"""The tutorial's application package (docs/tutorial.md)."""
