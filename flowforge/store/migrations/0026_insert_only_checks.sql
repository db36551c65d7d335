-- The checks of task_runs' columns that only an INSERT writes move to a trigger that runs them
-- only when a row is inserted or an UPDATE names one of those columns (issue 22, "Efficiency";
-- docs/performance.md "CHECK constraints on the hot tables").
--
-- PostgreSQL evaluates every CHECK constraint of a table on every UPDATE of a row, whatever
-- columns it sets, and before that it parses each constraint's stored expression
-- (pg_constraint.conbin) and prepares it once per statement. task_runs had 21 checks (15.6 KB
-- of expression text), and a chain hop updates task_runs in four statements: about half the
-- CPU of a one-row UPDATE went to them. Sixteen guard columns that no UPDATE of the store ever
-- sets (the task's configuration: retries, limits, keys of a map item or event wait, the
-- condition, the priority); the five others (state, pending_deps, cancel_cause, parked_on,
-- progress) stay CHECK constraints.
--
-- The trigger keeps every guarantee: a bad value is refused on INSERT, and on any UPDATE that
-- sets one of those columns, with the same error as the constraint's (SQLSTATE 23514
-- check_violation, the constraint's name in the message and in the error's constraint field).
-- It is an AFTER ROW trigger whose WHEN clause holds the sixteen conditions: PostgreSQL
-- evaluates the clause in C as the row is written and queues nothing when the row is good, so
-- a good row never calls the function, and an UPDATE that names none of the columns does not
-- even evaluate the clause (the column list is checked first). task_runs already has AFTER ROW
-- INSERT and UPDATE triggers (its foreign keys'), so this adds no per-row fetch of the old row.
-- A condition holds, as a CHECK's does, unless it is false: NULL passes. The trigger fires
-- with session_replication_role = replica too (ENABLE ALWAYS), as a constraint is checked.
--
-- Catalog changes only: no table rewrite or scan (the rows in the table satisfy the
-- conditions already: they were checked), under a short ACCESS EXCLUSIVE lock of task_runs
-- (DROP CONSTRAINT), held until the migration commits: a few milliseconds once running
-- transactions on task_runs let it be taken.

-- Raise the error the constraint would have for the first condition NEW breaks (in the
-- constraints' name order, PostgreSQL's). Only called for a row the trigger's WHEN refused.
CREATE FUNCTION flowforge_task_runs_refuse() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    broken text := CASE
        WHEN (NEW.breaker_cooldown_s IS NULL OR NEW.breaker_cooldown_s > 0) IS FALSE
            THEN 'task_runs_breaker_cooldown_s_check'
        WHEN (NEW.breaker_failures IS NULL OR NEW.breaker_failures >= 1) IS FALSE
            THEN 'task_runs_breaker_failures_check'
        WHEN (NEW.breaker_window_s IS NULL OR NEW.breaker_window_s > 0) IS FALSE
            THEN 'task_runs_breaker_window_s_check'
        WHEN (NEW.concurrency_limit IS NULL OR NEW.concurrency_limit >= 1) IS FALSE
            THEN 'task_runs_concurrency_limit_check'
        WHEN (NEW.event_timeout_s > 0) IS FALSE
            THEN 'task_runs_event_timeout_s_check'
        WHEN ((NEW.event_name IS NULL) = (NEW.event_key IS NULL)
              AND (NEW.event_name IS NULL) = (NEW.event_timeout_s IS NULL)) IS FALSE
            THEN 'task_runs_event_wait_check'
        WHEN ((NEW.map_id IS NULL) = (NEW.item_index IS NULL)) IS FALSE
            THEN 'task_runs_item_check'
        WHEN (NEW.item_index >= 0) IS FALSE
            THEN 'task_runs_item_index_check'
        WHEN (NEW.max_attempts >= 1) IS FALSE
            THEN 'task_runs_max_attempts_check'
        WHEN (NEW.max_parallel >= 1) IS FALSE
            THEN 'task_runs_max_parallel_check'
        WHEN (NEW.on_dead IN ('release', 'block')) IS FALSE
            THEN 'task_runs_on_dead_check'
        WHEN (NEW.priority BETWEEN 0 AND 9) IS FALSE
            THEN 'task_runs_priority_check'
        WHEN (NEW.rate_limit IS NULL OR NEW.rate_limit >= 1) IS FALSE
            THEN 'task_runs_rate_limit_check'
        WHEN (NEW.rate_per_s IS NULL OR NEW.rate_per_s > 0) IS FALSE
            THEN 'task_runs_rate_per_s_check'
        WHEN (NEW.run_if IN ('all_succeeded', 'all_done', 'any_failed')) IS FALSE
            THEN 'task_runs_run_if_check'
        WHEN (NEW.sleep_s > 0) IS FALSE
            THEN 'task_runs_sleep_s_check'
    END;
BEGIN
    IF broken IS NULL THEN
        -- the WHEN clause and this list disagree: refuse all the same, saying so
        broken := 'task_runs_insert_only_checks';
    END IF;
    RAISE EXCEPTION 'new row for relation "%" violates check constraint "%"', TG_TABLE_NAME, broken
        USING ERRCODE = 'check_violation', CONSTRAINT = broken, TABLE = TG_TABLE_NAME,
              SCHEMA = TG_TABLE_SCHEMA, DETAIL = format('Failing row contains %s.', NEW);
END
$$;

ALTER TABLE task_runs
    DROP CONSTRAINT task_runs_breaker_cooldown_s_check,
    DROP CONSTRAINT task_runs_breaker_failures_check,
    DROP CONSTRAINT task_runs_breaker_window_s_check,
    DROP CONSTRAINT task_runs_concurrency_limit_check,
    DROP CONSTRAINT task_runs_event_timeout_s_check,
    DROP CONSTRAINT task_runs_event_wait_check,
    DROP CONSTRAINT task_runs_item_check,
    DROP CONSTRAINT task_runs_item_index_check,
    DROP CONSTRAINT task_runs_max_attempts_check,
    DROP CONSTRAINT task_runs_max_parallel_check,
    DROP CONSTRAINT task_runs_on_dead_check,
    DROP CONSTRAINT task_runs_priority_check,
    DROP CONSTRAINT task_runs_rate_limit_check,
    DROP CONSTRAINT task_runs_rate_per_s_check,
    DROP CONSTRAINT task_runs_run_if_check,
    DROP CONSTRAINT task_runs_sleep_s_check;

-- The column list is every column a condition reads: an UPDATE naming none of them skips the
-- trigger before its WHEN clause is looked at.
CREATE TRIGGER task_runs_insert_only_checks
    AFTER INSERT OR UPDATE OF breaker_cooldown_s, breaker_failures, breaker_window_s,
        concurrency_limit, event_name, event_key, event_timeout_s, map_id, item_index,
        max_attempts, max_parallel, on_dead, priority, rate_limit, rate_per_s, run_if, sleep_s
    ON task_runs
    FOR EACH ROW
    WHEN ((NEW.breaker_cooldown_s IS NULL OR NEW.breaker_cooldown_s > 0) IS FALSE
       OR (NEW.breaker_failures IS NULL OR NEW.breaker_failures >= 1) IS FALSE
       OR (NEW.breaker_window_s IS NULL OR NEW.breaker_window_s > 0) IS FALSE
       OR (NEW.concurrency_limit IS NULL OR NEW.concurrency_limit >= 1) IS FALSE
       OR (NEW.event_timeout_s > 0) IS FALSE
       OR ((NEW.event_name IS NULL) = (NEW.event_key IS NULL)
           AND (NEW.event_name IS NULL) = (NEW.event_timeout_s IS NULL)) IS FALSE
       OR ((NEW.map_id IS NULL) = (NEW.item_index IS NULL)) IS FALSE
       OR (NEW.item_index >= 0) IS FALSE
       OR (NEW.max_attempts >= 1) IS FALSE
       OR (NEW.max_parallel >= 1) IS FALSE
       OR (NEW.on_dead IN ('release', 'block')) IS FALSE
       OR (NEW.priority BETWEEN 0 AND 9) IS FALSE
       OR (NEW.rate_limit IS NULL OR NEW.rate_limit >= 1) IS FALSE
       OR (NEW.rate_per_s IS NULL OR NEW.rate_per_s > 0) IS FALSE
       OR (NEW.run_if IN ('all_succeeded', 'all_done', 'any_failed')) IS FALSE
       OR (NEW.sleep_s > 0) IS FALSE)
    EXECUTE FUNCTION flowforge_task_runs_refuse();

ALTER TABLE task_runs ENABLE ALWAYS TRIGGER task_runs_insert_only_checks;
