"""Pure domain model: states, transitions, policies, definitions. No I/O, no clock."""
