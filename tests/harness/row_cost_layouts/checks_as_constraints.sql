-- task_runs as before migration 0026: the sixteen insert-only conditions as CHECK constraints
-- (same names, same expressions), no trigger.
DROP TRIGGER task_runs_insert_only_checks ON task_runs;
ALTER TABLE task_runs
    ADD CONSTRAINT task_runs_breaker_cooldown_s_check
        CHECK (breaker_cooldown_s IS NULL OR breaker_cooldown_s > 0),
    ADD CONSTRAINT task_runs_breaker_failures_check
        CHECK (breaker_failures IS NULL OR breaker_failures >= 1),
    ADD CONSTRAINT task_runs_breaker_window_s_check
        CHECK (breaker_window_s IS NULL OR breaker_window_s > 0),
    ADD CONSTRAINT task_runs_concurrency_limit_check
        CHECK (concurrency_limit IS NULL OR concurrency_limit >= 1),
    ADD CONSTRAINT task_runs_event_timeout_s_check CHECK (event_timeout_s > 0),
    ADD CONSTRAINT task_runs_event_wait_check
        CHECK ((event_name IS NULL) = (event_key IS NULL)
               AND (event_name IS NULL) = (event_timeout_s IS NULL)),
    ADD CONSTRAINT task_runs_item_check CHECK ((map_id IS NULL) = (item_index IS NULL)),
    ADD CONSTRAINT task_runs_item_index_check CHECK (item_index >= 0),
    ADD CONSTRAINT task_runs_max_attempts_check CHECK (max_attempts >= 1),
    ADD CONSTRAINT task_runs_max_parallel_check CHECK (max_parallel >= 1),
    ADD CONSTRAINT task_runs_on_dead_check CHECK (on_dead IN ('release', 'block')),
    ADD CONSTRAINT task_runs_priority_check CHECK (priority BETWEEN 0 AND 9),
    ADD CONSTRAINT task_runs_rate_limit_check CHECK (rate_limit IS NULL OR rate_limit >= 1),
    ADD CONSTRAINT task_runs_rate_per_s_check CHECK (rate_per_s IS NULL OR rate_per_s > 0),
    ADD CONSTRAINT task_runs_run_if_check
        CHECK (run_if IN ('all_succeeded', 'all_done', 'any_failed')),
    ADD CONSTRAINT task_runs_sleep_s_check CHECK (sleep_s > 0);
