"""The closed set of failure reasons, stored on attempts and task runs."""

from __future__ import annotations

from enum import StrEnum


class FailureReason(StrEnum):
    """Why an attempt or a task run failed. The spelling is part of the public contract."""

    HANDLER_ERROR = "handler_error"
    PERMANENT_ERROR = "permanent_error"
    LEASE_EXPIRED = "lease_expired"
    CRASH_LOOP = "crash_loop"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    UNKNOWN_HANDLER = "unknown_handler"
    UNSERIALIZABLE_RESULT = "unserializable_result"
    MAX_ATTEMPTS_EXCEEDED = "max_attempts_exceeded"
    RESULT_TOO_LARGE = "result_too_large"
    # a map (for_each) task, SPEC 7.3: its upstream result is no JSON list, has more items than
    # workflow.max_items, an item's key template cannot be rendered, or an item died
    NOT_A_LIST = "not_a_list"
    TOO_MANY_ITEMS = "too_many_items"
    ITEM_KEY_ERROR = "item_key_error"
    ITEM_FAILED = "item_failed"
    EVENT_TIMEOUT = "event_timeout"  # a wait_for_event task whose timeout passed first
    # a child-workflow task (workflow:, SPEC 7.3): its child run FAILED (retried by its retry
    # policy, a new child per attempt) or was cancelled by someone else; or no child could be
    # started: its workflow is registered nowhere, its input cannot be rendered (or planned
    # for the child), or it would nest deeper than domain/children.py's MAX_CHILD_DEPTH
    CHILD_FAILED = "child_failed"
    CHILD_CANCELLED = "child_cancelled"
    CHILD_WORKFLOW_UNKNOWN = "child_workflow_unknown"
    CHILD_INPUT_ERROR = "child_input_error"
    CHILD_DEPTH_EXCEEDED = "child_depth_exceeded"
    OPERATOR = "operator"  # buried by hand (`flowforge task bury`, SPEC 7.4)


class RunFailureReason(StrEnum):
    """Why a whole run was ended, stored on the run (a task's own reason is on the task)."""

    DEADLINE_EXCEEDED = "deadline_exceeded"


#: Attempt outcomes worth another attempt while the retry budget lasts. The others are
#: deterministic: running the same code on the same input again would fail the same way.
RETRYABLE_REASONS = frozenset(
    {
        FailureReason.HANDLER_ERROR,
        FailureReason.LEASE_EXPIRED,
        FailureReason.TIMEOUT,
        FailureReason.CHILD_FAILED,  # a new child run, as a handler is run again
    }
)
