-- Partial indexes the hot statements cannot be planned through.
--
-- A partial index whose predicate is only a state (state = 'READY', state = 'RUNNING',
-- state NOT IN finished states) is implied by the worker's own statements, which look tasks
-- up by id *and* state. When the statistics said such tasks were few — after a burst of
-- single-task runs, say, or on a fresh install — the planner drove the claim and the finish
-- through the partial index instead of the primary key: every claim read every READY task
-- and a finish that released 10,000 dependents scanned 10,000 entries per dependent (19 s
-- instead of 20 ms). Each index below carries one more clause that its own query implies
-- (a comparison on the column implies IS NOT NULL; the poison query states attempt > 0)
-- and no claim, finish or release does, so those statements use the primary key whatever
-- the statistics say. The rows each index covers for its query are unchanged. (The claim
-- and the finish also hide their state tests from index matching: queries.sql.)
DROP INDEX task_runs_unfinished_attempt_idx;
CREATE INDEX task_runs_poison_idx ON task_runs (attempt)
    WHERE attempt > 0 AND state NOT IN ('SUCCEEDED', 'CANCELLED', 'DEAD');

DROP INDEX task_runs_ready_idx;
CREATE INDEX task_runs_ready_idx ON task_runs (ready_at)
    WHERE state = 'READY' AND ready_at IS NOT NULL;

DROP INDEX task_runs_lease_idx;
CREATE INDEX task_runs_lease_idx ON task_runs (lease_expires_at)
    WHERE state = 'RUNNING' AND lease_expires_at IS NOT NULL;
