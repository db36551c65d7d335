-- READY tasks by the time they became READY: the scheduler looks for dispatches the broker lost.
CREATE INDEX task_runs_ready_idx ON task_runs (ready_at) WHERE state = 'READY';
