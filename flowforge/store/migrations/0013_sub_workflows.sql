-- Sub-workflows: a task that starts a child run per attempt (workflow:, issue 19, SPEC 7.3;
-- docs/dynamic.md "Sub-workflows"). A child task is RUNNING with no lease and no outbox row
-- while its child run runs (like an event wait); the child run links back to it.

-- child_workflow: the workflow a child task starts (NULL for every other task); child_run_id:
-- the child run of its latest attempt (every attempt's child links back to it below).
ALTER TABLE task_runs
    ADD COLUMN child_workflow text,
    ADD COLUMN child_run_id   uuid;
-- A child task is a kind no worker executes (docs/architecture.md, "Task kinds"): needs_worker
-- (migration 0012) gains its column. A generated column's expression cannot be altered: it is
-- dropped and added again (task_runs is rewritten once; no index or view reads the column).
ALTER TABLE task_runs DROP COLUMN needs_worker;
ALTER TABLE task_runs
    ADD COLUMN needs_worker boolean NOT NULL
        GENERATED ALWAYS AS (sleep_s IS NULL AND for_each IS NULL AND event_name IS NULL
                             AND child_workflow IS NULL) STORED;

-- parent_run_id / parent_task_id / parent_attempt: the task (and its attempt) that started a
-- child run, all three or none; depth: 0 for a run triggered by a caller, its parent's + 1 for
-- a child (bounded at run time: domain/children.py MAX_CHILD_DEPTH). No foreign keys: a run
-- and its child are purged by retention each on its own.
ALTER TABLE workflow_runs
    ADD COLUMN parent_run_id  uuid,
    ADD COLUMN parent_task_id uuid,
    ADD COLUMN parent_attempt integer,
    ADD COLUMN depth          integer NOT NULL DEFAULT 0 CHECK (depth >= 0),
    ADD CONSTRAINT workflow_runs_parent_check
        CHECK ((parent_run_id IS NULL) = (parent_task_id IS NULL)
               AND (parent_task_id IS NULL) = (parent_attempt IS NULL)
               AND (parent_task_id IS NULL) = (depth = 0));

-- Exactly one child run per attempt of a child task, whatever the scheduler does or dies of:
-- a second insert for the same (task, attempt) is refused by the database.
CREATE UNIQUE INDEX workflow_runs_parent_attempt_idx ON workflow_runs (parent_task_id, parent_attempt)
    WHERE parent_task_id IS NOT NULL;
-- A run's children (status, API, dashboard).
CREATE INDEX workflow_runs_parent_run_idx ON workflow_runs (parent_run_id, created_at)
    WHERE parent_run_id IS NOT NULL;

-- The start pass: child tasks whose dependencies are met or whose retry is due; the settle
-- pass: child tasks whose child runs (the lesson of migration 0005: a clause only its own
-- query implies).
CREATE INDEX task_runs_child_start_idx ON task_runs (seq)
    WHERE state IN ('PENDING', 'RETRYING') AND child_workflow IS NOT NULL;
CREATE INDEX task_runs_child_running_idx ON task_runs (seq)
    WHERE state = 'RUNNING' AND child_workflow IS NOT NULL;
