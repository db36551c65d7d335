-- Circuit breakers and pauses (issue 20, SPEC 7.4; docs/flow-control.md "Circuit breakers and
-- pauses").

-- A task's breaker thresholds, copied from its workflow like its retry policy (NULL: it
-- declares none; its failures then count against no breaker, though its handler's breaker,
-- opened by other tasks or an operator, still holds it back).
ALTER TABLE task_runs ADD COLUMN breaker_failures integer
    CHECK (breaker_failures IS NULL OR breaker_failures >= 1);
ALTER TABLE task_runs ADD COLUMN breaker_window_s double precision
    CHECK (breaker_window_s IS NULL OR breaker_window_s > 0);
ALTER TABLE task_runs ADD COLUMN breaker_cooldown_s double precision
    CHECK (breaker_cooldown_s IS NULL OR breaker_cooldown_s > 0);

-- A task the claim found gated (its handler's breaker open, its queue or handler paused) is
-- parked: READY → RETRYING with no retry time and no attempt used, its token bumped, and why in
-- parked_on. The scheduler unparks it (a retry time of now: promote_ready or the admission pass
-- takes it) once nothing holds it.
ALTER TABLE task_runs ADD COLUMN parked_on text
    CHECK (parked_on IS NULL OR parked_on IN ('circuit_open', 'paused'));
-- (A task that leaves RETRYING otherwise — cancelled, buried — keeps its parked_on, which only
-- RETRYING rows are read by; the claim clears it.)
CREATE INDEX task_runs_parked_idx ON task_runs (handler, seq)
    WHERE parked_on IS NOT NULL AND state = 'RETRYING';

-- One row per handler whose tasks have failed under a breaker (or that an operator opened).
-- failures: the times of its recent counted failures (at most failure_limit, newest last).
-- failure_limit, window_s, cooldown_s: the thresholds of the last counted failure.
-- held: opened by an operator, so no probe runs until an operator closes it.
-- probe_task_id, probe_attempt: half-open, the task probing and the attempt it had when chosen.
-- previous_state: the state before the last write, so a statement can tell a transition
-- (RETURNING sees only the new row).
CREATE TABLE breakers (
    handler        text        PRIMARY KEY,
    state          text        NOT NULL DEFAULT 'closed'
                               CHECK (state IN ('closed', 'open', 'half_open')),
    previous_state text        NOT NULL DEFAULT 'closed'
                               CHECK (previous_state IN ('closed', 'open', 'half_open')),
    failures       timestamptz[] NOT NULL DEFAULT '{}',
    failure_limit  integer,
    window_s       double precision,
    cooldown_s     double precision,
    held           boolean     NOT NULL DEFAULT false,
    opened_at      timestamptz,
    probe_task_id  uuid,
    probe_attempt  integer,
    updated_at     timestamptz NOT NULL DEFAULT now()
);

-- Every transition, written by the statement that makes it: the database row is the source of
-- truth, and the scheduler that marks it logged writes its one log line (across trees).
CREATE TABLE breaker_transitions (
    id          bigserial   PRIMARY KEY,
    handler     text        NOT NULL,
    from_state  text        NOT NULL,
    to_state    text        NOT NULL,
    cause       text        NOT NULL CHECK (cause IN ('failures', 'cooldown', 'probe_succeeded',
                                                      'probe_failed', 'probe_lost', 'operator')),
    at          timestamptz NOT NULL DEFAULT now(),
    logged      boolean     NOT NULL DEFAULT false,
    -- open → half-open: the task run chosen to probe and the attempt it had then (its probe
    -- call is attempt + 1), so a probe's call can be told from any other
    probe_task_id uuid,
    probe_attempt integer
);
CREATE INDEX breaker_transitions_unlogged_idx ON breaker_transitions (id) WHERE NOT logged;
CREATE INDEX breaker_transitions_handler_idx ON breaker_transitions (handler, to_state);

-- A paused queue or handler: its tasks are not claimed (parked as paused) until resumed.
CREATE TABLE pauses (
    scope     text        NOT NULL CHECK (scope IN ('queue', 'handler')),
    name      text        NOT NULL,
    paused_by text        NOT NULL,
    reason    text,
    paused_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, name)
);

-- Operator actions on a queue or a handler rather than one task (pause, resume, a breaker
-- opened or closed by hand): task_audit's shape without the task.
CREATE TABLE gate_audit (
    id             bigserial   PRIMARY KEY,
    action         text        NOT NULL
                               CHECK (action IN ('pause', 'resume', 'breaker_open', 'breaker_close')),
    scope          text        NOT NULL CHECK (scope IN ('queue', 'handler')),
    name           text        NOT NULL,
    requested_by   text        NOT NULL,
    reason         text,
    previous_state text        NOT NULL,
    new_state      text        NOT NULL,
    requested_at   timestamptz NOT NULL DEFAULT now()
);

-- operator_actions (0015) reads these too, in its shape: the queue or handler is in details.
CREATE OR REPLACE VIEW operator_actions AS
SELECT 'task_audit' AS source, a.id, a.action, a.run_id, a.task_run_id, a.requested_by,
       a.reason, a.previous_state, a.new_state, a.details, a.requested_at
  FROM task_audit a
UNION ALL
SELECT 'requeue_audit', q.id, 'requeue', t.run_id, q.task_run_id, q.requested_by, q.reason,
       'DEAD', 'PENDING',
       jsonb_build_object('previous_reason', q.previous_reason, 'attempt', q.attempt),
       q.requested_at
  FROM requeue_audit q JOIN task_runs t ON t.id = q.task_run_id
UNION ALL
SELECT 'rerun_audit', r.id, 'rerun', r.run_id, NULL, r.requested_by, r.reason,
       r.previous_state, NULL,
       jsonb_build_object('from_task', r.from_task, 'task_run_ids', r.task_run_ids,
                          'task_names', r.task_names),
       r.requested_at
  FROM rerun_audit r
UNION ALL
SELECT 'gate_audit', g.id, g.action, NULL, NULL, g.requested_by, g.reason, g.previous_state,
       g.new_state, jsonb_build_object('scope', g.scope, 'name', g.name), g.requested_at
  FROM gate_audit g;

-- A breaker's recent failures: the times of f within window_s of now, at most keep of them
-- (the newest), oldest first. Keeping `failures` of them is enough to tell whether `failures`
-- fell within the window, and bounds the row however fast a handler fails.
CREATE FUNCTION breaker_recent(f timestamptz[], window_s double precision, keep integer)
RETURNS timestamptz[] LANGUAGE sql STABLE AS $$
    SELECT coalesce(array_agg(x ORDER BY x), '{}')
      FROM (SELECT x FROM unnest(f) AS x
             WHERE x > now() - make_interval(secs => window_s)
             ORDER BY x DESC LIMIT keep) AS s
$$;

-- The claim's gate. Functions rather than SQL inlined into `claim`: no statement is prepared
-- (store/db.py), so the claim is planned on every call, and the inlined subqueries cost it
-- about 0.4 ms more planning (measured: docs/performance.md, "Circuit breakers and pauses");
-- a PL/pgSQL call is planned as a call (its own statements' plans are cached per session).
-- STABLE: they read the calling statement's snapshot.

-- Whether anything at all is held back: any pause, any breaker not closed. The claim calls it
-- once per statement (an InitPlan); when it is false, no task's gate is looked up.
CREATE FUNCTION flowforge_gates_closed() RETURNS boolean LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM pauses)
        OR EXISTS (SELECT 1 FROM breakers WHERE state <> 'closed');
END
$$;

-- Why a task of handler h on queue q (task run id) may not be claimed now, NULL when it may:
-- 'paused' (its queue or its handler is paused), 'circuit_open' (its handler's breaker is
-- open, or half-open with another task as its probe).
CREATE FUNCTION flowforge_gate(h text, q text, id uuid) RETURNS text LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM pauses p
                WHERE (p.scope = 'handler' AND p.name = h) OR (p.scope = 'queue' AND p.name = q))
    THEN
        RETURN 'paused';
    END IF;
    IF EXISTS (SELECT 1 FROM breakers b
                WHERE b.handler = h AND b.state <> 'closed' AND b.probe_task_id IS DISTINCT FROM id)
    THEN
        RETURN 'circuit_open';
    END IF;
    RETURN NULL;
END
$$;
