"""FlowForge: a durable workflow engine for Python on PostgreSQL and RabbitMQ.

The public API is what this module exports; everything else may change between releases.
"""

from typing import TYPE_CHECKING, Any

from flowforge.config import Config, load_config
from flowforge.definitions import workflow_from_mapping
from flowforge.domain.breakers import CircuitBreaker
from flowforge.domain.conditions import RunIf
from flowforge.domain.dag import OnDead, TaskDef, WorkflowDef
from flowforge.domain.events import EventWait
from flowforge.domain.limits import Concurrency, RateLimit
from flowforge.domain.model import Run, TaskRun
from flowforge.domain.output import AttemptLog, Progress, ProgressError
from flowforge.domain.plan import RunRequest
from flowforge.domain.policy import Jitter, RetryPolicy
from flowforge.domain.reasons import FailureReason
from flowforge.domain.schedule import ScheduleDef
from flowforge.domain.states import RunState, TaskState
from flowforge.domain.timeline import MapRest, TimelineFacts, TimelineLimits, TimelineTask
from flowforge.errors import FlowForgeError, PermanentError, WaitTimeoutError
from flowforge.handlers import task
from flowforge.roles.context import TaskContext
from flowforge.workflow import Workflow

if TYPE_CHECKING:
    from flowforge.client import Client

__all__ = [
    "AttemptLog",
    "CircuitBreaker",
    "Client",
    "Concurrency",
    "Config",
    "EventWait",
    "FailureReason",
    "FlowForgeError",
    "Jitter",
    "MapRest",
    "OnDead",
    "PermanentError",
    "Progress",
    "ProgressError",
    "RateLimit",
    "RetryPolicy",
    "Run",
    "RunIf",
    "RunRequest",
    "RunState",
    "ScheduleDef",
    "TaskContext",
    "TaskDef",
    "TaskRun",
    "TaskState",
    "TimelineFacts",
    "TimelineLimits",
    "TimelineTask",
    "WaitTimeoutError",
    "Workflow",
    "WorkflowDef",
    "load_config",
    "task",
    "workflow_from_mapping",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The client pulls in psycopg (~20 MB per process): only processes that use it pay for it,
    # not the supervisor, which forks every role.
    if name == "Client":
        from flowforge.client import Client

        return Client
    raise AttributeError(f"module 'flowforge' has no attribute {name!r}")
