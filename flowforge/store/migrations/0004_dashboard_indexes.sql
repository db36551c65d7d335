-- Indexes behind the dashboard's lists and overview, so no page scans every run or task.

-- Runs filtered by workflow and state together, newest first (keyset on created_at, id).
CREATE INDEX workflow_runs_workflow_state_created_idx
    ON workflow_runs (workflow, state, created_at DESC, id DESC);

-- Dead tasks newest first with the id as tie-breaker (keyset pages); supersedes the
-- finished_at-only index of 0001.
CREATE INDEX task_runs_dead_page_idx ON task_runs (finished_at DESC, id DESC) WHERE state = 'DEAD';
DROP INDEX task_runs_dead_idx;

-- Tasks finished per minute over the last hour.
CREATE INDEX task_runs_finished_idx ON task_runs (finished_at) WHERE finished_at IS NOT NULL;

-- Poison candidates: unfinished tasks (few) by the attempts they used.
CREATE INDEX task_runs_unfinished_attempt_idx ON task_runs (attempt)
    WHERE state NOT IN ('SUCCEEDED', 'CANCELLED', 'DEAD');
