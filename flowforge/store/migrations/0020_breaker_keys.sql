-- A circuit breaker per key, and retention for breaker transitions (issue 20, SPEC 7.4;
-- docs/flow-control.md "Circuit breakers and pauses", "A breaker per key").

-- A task's breaker key, rendered from `circuit_breaker.key` over the run input (a map's item:
-- over the run input, item and index) like its rate key. NULL: its breaker is its handler's.
ALTER TABLE task_runs ADD COLUMN breaker_key text;

-- A breaker is (handler, key). key '' is the handler-wide breaker — the one every breaker
-- was before this migration, so its existing rows keep their meaning as they are. '' rather
-- than a nullable key: the primary key stays a primary key (ON CONFLICT (handler, key) needs
-- no NULLS NOT DISTINCT index), and every match is a plain equality the index serves. A
-- rendered key is never '' (plan.py refuses it), so a keyed task cannot land on the
-- handler's breaker.
ALTER TABLE breakers ADD COLUMN key text NOT NULL DEFAULT '';
ALTER TABLE breakers DROP CONSTRAINT breakers_pkey;
ALTER TABLE breakers ADD PRIMARY KEY (handler, key);

ALTER TABLE breaker_transitions ADD COLUMN key text NOT NULL DEFAULT '';
DROP INDEX breaker_transitions_handler_idx;
CREATE INDEX breaker_transitions_handler_idx ON breaker_transitions (handler, key, to_state);
-- Retention takes logged transitions oldest first (an unlogged one is never deleted).
CREATE INDEX breaker_transitions_logged_at_idx ON breaker_transitions (at) WHERE logged;
-- How many transitions of each breaker, by the state entered, retention has deleted:
-- /metrics' transition counter and `breakers list` add these to the rows still kept, so a
-- count never goes down when old rows go. A table of its own rather than columns of
-- `breakers`: the retention pass then never waits on (or holds) a breaker row's lock, which
-- a failing finish takes.
CREATE TABLE breaker_transitions_purged (
    handler  text   NOT NULL,
    key      text   NOT NULL,
    to_state text   NOT NULL,
    n        bigint NOT NULL,
    PRIMARY KEY (handler, key, to_state)
);

-- An operator's action on a keyed breaker names the key (NULL: the handler's breaker, or a
-- pause); retention deletes gate_audit rows by age like the audit that goes with a run.
ALTER TABLE gate_audit ADD COLUMN key text;
CREATE INDEX gate_audit_requested_idx ON gate_audit (requested_at);

-- A breaker's probe is the oldest task parked under it: per (handler, key) now.
CREATE INDEX task_runs_parked_key_idx ON task_runs (handler, (coalesce(breaker_key, '')), seq)
    WHERE parked_on IS NOT NULL AND state = 'RETRYING';
DROP INDEX task_runs_parked_idx;

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
       g.new_state,
       jsonb_strip_nulls(jsonb_build_object('scope', g.scope, 'name', g.name, 'key', g.key)),
       g.requested_at
  FROM gate_audit g;

-- The claim's gate, now given the task's breaker key (migration 0018 says why these are
-- PL/pgSQL functions). flowforge_gates_closed() is unchanged: the claim of a task nothing
-- holds still costs one InitPlan.
DROP FUNCTION flowforge_gate(text, text, uuid);

-- Why a task of handler h on queue q with breaker key k (NULL: none; task run id) may not be
-- claimed now, NULL when it may: 'paused' (its queue or its handler is paused), 'circuit_open'
-- (its breaker — (h, k), or (h, '') without a key — is open, or half-open with another task
-- as its probe). A keyed task is held by its own key's breaker only.
CREATE FUNCTION flowforge_gate(h text, q text, k text, id uuid) RETURNS text
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM pauses p
                WHERE (p.scope = 'handler' AND p.name = h) OR (p.scope = 'queue' AND p.name = q))
    THEN
        RETURN 'paused';
    END IF;
    IF EXISTS (SELECT 1 FROM breakers b
                WHERE b.handler = h AND b.key = coalesce(k, '') AND b.state <> 'closed'
                  AND b.probe_task_id IS DISTINCT FROM id)
    THEN
        RETURN 'circuit_open';
    END IF;
    RETURN NULL;
END
$$;
