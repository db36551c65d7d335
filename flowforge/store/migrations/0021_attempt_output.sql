-- Output, logs and progress (issue 21, SPEC 7.5; docs/operations.md "Output, logs and progress").

-- What one attempt wrote: its ctx.log records and its stdout/stderr lines, the TAIL of at most
-- worker.log_capture_bytes (UTF-8) of them; output_dropped counts the bytes dropped from the
-- front to keep it there, so a reader can say how much is missing. NULL: nothing was written
-- (a silent handler's attempt never writes these columns). A running attempt's output is
-- written while it runs (at most every worker.output_flush_ms), its final tail by the finish.
ALTER TABLE task_attempts ADD COLUMN output text;
ALTER TABLE task_attempts ADD COLUMN output_dropped bigint NOT NULL DEFAULT 0
    CHECK (output_dropped >= 0);

-- The latest ctx.progress(fraction, message) of a task run, with the attempt that reported it:
-- readers show it only while it is the task's current attempt's (a retry starts with none),
-- so the claim, the hottest statement, does not have to clear it.
ALTER TABLE task_runs ADD COLUMN progress double precision
    CHECK (progress >= 0 AND progress <= 1);
ALTER TABLE task_runs ADD COLUMN progress_message text;
ALTER TABLE task_runs ADD COLUMN progress_attempt integer;
ALTER TABLE task_runs ADD COLUMN progress_at timestamptz;
