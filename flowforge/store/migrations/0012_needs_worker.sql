-- Which tasks a worker executes, as one column every query reads (docs/architecture.md, "Task
-- kinds"). A durable timer (sleep_s), a map (for_each: its items are the rows a worker runs)
-- and an event wait (event_name) are moved by scheduler passes and never become READY; every
-- other task is READY once nothing holds it. Generated from the columns that make a task one of
-- those kinds, so it cannot disagree with them — whichever version of FlowForge inserted the row.
-- (Adding a stored generated column rewrites task_runs once.)
ALTER TABLE task_runs
    ADD COLUMN needs_worker boolean NOT NULL
        GENERATED ALWAYS AS (sleep_s IS NULL AND for_each IS NULL AND event_name IS NULL) STORED;
