-- Delayed runs, durable timers and deadlines (issue 18, SPEC 7.2; docs/time.md).
-- Every instant below is written by PostgreSQL's clock: start_at and deadline_at are computed
-- in the trigger's statement (or judged against its now()), wake_at by the pass that starts a
-- timer.

-- A delayed run is SCHEDULED until start_at; deadline_at = (start_at, else created_at) +
-- deadline; failure_reason says why the run itself was ended (a deadline), beside its tasks'.
ALTER TABLE workflow_runs
    ADD COLUMN start_at       timestamptz,
    ADD COLUMN deadline_at    timestamptz,
    ADD COLUMN failure_reason text CHECK (failure_reason IN ('deadline_exceeded'));
ALTER TABLE workflow_runs DROP CONSTRAINT workflow_runs_state_check;
ALTER TABLE workflow_runs ADD CONSTRAINT workflow_runs_state_check
    CHECK (state IN ('SCHEDULED', 'PENDING', 'RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED'));

-- start_gate: a root task of a delayed run; its pending_deps counts the run's start as one
-- more dependency, which start_due_runs removes (so promote_ready does the rest).
-- sleep_s: a durable timer (no handler); wake_at: when a sleeping timer (RUNNING, no lease)
-- succeeds.
ALTER TABLE task_runs
    ADD COLUMN start_gate boolean          NOT NULL DEFAULT false,
    ADD COLUMN sleep_s    double precision CHECK (sleep_s > 0),
    ADD COLUMN wake_at    timestamptz;
ALTER TABLE task_runs DROP CONSTRAINT task_runs_cancel_cause_check;
ALTER TABLE task_runs ADD CONSTRAINT task_runs_cancel_cause_check
    CHECK (cancel_cause IN ('operator', 'upstream', 'deadline'));

-- Each pass reads only what is due, through a partial index whose extra clause its own query
-- implies (the lesson of migration 0005): nothing else is planned through them.
CREATE INDEX workflow_runs_due_start_idx ON workflow_runs (start_at)
    WHERE state = 'SCHEDULED' AND start_at IS NOT NULL;
CREATE INDEX workflow_runs_deadline_idx ON workflow_runs (deadline_at)
    WHERE deadline_at IS NOT NULL AND finished_at IS NULL AND failure_reason IS NULL
      AND cancel_requested_at IS NULL;
CREATE INDEX task_runs_wake_idx ON task_runs (wake_at)
    WHERE state = 'RUNNING' AND wake_at IS NOT NULL;
CREATE INDEX task_runs_timer_idx ON task_runs (seq)
    WHERE state = 'PENDING' AND pending_deps = 0 AND sleep_s IS NOT NULL;
