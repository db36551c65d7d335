"""Exit codes between the supervisor and its children, and of the supervisor itself.

Children use the ``CHILD_*`` codes to tell the supervisor what their exit means; the
supervisor's own codes are the top-level ones (documented in the README).
"""

CLEAN = 0
INTERNAL = 1
USAGE = 2
BOOT_FAILED = 3
RESTART_LIMIT = 4

#: A child that cannot boot (bad config, import error, wrong queue type): stop the tree.
CHILD_BOOT_FAILURE = 78  # sysexits EX_CONFIG
#: A child that asks to be replaced (recycling, or a handler that overran its timeout).
CHILD_RECYCLE = 75  # sysexits EX_TEMPFAIL
