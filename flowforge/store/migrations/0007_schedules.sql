-- Schedules (issue 18, SPEC 7.2): workflows that start runs by themselves, on a timetable.
-- Every fire time is computed from the database clock (now()), never a process's.

-- One row per schedule (its name is `workflow/index` or the `name:` given in the file). A
-- scheduler syncs the rows of the workflows it loads at start-up: a changed spec moves
-- next_fire_at, a schedule gone from the files is retired (kept, never fired).
CREATE TABLE schedules (
    name         text        PRIMARY KEY,
    workflow     text        NOT NULL,
    -- the timetable and policies (flowforge/domain/schedule.py, ScheduleDef.to_spec)
    spec         jsonb       NOT NULL,
    paused       boolean     NOT NULL DEFAULT false,
    paused_at    timestamptz,
    retired_at   timestamptz,
    -- the first fire time not yet decided (NULL: the timetable has run dry)
    next_fire_at timestamptz,
    -- the last timetable fire time decided, and the last run any fire created
    last_fire_at timestamptz,
    last_run_id  uuid,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);
-- A pass reads only the due ones: an empty range scan when none is (docs/performance.md).
CREATE INDEX schedules_due_idx ON schedules (next_fire_at) WHERE NOT paused AND retired_at IS NULL;

-- Every decision about a fire time, in the transaction that makes its run: a run created, or
-- a fire time skipped and why. A skipped span covers fire_time .. last_fire_time. The unique
-- key is what makes one run per (schedule, fire time) however many schedulers race; a manual
-- fire (`flowforge schedules trigger`) has its own key space and never takes a timetable's.
CREATE TABLE schedule_fires (
    id             bigserial   PRIMARY KEY,
    schedule       text        NOT NULL REFERENCES schedules (name) ON DELETE CASCADE,
    fire_time      timestamptz NOT NULL,
    last_fire_time timestamptz,
    manual         boolean     NOT NULL DEFAULT false,
    outcome        text        NOT NULL CHECK (outcome IN ('created', 'skipped')),
    reason         text        CHECK (reason IN ('catch_up', 'max_catch_up', 'overlap', 'paused',
                                                 'invalid_input')),
    -- no foreign key: retention deletes runs, the decision stays
    run_id         uuid,
    decided_at     timestamptz NOT NULL DEFAULT now(),
    CHECK ((outcome = 'created') = (reason IS NULL)),
    CHECK ((outcome = 'created') = (run_id IS NOT NULL))
);
CREATE UNIQUE INDEX schedule_fires_timetable_key ON schedule_fires (schedule, fire_time)
    WHERE NOT manual;
CREATE UNIQUE INDEX schedule_fires_manual_key ON schedule_fires (schedule, fire_time)
    WHERE manual;
CREATE INDEX schedule_fires_recent_idx ON schedule_fires (schedule, id DESC);
CREATE INDEX schedule_fires_decided_idx ON schedule_fires (decided_at);

-- A run a schedule made names it and its fire time (NULL for a run triggered by hand).
ALTER TABLE workflow_runs ADD COLUMN schedule text, ADD COLUMN fire_time timestamptz;
