-- Priorities (issue 20, SPEC 7.4; docs/flow-control.md "Priorities").

-- A task's priority, 0 (the default) to 9, higher first within its queue: the trigger's when it
-- named one, else its workflow's `priority:`. Every dispatch of the task carries it.
ALTER TABLE task_runs ADD COLUMN priority smallint NOT NULL DEFAULT 0
    CHECK (priority BETWEEN 0 AND 9);

-- Each outbox row carries its task's priority (as it carries its queue, migration 0014), so the
-- publisher takes the highest first and sends each to its queue's priority band without
-- reading the task.
ALTER TABLE outbox ADD COLUMN priority smallint NOT NULL DEFAULT 0
    CHECK (priority BETWEEN 0 AND 9);

-- The priority a run was triggered with (NULL: none, its tasks take their own). A child run
-- inherits its parent run's.
ALTER TABLE workflow_runs ADD COLUMN priority smallint CHECK (priority BETWEEN 0 AND 9);

-- lock_outbox takes pending rows highest priority first, then oldest: a priority-9 dispatch
-- does not wait behind a backlog of priority-0 rows. The index it replaces ordered by id only.
CREATE INDEX outbox_pending_priority_idx ON outbox (priority DESC, id)
    WHERE published_at IS NULL;
DROP INDEX outbox_pending_idx;
