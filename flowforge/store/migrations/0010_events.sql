-- Events: tasks that wait for an event (wait_for_event, issue 19, SPEC 7.3; docs/dynamic.md).
-- A waiting task is RUNNING with no lease and no outbox row (like a sleeping timer); its
-- wake_at is its timeout, on the database clock. An event is kept (events.retention) so that
-- a wait that starts after it still receives it.

-- event_name / event_key (rendered from the run input) / event_timeout_s: a wait_for_event
-- task (no handler). Both name and key are set for a wait, or neither.
ALTER TABLE task_runs
    ADD COLUMN event_name      text,
    ADD COLUMN event_key       text,
    ADD COLUMN event_timeout_s double precision CHECK (event_timeout_s > 0),
    ADD CONSTRAINT task_runs_event_wait_check
        CHECK ((event_name IS NULL) = (event_key IS NULL)
               AND (event_name IS NULL) = (event_timeout_s IS NULL));

CREATE TABLE events (
    id         bigserial   PRIMARY KEY,
    name       text        NOT NULL CHECK (name <> ''),
    key        text        NOT NULL,
    data       jsonb,
    created_at timestamptz NOT NULL DEFAULT now()
);
-- a wait's start looks for the oldest stored event of its name and key within retention
CREATE INDEX events_match_idx ON events (name, key, created_at);
CREATE INDEX events_age_idx ON events (created_at);

-- One row per task an event woke: the primary key makes "woken once" a fact of the database,
-- whatever number of events or senders race for the same wait.
CREATE TABLE event_deliveries (
    task_run_id  uuid        PRIMARY KEY REFERENCES task_runs (id) ON DELETE CASCADE,
    event_id     bigint      NOT NULL REFERENCES events (id) ON DELETE CASCADE,
    delivered_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (event_id, task_run_id)
);

-- The waits an event wakes, and the waits whose dependencies are met (start_event_waits).
CREATE INDEX task_runs_event_wait_idx ON task_runs (event_name, event_key)
    WHERE state = 'RUNNING' AND event_name IS NOT NULL;
CREATE INDEX task_runs_event_start_idx ON task_runs (seq)
    WHERE state = 'PENDING' AND pending_deps = 0 AND event_name IS NOT NULL;
