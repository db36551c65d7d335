-- Control of single tasks (issue 20, SPEC 7.4; docs/flow-control.md "Controlling single tasks").

-- A bury asked of a task a worker is executing: the task is asked to stop (cancel_requested) and,
-- once its worker (or the reaper) ends it, it goes DEAD with failure reason 'operator' instead of
-- CANCELLED. Every statement that ends a stopped task reads this flag.
ALTER TABLE task_runs ADD COLUMN bury_requested boolean NOT NULL DEFAULT false;

-- One audit design for every operator action on a single task: who, when, why, what it changed
-- (the state before and after, the attempt it was on, and action-specific facts in details).
-- requeue_audit and rerun_audit stay as they are (their queries and readers are unchanged);
-- operator_actions below reads all three as one.
CREATE TABLE task_audit (
    id             bigserial   PRIMARY KEY,
    task_run_id    uuid        NOT NULL REFERENCES task_runs (id) ON DELETE CASCADE,
    run_id         uuid        NOT NULL REFERENCES workflow_runs (id) ON DELETE CASCADE,
    action         text        NOT NULL CHECK (action IN ('cancel', 'retry_now', 'bury')),
    requested_by   text        NOT NULL,
    reason         text,
    previous_state text        NOT NULL,
    new_state      text        NOT NULL,
    attempt        integer     NOT NULL,
    details        jsonb       NOT NULL DEFAULT '{}'::jsonb,
    requested_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX task_audit_task_idx ON task_audit (task_run_id);
CREATE INDEX task_audit_run_idx ON task_audit (run_id);

-- Every operator action in one shape, newest last per id sequence: SQL readers (and a later
-- `flowforge audit`) need not know which table an action writes.
CREATE VIEW operator_actions AS
SELECT 'task_audit' AS source, a.id, a.action, a.run_id, a.task_run_id, a.requested_by,
       a.reason, a.previous_state, a.new_state, a.details, a.requested_at
  FROM task_audit a
UNION ALL
SELECT 'requeue_audit', q.id, 'requeue', t.run_id, q.task_run_id, q.requested_by, q.reason,
       'DEAD', 'PENDING',
       jsonb_build_object('previous_reason', q.previous_reason, 'attempt', q.attempt),
       q.requested_at
  FROM requeue_audit q JOIN task_runs t ON t.id = q.task_run_id
UNION ALL
SELECT 'rerun_audit', r.id, 'rerun', r.run_id, NULL, r.requested_by, r.reason,
       r.previous_state, NULL,
       jsonb_build_object('from_task', r.from_task, 'task_run_ids', r.task_run_ids,
                          'task_names', r.task_names),
       r.requested_at
  FROM rerun_audit r;
