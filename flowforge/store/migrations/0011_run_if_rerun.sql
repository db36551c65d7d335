-- Conditions and compensation (run_if) and rerun (issue 19, SPEC 7.3; docs/dynamic.md).

-- run_if: a conditional task (not all_succeeded) counts one more "dependency" in pending_deps,
-- its condition gate: successes and (through propagate) deaths and cancellations of its
-- dependencies count down to 1, and the scheduler's evaluate_conditions pass then opens the
-- gate (pending_deps 0: promote_ready does the rest) or skips the task (CANCELLED, cause
-- condition_not_met).
ALTER TABLE task_runs
    ADD COLUMN run_if text NOT NULL DEFAULT 'all_succeeded'
        CHECK (run_if IN ('all_succeeded', 'all_done', 'any_failed'));
ALTER TABLE task_runs DROP CONSTRAINT task_runs_cancel_cause_check;
ALTER TABLE task_runs ADD CONSTRAINT task_runs_cancel_cause_check
    CHECK (cancel_cause IN ('operator', 'upstream', 'deadline', 'condition_not_met'));

-- The evaluation pass reads only conditional tasks whose dependencies are all finished (the
-- lesson of migration 0005: a clause only its own query implies).
CREATE INDEX task_runs_condition_idx ON task_runs (seq)
    WHERE state = 'PENDING' AND pending_deps = 1 AND run_if <> 'all_succeeded';

-- Every rerun of a finished run: who, when, why, from which task, and which task runs it reset.
CREATE TABLE rerun_audit (
    id           bigserial   PRIMARY KEY,
    run_id       uuid        NOT NULL REFERENCES workflow_runs (id) ON DELETE CASCADE,
    requested_by text        NOT NULL,
    reason       text,
    from_task    text,
    previous_state text      NOT NULL,
    task_run_ids uuid[]      NOT NULL,
    task_names   text[]      NOT NULL,
    requested_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX rerun_audit_run_idx ON rerun_audit (run_id);
