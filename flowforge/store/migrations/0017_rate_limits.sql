-- Rate limits (issue 20, SPEC 7.4; docs/flow-control.md "Rate limits").

-- A task's rate key (its `rate_limit.key` rendered over the run input; its handler's name when
-- the key is omitted), and the rule: at most `rate_limit` attempts of tasks with the key START
-- in any window of `rate_per_s` seconds, across every tree, on the database clock. A task with
-- a rate key never becomes READY by itself: the admission pass makes it READY while the key's
-- window has room (admit_gated). NULL: no rate limit, today's path.
ALTER TABLE task_runs ADD COLUMN rate_key text;
ALTER TABLE task_runs ADD COLUMN rate_limit integer CHECK (rate_limit IS NULL OR rate_limit >= 1);
ALTER TABLE task_runs ADD COLUMN rate_per_s double precision
    CHECK (rate_per_s IS NULL OR rate_per_s > 0);

-- Whether a task becomes READY by itself once nothing it waits on holds it (dependencies, an
-- ordering stream): a worker executes it (needs_worker, migrations 0012 and 0013) and no gate
-- holds it back (no concurrency key, no rate key: the admission pass decides those). One
-- column for the test every statement that makes a task READY makes (the release fragment,
-- promote_ready, retry_task_now; insert_tasks repeats its expression, checked by a unit test,
-- since its row does not exist yet). A generated column cannot read another, so the kinds are
-- spelled out. A new gate (a breaker, a pause) adds its column here. (Adding a stored
-- generated column rewrites task_runs once.)
ALTER TABLE task_runs
    ADD COLUMN ready_by_itself boolean NOT NULL
        GENERATED ALWAYS AS (sleep_s IS NULL AND for_each IS NULL AND event_name IS NULL
                             AND child_workflow IS NULL AND concurrency_key IS NULL
                             AND rate_key IS NULL) STORED;

-- The admission pass finds a rate key's waiting tasks (PENDING, RETRYING) and counts its READY
-- ones (admitted, not started: each will start). Unfinished tasks with a key only, as
-- task_runs_concurrency_idx (migration 0016): the pass costs nothing when nothing waits.
CREATE INDEX task_runs_rate_idx ON task_runs (rate_key, state)
    WHERE rate_key IS NOT NULL AND state IN ('PENDING', 'READY', 'RUNNING', 'RETRYING');

-- Each attempt of a rate-limited task carries its key (copied by the claim): the window counts
-- attempt STARTS (what a partner sees as calls), not admissions, so a dispatch delay cannot
-- bunch starts past the limit. Indexed for "the key's starts since now() - per".
ALTER TABLE task_attempts ADD COLUMN rate_key text;
CREATE INDEX task_attempts_rate_idx ON task_attempts (rate_key, started_at)
    WHERE rate_key IS NOT NULL;
