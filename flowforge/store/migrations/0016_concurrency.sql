-- Concurrency limits (issue 20, SPEC 7.4; docs/flow-control.md "Concurrency and rate limits").

-- A task's concurrency key (its workflow's `concurrency.key` rendered over the run input) and
-- its limit: at most `limit` tasks with the key are READY or RUNNING at once, across every tree.
-- A task with a key never becomes READY by itself: the scheduler's admission pass makes it READY
-- when a slot is free (admit_concurrency). NULL: no limit, today's path.
ALTER TABLE task_runs ADD COLUMN concurrency_key text;
ALTER TABLE task_runs ADD COLUMN concurrency_limit integer
    CHECK (concurrency_limit IS NULL OR concurrency_limit >= 1);

-- The admission pass counts a key's holders (READY, RUNNING) and finds its waiting tasks
-- (PENDING, RETRYING) by key. Only tasks with a key that are not finished are in the index: the
-- pass runs on every scheduler wake-up, and must cost nothing when nothing waits, however many
-- limited tasks have finished.
CREATE INDEX task_runs_concurrency_idx ON task_runs (concurrency_key, seq)
    WHERE concurrency_key IS NOT NULL AND state IN ('PENDING', 'READY', 'RUNNING', 'RETRYING');
