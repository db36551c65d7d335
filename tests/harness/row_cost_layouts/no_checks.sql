-- task_runs with no check at all (the floor a layout of checks is measured against).
DROP TRIGGER task_runs_insert_only_checks ON task_runs;
ALTER TABLE task_runs
    DROP CONSTRAINT task_runs_cancel_cause_check,
    DROP CONSTRAINT task_runs_parked_on_check,
    DROP CONSTRAINT task_runs_pending_deps_check,
    DROP CONSTRAINT task_runs_progress_check,
    DROP CONSTRAINT task_runs_state_check;
