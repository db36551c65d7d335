-- Every query FlowForge runs, by name. Loaded once by flowforge.store.queries.
-- State changes are conditional statements: they name the state (and fencing token) they
-- start from, so a writer that lost a race matches zero rows instead of overwriting.
-- Lease and retry arithmetic uses now(): the database clock is the only clock.
-- A `-- use: fragment(cte)` line inside a query stands for that fragment with its parameter
-- replaced by the CTE's name (flowforge.store.queries expands it once, at load).

-- ------------------------------------------------------------------ fragments

-- fragment: release_dependents(source)
-- The CTEs counted_off, released and queued: every dependent of a task in {source} (columns id,
-- state) that SUCCEEDED counts one dependency off. A dependent whose last dependency that was,
-- with no ordering key to wait on, that becomes READY by itself (ready_by_itself, migration
-- 0017: a worker executes it and no concurrency or rate key gates it) becomes READY with its
-- outbox row in the same statement; any other (a timer, a map, an event wait, a child-workflow
-- task, a task the admission pass admits) stays PENDING for its scheduler pass. Every
-- transition that makes a task SUCCEEDED uses this: a worker's finish, a timer waking, a map
-- settling, an event delivered or found at the start of its wait, a child run's success handed
-- to its task.
counted_off AS (
    -- one row: the dependents' ids, and how many dependencies each counts off by its id. No
    -- join of task_runs to a row source: a generic plan guesses such a source's size (from
    -- statistics a fresh or truncated task_edges does not have yet, or a fixed 10), and the
    -- guess chose a scan of task_runs hashed against dozens of dependents (every task read
    -- at each finish) or a nested loop rescanning the dependents for each one (a 5,000-wide
    -- fan-out's start squared); docs/performance.md, "Where the halved fan-out's time goes"
    SELECT array_agg(c.id) AS ids, jsonb_object_agg(c.id::text, c.n) AS n_by_id
      FROM (SELECT e.downstream_id AS id, count(*) AS n
              FROM task_edges e
              JOIN {source} s ON s.id = e.upstream_id
             WHERE s.state = 'SUCCEEDED'
             GROUP BY e.downstream_id) AS c
), released AS (
    UPDATE task_runs t
       -- n_by_id, an InitPlan's jsonb object: each dependent's count by its id
       SET pending_deps = t.pending_deps - ((SELECT n_by_id FROM counted_off) ->> t.id::text)::int,
           state = CASE WHEN t.pending_deps = ((SELECT n_by_id FROM counted_off)
                                               ->> t.id::text)::int
                             AND t.ordering_key IS NULL AND t.ready_by_itself
                        THEN 'READY' ELSE t.state END,
           ready_at = CASE WHEN t.pending_deps = ((SELECT n_by_id FROM counted_off)
                                                  ->> t.id::text)::int
                                AND t.ordering_key IS NULL AND t.ready_by_itself
                           THEN now() ELSE t.ready_at END,
           updated_at = now()
     -- by primary key (see claim), the ids an InitPlan's array: no row source to join
     WHERE t.id = ANY((SELECT ids FROM counted_off)::uuid[])
       AND (t.state = 'PENDING') IS TRUE
    RETURNING t.id, t.state, t.fencing_token, t.queue, t.priority,
              t.idempotency_key IS NULL AS keyless,
              -- left PENDING with nothing to wait for but a scheduler pass (admission, a timer,
              -- a map, an event, a child run; a run_if task's last count is its gate, so 1)
              t.state = 'PENDING' AND t.pending_deps <= (t.run_if <> 'all_succeeded')::int
                  AS for_pass
), queued AS (
    INSERT INTO outbox (task_run_id, fencing_token, queue, priority)
    SELECT id, fencing_token, queue, priority FROM released WHERE state = 'READY'
    ON CONFLICT (task_run_id, fencing_token) DO NOTHING
    RETURNING id
)

-- fragment: dispatch(source)
-- The CTEs promoted and queued: the tasks in {source} (a column id) that are still PENDING or
-- RETRYING become READY with their outbox row (on their queue) in the same statement. The
-- outbox is unique per (task run, token): a repeated pass never duplicates a dispatch. Used by
-- promote_ready and admit_gated, whose CTEs choose the tasks.
promoted AS (
    -- the tasks by primary key, their ids an InitPlan's array, and no row source joined: a
    -- generic plan made while statistics said PENDING was rare read them through the state
    -- index and rescanned {source} for each (a map's 10,000 items: 4 million rows a pass);
    -- docs/performance.md, "The map's first repetition"
    UPDATE task_runs t
       SET state = 'READY', retry_at = NULL, ready_at = now(), updated_at = now()
     WHERE t.id = ANY(ARRAY(SELECT id FROM {source}))
       AND (t.state IN ('PENDING', 'RETRYING')) IS TRUE
    RETURNING t.id, t.fencing_token, t.queue, t.priority
), queued AS (
    INSERT INTO outbox (task_run_id, fencing_token, queue, priority)
    SELECT id, fencing_token, queue, priority FROM promoted
    ON CONFLICT (task_run_id, fencing_token) DO NOTHING
    RETURNING id
)

-- fragment: stream_free(task)
-- Whether {task}'s ordering stream lets it run: it has no ordering key, or every task ahead of
-- it in the stream is done with it (SUCCEEDED, CANCELLED, or DEAD with on_dead: release).
({task}.ordering_key IS NULL OR NOT EXISTS (
    SELECT 1 FROM task_runs e
     WHERE e.ordering_key = {task}.ordering_key AND e.seq < {task}.seq
       AND e.state NOT IN ('SUCCEEDED', 'CANCELLED')
       AND NOT (e.state = 'DEAD' AND e.on_dead = 'release')))

-- ------------------------------------------------------------------ definitions and triggers

-- name: lock_ordering_keys
-- Serialises triggers that share an ordering key, so creation order (seq) is commit order.
SELECT pg_advisory_xact_lock(%(namespace)s::int4, hashtext(k))
  FROM unnest(%(keys)s::text[]) AS k
 ORDER BY k;

-- fragment: new_runs(w)
-- A run whose idempotency key exists already is skipped (the caller compares digests).
-- A delayed run (start_at given, or delay_s added to now()) is created SCHEDULED; its deadline
-- (deadline_s, NULL for none) counts from its start, else from now(): the database's clock.
-- A child run (sub-workflows) carries its parent task and attempt, and its nesting depth.
-- priority: the one the runs were triggered with (NULL: none; a child run inherits it).
-- The inputs come as one jsonb array (rows.jsonb_array), read back by position: as a jsonb[]
-- psycopg escaped every byte of every input for the array literal (100 KB inputs: most of a
-- trigger's time; docs/performance.md "Soak and payloads"). ORDER BY n: written in the
-- caller's order, as the arrays of unnest were.
INSERT INTO workflow_runs AS {w} (id, workflow, workflow_digest, input, fail_fast, idempotency_key,
                           request_digest, state, start_at, deadline_at, parent_run_id,
                           parent_task_id, parent_attempt, depth, priority)
SELECT r.id, %(workflow)s, %(digest)s, i.input, %(fail_fast)s, r.key, r.request_digest,
       CASE WHEN s.start_at IS NULL THEN 'PENDING' ELSE 'SCHEDULED' END, s.start_at,
       coalesce(s.start_at, now()) + make_interval(secs => %(deadline_s)s::float8),
       %(parent_run_id)s::uuid, %(parent_task_id)s::uuid, %(parent_attempt)s::int,
       %(depth)s::int, %(priority)s::smallint
  FROM unnest(%(ids)s::uuid[], %(keys)s::text[], %(digests)s::text[]) WITH ORDINALITY
       AS r(id, key, request_digest, n)
  JOIN jsonb_array_elements(%(inputs)s::jsonb) WITH ORDINALITY AS i(input, n) USING (n)
 CROSS JOIN (SELECT coalesce(%(start_at)s::timestamptz,
                             now() + make_interval(secs => %(delay_s)s::float8)) AS start_at) AS s
 ORDER BY n
ON CONFLICT (idempotency_key) DO NOTHING

-- name: insert_runs
-- The new runs (new_runs); the ids of those inserted (a run whose key exists is not).
-- use: new_runs(w)
RETURNING id;

-- name: plan_table_pages
-- The pages of each table named (store/plansize.py TABLES), in their order: 0 for one not
-- there. The file's size, not the statistics: what the planner itself reads at each planning.
SELECT coalesce(pg_relation_size(to_regclass(t)), 0) / 8192 AS pages
FROM unnest(%(tables)s::text[]) WITH ORDINALITY AS x(t, n)
ORDER BY n;

-- name: insert_runs_answered
-- The same insert, answering each run inserted as get_run reads it (a trigger that answers with
-- its run builds the answer from what it wrote: docs/performance.md, "Submitting work, part 3").
-- use: new_runs(w)
RETURNING
-- use: run_columns(w)
;

-- name: trigger_clock
-- The trigger transaction's now(): an explicit start time is judged against it, never
-- against the caller's clock.
SELECT now() AS now;

-- name: find_runs_by_keys
SELECT id, idempotency_key, request_digest
  FROM workflow_runs
 WHERE idempotency_key = ANY(%(keys)s::text[]);

-- fragment: new_tasks(t)
-- The INSERT of a trigger's new tasks, read from the jsonb array aliased {t}.
-- A task with nothing to wait for (no dependency, no closed start gate: both count in
-- pending_deps; no ordering key) that becomes READY by itself — or that the trigger admitted
-- through its concurrency and rate keys (limits.admit_new, under the keys' locks) — is created
-- READY with its outbox row in the same statement: the first step of a run needs no scheduler
-- pass. (k.ready repeats the expression of task_runs.ready_by_itself, migration 0017: the row
-- does not exist yet here; tests/unit/test_queries.py keeps the two the same.)
-- The tasks come as one jsonb array of objects (rows.task_records), not one array per column:
-- psycopg dumped a one-task trigger's 35 arrays in about 0.5 ms of Python, the JSON in 0.03
-- (docs/performance.md, "Submitting work").
INSERT INTO task_runs (id, run_id, name, handler, pending_deps, max_attempts, base_delay_s,
                       max_delay_s, jitter, timeout_s, idempotency_key, ordering_key,
                       on_dead, start_gate, sleep_s, run_if, state, ready_at, for_each,
                       max_parallel, event_name, event_key, event_timeout_s, child_workflow,
                       queue, concurrency_key, concurrency_limit, rate_key, rate_limit,
                       rate_per_s, priority, breaker_failures,
                       breaker_window_s, breaker_cooldown_s, breaker_key)
SELECT {t}.id, {t}.run_id, {t}.name, {t}.handler, {t}.pending_deps, {t}.max_attempts,
       {t}.base_delay_s, {t}.max_delay_s, {t}.jitter, {t}.timeout_s, {t}.idempotency_key,
       {t}.ordering_key, {t}.on_dead, {t}.start_gate, {t}.sleep_s, {t}.run_if,
       CASE WHEN k.ready THEN 'READY' ELSE 'PENDING' END,
       CASE WHEN k.ready THEN now() END,
       {t}.for_each, {t}.max_parallel, {t}.event_name, {t}.event_key, {t}.event_timeout_s,
       {t}.child_workflow, {t}.queue, {t}.concurrency_key, {t}.concurrency_limit,
       {t}.rate_key, {t}.rate_limit, {t}.rate_per_s, {t}.priority, {t}.breaker_failures,
       {t}.breaker_window_s, {t}.breaker_cooldown_s, {t}.breaker_key
  FROM jsonb_to_recordset(%(tasks)s::jsonb)
       AS {t}(run_id uuid, id uuid, name text, handler text, pending_deps int, max_attempts int,
            base_delay_s float8, max_delay_s float8, jitter text, timeout_s float8,
            idempotency_key text, ordering_key text, on_dead text, start_gate bool,
            sleep_s float8, run_if text, for_each text, max_parallel int, event_name text,
            event_key text, event_timeout_s float8, child_workflow text, queue text,
            concurrency_key text, concurrency_limit int, rate_key text, rate_limit int,
            rate_per_s float8, admitted bool, priority smallint, breaker_failures int,
            breaker_window_s float8, breaker_cooldown_s float8, breaker_key text)
 CROSS JOIN LATERAL (
       SELECT {t}.pending_deps = 0 AND {t}.ordering_key IS NULL
              AND ({t}.admitted OR ({t}.sleep_s IS NULL AND {t}.for_each IS NULL
                                    AND {t}.event_name IS NULL AND {t}.child_workflow IS NULL
                                    AND {t}.concurrency_key IS NULL AND {t}.rate_key IS NULL))
       ) AS k(ready)

-- fragment: outbox_of_new(tasks)
-- The outbox rows of the new tasks {tasks} (new_tasks' rows) created READY.
INSERT INTO outbox (task_run_id, fencing_token, queue, priority)
SELECT id, fencing_token, queue, priority FROM {tasks} WHERE state = 'READY'

-- name: insert_tasks
-- The new tasks (new_tasks) and the outbox rows of those created READY.
WITH inserted AS (
-- use: new_tasks(t)
    RETURNING id, state, fencing_token, queue, priority
), queued AS (
-- use: outbox_of_new(inserted)
    RETURNING id
)
SELECT (SELECT count(*) FROM inserted) - (SELECT count(*) FROM queued) AS waiting,
       (SELECT count(*) FROM queued) AS queued;

-- name: insert_tasks_answered
-- The same insert, answering each new task as get_run_tasks reads it, in the run's order, but
-- its depends_on (insert_edges_answered answers it): a new task has no items yet (a map's
-- item_counts are empty) and waits on nothing but a closed start gate — waiting_on(i) of a
-- task without a concurrency or rate key, the only kind a trigger answers from its write (one
-- with a key waits on other tasks: the trigger reads it back).
WITH inserted AS (
-- use: new_tasks(t)
    RETURNING *
), queued AS (
-- use: outbox_of_new(inserted)
)
SELECT
-- use: task_columns(i)
       CASE WHEN i.for_each IS NOT NULL THEN '{}'::jsonb END AS item_counts,
       CASE WHEN i.state = 'PENDING' AND i.start_gate THEN 'start_at' END AS waiting_on
  FROM inserted i
 ORDER BY i.seq;

-- fragment: new_edges(edges)
-- The INSERT of a trigger's edges; {edges} names no alias here (the fragment only shares the
-- statement between insert_edges and insert_edges_answered).
INSERT INTO task_edges (upstream_id, downstream_id, upstream_name)
SELECT * FROM unnest(%(upstream)s::uuid[], %(downstream)s::uuid[], %(names)s::text[])

-- name: insert_edges
-- use: new_edges(edges)
;

-- name: insert_edges_answered
-- The same insert, answering each downstream task's upstream names in get_run_tasks' order
-- (its depends_on: the database's collation sorts them, as there).
WITH edges AS (
-- use: new_edges(edges)
    RETURNING downstream_id, upstream_name
)
SELECT downstream_id AS id, array_agg(upstream_name ORDER BY upstream_name) AS depends_on
  FROM edges
 GROUP BY downstream_id;

-- name: notify_scheduler
SELECT pg_notify('flowforge_scheduler', '');

-- name: notify_outbox
SELECT pg_notify('flowforge_outbox', '');

-- name: notify_new_tasks
-- After a trigger committed (in the same round trip as its COMMIT): the publisher hears of the
-- READY tasks it created (each with its outbox row), the scheduler of the PENDING ones — each
-- only if there are any (%(ready)s, %(pending)s: the trigger knows from its plan which
-- tasks its insert creates READY, PlannedTask.created_ready). No table is read: reading the
-- new runs' tasks back by their ids was planned at every call (over task_runs' many
-- indexes: most of the statement's cost), and a generic plan of it, made before the
-- tables' first ANALYZE, scanned task_runs whole ("Submitting work, part 4").
SELECT pg_notify('flowforge_outbox', '') WHERE %(ready)s
UNION ALL
SELECT pg_notify('flowforge_scheduler', '') WHERE %(pending)s;

-- ------------------------------------------------------------------ scheduler: → READY

-- name: promote_ready
-- PENDING tasks whose dependencies succeeded and whose ordering stream is free, and RETRYING
-- tasks whose backoff is over, become READY with an outbox row in the same statement. The
-- outbox is unique per (task run, token), so a repeated pass never duplicates a dispatch.
-- (A task no worker executes is never READY: start_timers takes a durable timer, expand_map a
-- map, start_event_waits an event wait, start_children a child-workflow task — its due retry
-- too. A task with a concurrency or rate key is admit_gated's: ready_by_itself, migration 0017.)
WITH eligible AS (
    SELECT t.id
      FROM task_runs t
     WHERE t.state = 'PENDING' AND t.pending_deps = 0 AND t.ready_by_itself
       AND
-- use: stream_free(t)
     ORDER BY t.seq
     LIMIT %(limit)s
       FOR UPDATE OF t SKIP LOCKED
), due AS (
    SELECT t.id
      FROM task_runs t
     WHERE t.state = 'RETRYING' AND t.retry_at <= now() AND t.ready_by_itself
     ORDER BY t.retry_at
     LIMIT %(limit)s
       FOR UPDATE OF t SKIP LOCKED
), candidates AS (
    SELECT id FROM eligible UNION ALL SELECT id FROM due
),
-- use: dispatch(candidates)
SELECT (SELECT count(*) FROM promoted) AS promoted, (SELECT count(*) FROM queued) AS queued;

-- ------------------------------------------------------------------ scheduler: failures

-- name: lock_failed
SELECT id, fencing_token, attempt, budget_start, max_attempts, base_delay_s, max_delay_s,
       jitter, crash_streak, cancel_requested, failure_reason, bury_requested
  FROM task_runs
 WHERE state = 'FAILED'
 ORDER BY updated_at
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED;

-- name: apply_routing
-- FAILED → RETRYING (with a backoff on the database clock) / DEAD / CANCELLED.
UPDATE task_runs t
   SET state = d.state,
       failure_reason = d.reason,
       retry_at = CASE WHEN d.state = 'RETRYING' THEN now() + make_interval(secs => d.delay_s) END,
       finished_at = CASE WHEN d.state = 'RETRYING' THEN NULL ELSE now() END,
       propagated = (d.state = 'RETRYING'),
       cancel_cause = CASE WHEN d.state = 'CANCELLED' THEN coalesce(t.cancel_cause, 'operator') END,
       updated_at = now()
  FROM unnest(%(ids)s::uuid[], %(tokens)s::bigint[], %(states)s::text[], %(delays)s::float8[],
              %(reasons)s::text[]) AS d(id, token, state, delay_s, reason)
 WHERE t.id = d.id AND t.state = 'FAILED' AND t.fencing_token = d.token
RETURNING t.id, t.state, t.run_id, t.name, t.attempt,
          (SELECT r.workflow FROM workflow_runs r WHERE r.id = t.run_id) AS workflow;

-- name: lock_expired_leases
SELECT id, fencing_token, attempt, budget_start, max_attempts, base_delay_s, max_delay_s,
       jitter, crash_streak, cancel_requested, bury_requested
  FROM task_runs
 WHERE state = 'RUNNING' AND lease_expires_at < now()
 ORDER BY lease_expires_at
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED;

-- name: apply_reap
-- RUNNING with an expired lease → RETRYING / DEAD / CANCELLED; the token is bumped so the
-- presumed-dead worker can neither renew nor finish, its attempt is closed and its
-- idempotency key released.
WITH reaped AS (
    UPDATE task_runs t
       SET state = d.state,
           fencing_token = t.fencing_token + 1,
           lease_owner = NULL,
           lease_expires_at = NULL,
           crash_streak = t.crash_streak + 1,
           failure_reason = d.reason,
           last_error = 'lease expired: the worker died or stopped renewing its lease',
           retry_at = CASE WHEN d.state = 'RETRYING' THEN now() + make_interval(secs => d.delay_s) END,
           finished_at = CASE WHEN d.state = 'RETRYING' THEN NULL ELSE now() END,
           propagated = (d.state = 'RETRYING'),
           cancel_cause = CASE WHEN d.state = 'CANCELLED' THEN coalesce(t.cancel_cause, 'operator') END,
           updated_at = now()
      FROM unnest(%(ids)s::uuid[], %(tokens)s::bigint[], %(states)s::text[],
                  %(delays)s::float8[], %(reasons)s::text[]) AS d(id, token, state, delay_s, reason)
     WHERE t.id = d.id AND t.state = 'RUNNING' AND t.fencing_token = d.token
       AND t.lease_expires_at < now()
    RETURNING t.id, t.attempt, d.token AS old_token, t.state, t.run_id, t.name
), closed AS (
    UPDATE task_attempts a
       SET finished_at = now(), outcome = 'lease_expired', failure_reason = 'lease_expired',
           error = 'lease expired: the worker died or stopped renewing its lease'
      FROM reaped r
     WHERE a.task_run_id = r.id AND a.attempt = r.attempt
), released AS (
    DELETE FROM idempotency_keys k
     USING reaped r
     WHERE k.task_run_id = r.id AND k.fencing_token = r.old_token AND k.state = 'RUNNING'
)
SELECT id, state, run_id, name, attempt,
       (SELECT r.workflow FROM workflow_runs r WHERE r.id = reaped.run_id) AS workflow
  FROM reaped;

-- ------------------------------------------------------------------ scheduler: consequences

-- name: lock_unpropagated
-- Tasks that reached SUCCEEDED, DEAD or CANCELLED whose consequences are not applied yet.
SELECT t.id, t.run_id, t.state, r.fail_fast
  FROM task_runs t
  JOIN workflow_runs r ON r.id = t.run_id
 WHERE NOT t.propagated
 ORDER BY t.finished_at
 LIMIT %(limit)s
   FOR UPDATE OF t SKIP LOCKED;

-- name: cancel_dependents
-- A task that can never run because an upstream task died or was cancelled. A conditional
-- (run_if) task is not cancelled: release_conditions counts the finished upstream instead.
-- Downstream of run_if skips only, the cancellation is a skip too (cause condition_not_met).
UPDATE task_runs t
   SET state = 'CANCELLED', cancel_cause = x.cause, failure_reason = 'cancelled',
       fencing_token = t.fencing_token + 1, finished_at = now(), propagated = false,
       updated_at = now()
  FROM (SELECT e.downstream_id AS id,
               CASE WHEN bool_and(u.cancel_cause IS NOT DISTINCT FROM 'condition_not_met')
                    THEN 'condition_not_met' ELSE 'upstream' END AS cause
          FROM task_edges e
          JOIN task_runs u ON u.id = e.upstream_id
         WHERE e.upstream_id = ANY(%(ids)s::uuid[])
         GROUP BY e.downstream_id) AS x
 WHERE t.id = x.id AND t.state = 'PENDING' AND t.run_if = 'all_succeeded';

-- name: cancel_not_started
-- Cancels every task of the given runs that is not executing right now: not started, or a
-- sleeping durable timer (RUNNING with a wake time, no worker: nothing to ask), or a running
-- child-workflow task (stop_runs cancels the child runs returned next; those finished are left
-- alone, and a task that became RUNNING while this waited for its row is re-checked and
-- cancelled with its new child). Fail-fast
-- (cause upstream) spares a conditional (run_if) task not finished yet — waiting for its
-- condition or already let through — and everything downstream of one: a compensation waits
-- for the failure that set it off. An operator's cancel and a deadline spare nothing.
WITH RECURSIVE spared(id) AS (
    SELECT t.id FROM task_runs t
     WHERE %(cause)s = 'upstream' AND t.run_id = ANY(%(run_ids)s::uuid[])
       AND t.state IN ('PENDING', 'READY', 'RETRYING', 'FAILED') AND t.run_if <> 'all_succeeded'
    UNION
    SELECT e.downstream_id FROM task_edges e JOIN spared s ON e.upstream_id = s.id
)
UPDATE task_runs
   SET state = 'CANCELLED', cancel_cause = %(cause)s, failure_reason = 'cancelled',
       fencing_token = fencing_token + 1, retry_at = NULL, finished_at = now(),
       propagated = false, updated_at = now()
 WHERE run_id = ANY(%(run_ids)s::uuid[])
   AND (state IN ('PENDING', 'READY', 'RETRYING', 'FAILED')
        OR (state = 'RUNNING' AND wake_at IS NOT NULL)
        OR (state = 'RUNNING' AND child_workflow IS NOT NULL
            AND NOT (%(cause)s = 'upstream' AND run_if <> 'all_succeeded')))
   AND id NOT IN (SELECT id FROM spared)
RETURNING id, child_run_id;

-- name: request_stop
-- Running tasks learn this at once through notify_cancel, else on their next lease renewal.
-- Fail-fast (cause upstream) lets a running conditional (run_if) task finish: a compensation.
UPDATE task_runs
   SET cancel_requested = true, cancel_cause = %(cause)s, updated_at = now()
 WHERE run_id = ANY(%(run_ids)s::uuid[]) AND state = 'RUNNING' AND NOT cancel_requested
   AND NOT (%(cause)s = 'upstream' AND run_if <> 'all_succeeded')
RETURNING id, run_id;

-- name: runs_to_derive
-- Of runs whose tasks only succeeded since the last pass, those whose state can have changed:
-- not RUNNING yet, asked to cancel, or without an unfinished task left. For the others a
-- success changes nothing, and deriving would read every task of the run on every pass.
SELECT r.id
  FROM workflow_runs r
 WHERE r.id = ANY(%(ids)s::uuid[])
   AND (r.state <> 'RUNNING' OR r.cancel_requested_at IS NOT NULL
        OR NOT EXISTS (SELECT 1 FROM task_runs t
                        WHERE t.run_id = r.id
                          AND t.state IN ('PENDING', 'READY', 'RUNNING', 'FAILED', 'RETRYING')));

-- name: mark_propagated
UPDATE task_runs SET propagated = true WHERE id = ANY(%(ids)s::uuid[]);

-- name: lock_runs
-- Runs are locked in id order after their tasks (the order every writer uses).
SELECT id, state, cancel_requested_at IS NOT NULL AS cancel_requested,
       coalesce(failure_reason = 'deadline_exceeded', false) AS deadline_exceeded
  FROM workflow_runs
 WHERE id = ANY(%(ids)s::uuid[])
 ORDER BY id
   FOR UPDATE;

-- name: run_facts
SELECT run_id, state, count(*) AS n, bool_or(attempt > 0) AS attempted,
       bool_or(start_gate) AS gated,
       count(*) FILTER (WHERE cancel_cause = 'condition_not_met') AS skipped
  FROM task_runs
 WHERE run_id = ANY(%(ids)s::uuid[])
 GROUP BY run_id, state;

-- name: update_run_states
UPDATE workflow_runs r
   SET state = d.state,
       finished_at = CASE WHEN d.finished THEN coalesce(r.finished_at, now()) END,
       started_at = CASE WHEN d.state IN ('PENDING', 'SCHEDULED') THEN r.started_at
                         ELSE coalesce(r.started_at, now()) END,
       updated_at = now()
  FROM unnest(%(ids)s::uuid[], %(states)s::text[], %(finished)s::bool[]) AS d(id, state, finished)
 WHERE r.id = d.id AND (r.state <> d.state OR (r.finished_at IS NOT NULL) <> d.finished)
RETURNING r.id, r.state;

-- name: purge_runs
-- Finished runs older than the retention go with their tasks, attempts, edges, outbox rows and
-- requeue audit (ON DELETE CASCADE) — but only a run whose every task SUCCEEDED or was
-- CANCELLED. A run with a DEAD task is kept whatever its age: the task, its attempts and audit
-- wait for a requeue or for `flowforge purge --dead`, and a stream it holds (on_dead: block)
-- stays held. (A task still able to change keeps its run too, whatever the run's state says.)
WITH doomed AS (
    SELECT r.id FROM workflow_runs r
     WHERE r.finished_at < now() - make_interval(secs => %(age_s)s)
       AND NOT EXISTS (SELECT 1 FROM task_runs t
                        WHERE t.run_id = r.id AND t.state NOT IN ('SUCCEEDED', 'CANCELLED'))
     ORDER BY r.finished_at
     LIMIT %(limit)s
       FOR UPDATE OF r SKIP LOCKED
)
DELETE FROM workflow_runs r USING doomed WHERE r.id = doomed.id;

-- name: purge_outbox
WITH doomed AS (
    SELECT id FROM outbox
     WHERE published_at < now() - make_interval(secs => %(age_s)s)
     ORDER BY published_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
DELETE FROM outbox o USING doomed WHERE o.id = doomed.id;

-- name: purge_keys
-- SUCCEEDED task keys not used for scheduler.idempotency_retention_days (age_s here), on
-- their own clock: a key outlives the runs that used it. Once gone, the key can execute again.
-- (No foreign key ties a key to a task run: purging runs never takes a key with it.)
WITH doomed AS (
    SELECT key FROM idempotency_keys
     WHERE state = 'SUCCEEDED' AND updated_at < now() - make_interval(secs => %(age_s)s)
     ORDER BY updated_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
DELETE FROM idempotency_keys k USING doomed WHERE k.key = doomed.key;

-- name: purge_breaker_transitions
-- Breaker transitions older than the retention, in a bounded batch, oldest first — only rows
-- already logged (the scheduler marks a row logged when it takes it to log: an unlogged row is
-- never deleted, and one being logged right now is locked and skipped). What goes is added to
-- breaker_transitions_purged (in key order: two purges never deadlock), so the counts
-- `breakers list` and /metrics show never go down. The rows counted are the rows locked, so
-- the DELETE takes exactly them; its row count is the batch's, like the other purges'.
WITH doomed AS (
    SELECT id, handler, key, to_state FROM breaker_transitions
     WHERE logged AND at < now() - make_interval(secs => %(age_s)s)
     ORDER BY at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), counted AS (
    INSERT INTO breaker_transitions_purged AS p (handler, key, to_state, n)
    SELECT handler, key, to_state, count(*) FROM doomed
     GROUP BY handler, key, to_state
     ORDER BY handler, key, to_state
    ON CONFLICT (handler, key, to_state) DO UPDATE SET n = p.n + EXCLUDED.n
)
DELETE FROM breaker_transitions x USING doomed WHERE x.id = doomed.id;

-- name: purge_idle_breakers
-- Keyed breakers (key <> '': never a handler's own) that are closed (so not held open by an
-- operator nor probing), with no failure within their window, unchanged for the retention time
-- and with no transition left in breaker_transitions (purge_breaker_transitions, run before in
-- the same transaction, takes those first), in a bounded batch, oldest change first: deleted,
-- their transitions' kept counts added to their handler's (breaker_transitions_folded, in
-- handler order: two purges never deadlock), so /metrics' counter never goes down. Such a row
-- reads as no row: the gate and trip_breakers take an absent breaker for a closed one without
-- failures. A row a finish or an operator is writing is locked and skipped; one written after
-- this statement locked it is inserted afresh once the delete commits (ON CONFLICT finds it gone).
WITH doomed AS (
    SELECT b.handler, b.key FROM breakers b
     WHERE b.key <> '' AND b.state = 'closed' AND NOT b.held
       AND b.updated_at < now() - make_interval(secs => %(age_s)s)
       AND NOT EXISTS (SELECT 1 FROM unnest(b.failures) AS f(at)
                        WHERE f.at > now() - make_interval(secs => coalesce(b.window_s, 0)))
       AND NOT EXISTS (SELECT 1 FROM breaker_transitions x
                        WHERE x.handler = b.handler AND x.key = b.key)
     ORDER BY b.updated_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), counts AS (
    DELETE FROM breaker_transitions_purged p USING doomed d
     WHERE p.handler = d.handler AND p.key = d.key
    RETURNING p.handler, p.to_state, p.n
), folded AS (
    INSERT INTO breaker_transitions_folded AS f (handler, to_state, n)
    SELECT handler, to_state, sum(n) FROM counts
     GROUP BY handler, to_state
     ORDER BY handler, to_state
    ON CONFLICT (handler, to_state) DO UPDATE SET n = f.n + EXCLUDED.n
)
DELETE FROM breakers b USING doomed d WHERE b.handler = d.handler AND b.key = d.key;

-- name: breaker_folded_transitions
-- /metrics: the transitions of keyed breakers retention deleted, per handler and state
-- entered (purge_idle_breakers): added to the handler's counter.
SELECT handler, to_state, n FROM breaker_transitions_folded ORDER BY handler, to_state;

-- name: purge_gate_audit
-- Operator actions on breakers and pauses older than the retention, in a bounded batch: the
-- audit of a run's tasks (task, requeue, rerun audit) goes with its run after the same time,
-- so operator_actions keeps one horizon for every kind of action.
WITH doomed AS (
    SELECT id FROM gate_audit
     WHERE requested_at < now() - make_interval(secs => %(age_s)s)
     ORDER BY requested_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
DELETE FROM gate_audit g USING doomed WHERE g.id = doomed.id;

-- name: release_conditions
-- Conditional (run_if) dependents of tasks that died or were cancelled count them as
-- finished (a success counted down in its finishing statement already): pending_deps 1 left
-- means only the condition gate, for evaluate_conditions. Propagate runs this once per
-- finished task (it marks them propagated in the same transaction).
UPDATE task_runs t
   SET pending_deps = t.pending_deps - x.n, updated_at = now()
  FROM (SELECT e.downstream_id AS id, count(*) AS n
          FROM task_edges e
         WHERE e.upstream_id = ANY(%(ids)s::uuid[])
         GROUP BY e.downstream_id) AS x
 WHERE t.id = x.id AND t.state = 'PENDING' AND t.run_if <> 'all_succeeded';

-- name: lock_conditions
-- Conditional tasks whose dependencies are all finished (only the gate left), with their
-- dependencies' states, for domain/conditions.py to decide.
SELECT t.id, t.run_id, t.run_if,
       array(SELECT u.state FROM task_edges e JOIN task_runs u ON u.id = e.upstream_id
              WHERE e.downstream_id = t.id) AS upstream
  FROM task_runs t
 WHERE t.state = 'PENDING' AND t.pending_deps = 1 AND t.run_if <> 'all_succeeded'
 ORDER BY t.seq
 LIMIT %(limit)s
   FOR UPDATE OF t SKIP LOCKED;

-- name: apply_conditions
-- One conditional statement for the batch: 'run' opens the gate (pending_deps 0; promote_ready
-- makes the task READY, stream permitting), 'skip' is PENDING → CANCELLED, cause
-- condition_not_met. A task whose gate something else moved since the lock matches nothing.
UPDATE task_runs t
   SET pending_deps = CASE WHEN v.verdict = 'run' THEN 0 ELSE t.pending_deps END,
       state = CASE WHEN v.verdict = 'skip' THEN 'CANCELLED' ELSE t.state END,
       cancel_cause = CASE WHEN v.verdict = 'skip' THEN 'condition_not_met'
                           ELSE t.cancel_cause END,
       failure_reason = CASE WHEN v.verdict = 'skip' THEN 'cancelled' ELSE t.failure_reason END,
       fencing_token = CASE WHEN v.verdict = 'skip' THEN t.fencing_token + 1
                            ELSE t.fencing_token END,
       finished_at = CASE WHEN v.verdict = 'skip' THEN now() ELSE t.finished_at END,
       propagated = CASE WHEN v.verdict = 'skip' THEN false ELSE t.propagated END,
       updated_at = now()
  FROM unnest(%(ids)s::uuid[], %(verdicts)s::text[]) AS v(id, verdict)
 WHERE t.id = v.id AND t.state = 'PENDING' AND t.pending_deps = 1
   AND t.run_if <> 'all_succeeded'
RETURNING t.id, t.run_id, v.verdict;

-- ------------------------------------------------------------------ scheduler: time

-- name: start_due_runs
-- SCHEDULED runs whose start time has come (on the database clock) leave SCHEDULED and open
-- their root tasks' start gate in one statement; promote_ready then makes those READY. SKIP
-- LOCKED and the state test divide the runs among any number of schedulers: each starts once.
WITH due AS (
    SELECT r.id
      FROM workflow_runs r
     WHERE r.state = 'SCHEDULED' AND r.start_at <= now()
     ORDER BY r.start_at
     LIMIT %(limit)s
       FOR UPDATE OF r SKIP LOCKED
), started AS (
    UPDATE workflow_runs r
       SET state = 'PENDING', updated_at = now()
     -- by id, no row source joined (see dispatch)
     WHERE r.id = ANY(ARRAY(SELECT id FROM due)) AND (r.state = 'SCHEDULED') IS TRUE
    RETURNING r.id
), opened AS (
    UPDATE task_runs t
       SET pending_deps = t.pending_deps - 1, start_gate = false, updated_at = now()
     -- by the runs' ids, no row source joined (see dispatch)
     WHERE t.run_id = ANY(ARRAY(SELECT id FROM started))
       AND (t.start_gate AND t.state = 'PENDING') IS TRUE
    RETURNING t.id
)
SELECT (SELECT count(*) FROM started) AS started, (SELECT count(*) FROM opened) AS opened;

-- name: start_timers
-- Durable timers whose dependencies are met start sleeping: RUNNING with a wake time on the
-- database clock, no lease (never reaped), no outbox row (no worker); their runs are marked
-- started like a claim marks them.
WITH due AS (
    SELECT t.id
      FROM task_runs t
     WHERE t.state = 'PENDING' AND t.pending_deps = 0 AND t.sleep_s IS NOT NULL
     ORDER BY t.seq
     LIMIT %(limit)s
       FOR UPDATE OF t SKIP LOCKED
), sleeping AS (
    UPDATE task_runs t
       SET state = 'RUNNING', wake_at = now() + make_interval(secs => t.sleep_s),
           started_at = coalesce(t.started_at, now()), updated_at = now()
     -- by id, no row source joined (see dispatch)
     WHERE t.id = ANY(ARRAY(SELECT id FROM due)) AND (t.state = 'PENDING') IS TRUE
    RETURNING t.id, t.run_id
), runs_started AS (
    UPDATE workflow_runs r
       SET state = 'RUNNING', started_at = coalesce(r.started_at, now()), updated_at = now()
     WHERE r.id = ANY(ARRAY(SELECT run_id FROM sleeping)) AND (r.state = 'PENDING') IS TRUE
)
SELECT count(*) AS n FROM sleeping;

-- name: wake_timers
-- Sleeping timers whose wake time has come SUCCEED, and release their dependents as a finish
-- does (PENDING → READY with an outbox row when nothing else holds them); propagate then
-- derives the runs. (An event wait's wake_at is its timeout: expire_event_waits takes it.)
WITH due AS (
    SELECT t.id
      FROM task_runs t
     WHERE t.state = 'RUNNING' AND t.wake_at <= now() AND t.sleep_s IS NOT NULL
     ORDER BY t.wake_at
     LIMIT %(limit)s
       FOR UPDATE OF t SKIP LOCKED
), woke AS (
    UPDATE task_runs t
       SET state = 'SUCCEEDED', finished_at = now(), propagated = false, updated_at = now()
     -- by id, no row source joined (see dispatch)
     WHERE t.id = ANY(ARRAY(SELECT id FROM due))
       AND (t.state = 'RUNNING' AND t.wake_at <= now() AND t.sleep_s IS NOT NULL) IS TRUE
    RETURNING t.id, t.state
),
-- use: release_dependents(woke)
SELECT (SELECT count(*) FROM woke) AS woke, (SELECT count(*) FROM queued) AS queued;

-- name: overdue_runs
-- Unfinished runs past their deadline that no deadline or operator has ended yet. Not locked
-- here: the caller stops their tasks first (task rows before run rows, the order every writer
-- uses), then marks them with mark_deadline_exceeded, which decides.
SELECT id
  FROM workflow_runs
 WHERE deadline_at <= now() AND finished_at IS NULL AND failure_reason IS NULL
   AND cancel_requested_at IS NULL
 ORDER BY deadline_at
 LIMIT %(limit)s;

-- name: mark_deadline_exceeded
UPDATE workflow_runs
   SET failure_reason = 'deadline_exceeded', updated_at = now()
 WHERE id = ANY(%(ids)s::uuid[]) AND deadline_at <= now() AND finished_at IS NULL
   AND failure_reason IS NULL AND cancel_requested_at IS NULL
RETURNING id;

-- name: next_due
-- Seconds (by the database clock) until the earliest start, wake-up, deadline or fire time
-- (of the schedules of the given workflows: the ones this scheduler fires) the passes act on,
-- or until the window of a rate key with tasks waiting for admission next loses a start (its
-- oldest start within the window ages out, and the key has room again), or until an open
-- breaker's cooldown ends: the scheduler sleeps no longer than that. NULL when none is waiting.
SELECT extract(epoch FROM least(
           (SELECT min(next_fire_at) FROM schedules
             WHERE NOT paused AND retired_at IS NULL AND workflow = ANY(%(workflows)s::text[])),
           (SELECT min(start_at) FROM workflow_runs
             WHERE state = 'SCHEDULED' AND start_at IS NOT NULL),
           (SELECT min(wake_at) FROM task_runs WHERE state = 'RUNNING' AND wake_at IS NOT NULL),
           (SELECT min(deadline_at) FROM workflow_runs
             WHERE deadline_at IS NOT NULL AND finished_at IS NULL AND failure_reason IS NULL
               AND cancel_requested_at IS NULL),
           (SELECT min(f.first + make_interval(secs => k.per))
              FROM (SELECT t.rate_key, max(t.rate_per_s) AS per
                      FROM task_runs t
                     WHERE t.rate_key IS NOT NULL AND
-- use: awaiting_admission(t)
                     GROUP BY t.rate_key) AS k
             CROSS JOIN LATERAL (
                   SELECT min(a.started_at) AS first FROM task_attempts a
                    WHERE a.rate_key = k.rate_key
                      AND a.started_at > now() - make_interval(secs => k.per)) AS f),
           -- a breaker's cooldown still running (one already over waits for a parked task to
           -- probe with: the poll interval finds it)
           (SELECT min(opened_at + make_interval(secs => cooldown_s)) FROM breakers
             WHERE state = 'open' AND NOT held
               AND opened_at + make_interval(secs => cooldown_s) > now())
       ) - now())::float8 AS due_in_s;

-- ------------------------------------------------------------------ worker

-- name: claim
-- READY → RUNNING for the dispatch generations the messages name (one row per id/token pair):
-- each token is bumped and its lease set in the same statement, the attempt recorded, and the
-- run marked started. With keyless_only, tasks with an idempotency key are left alone (the
-- caller then claims each in a transaction that also claims its key).
WITH wanted AS (
    -- (the ids behind a sub-select: see "generic plans of arrays" at finish)
    SELECT * FROM unnest((SELECT %(ids)s::uuid[]), %(tokens)s::bigint[]) AS w(id, token)
), claimed AS (
    UPDATE task_runs t
       SET state = 'RUNNING', attempt = t.attempt + 1, fencing_token = t.fencing_token + 1,
           lease_owner = %(worker)s,
           lease_expires_at = now() + make_interval(secs => %(lease_s)s),
           cancel_requested = false, started_at = coalesce(t.started_at, now()),
           parked_on = NULL,  -- a task parked once and retried now (retry-now, a rerun) is not
           updated_at = now()
      FROM wanted w
     -- (… IS TRUE): the primary key is the only way in; see runs_started below. The ids again
     -- as = ANY: a generic plan made on a small task_runs scans it, and this keeps that scan to
     -- the window's rows instead of handing every READY task to the join (docs/performance.md
     -- "The claim's plan on a small table")
     WHERE t.id = w.id AND t.id = ANY((SELECT %(ids)s::uuid[])::uuid[])
       AND (t.state = 'READY') IS TRUE AND t.fencing_token = w.token
       AND (NOT %(keyless_only)s::bool OR t.idempotency_key IS NULL)
       -- the gate of breakers and pauses (migration 0018): nothing holds anything (an
       -- InitPlan, evaluated once), or nothing holds this task. A task the gate holds is not
       -- claimed here; claim_many's per-pair path parks it (park).
       AND (NOT (SELECT flowforge_gates_closed())
            OR flowforge_gate(t.handler, t.queue, t.breaker_key, t.id) IS NULL)
    RETURNING t.id, t.run_id, t.name, t.handler, t.attempt, t.fencing_token, t.timeout_s,
              t.idempotency_key, extract(epoch FROM now() - t.ready_at)::float8 AS dispatch_lag_s,
              t.map_id, t.item_index, t.item, t.rate_key
), attempt_rows AS (
    -- an attempt of a rate-limited task carries its key: the key's window counts these starts
    INSERT INTO task_attempts (task_run_id, attempt, fencing_token, worker, rate_key)
    SELECT id, attempt, fencing_token, %(worker)s, rate_key FROM claimed
), runs_started AS (
    UPDATE workflow_runs r
       SET state = 'RUNNING', started_at = now(), updated_at = now()
     WHERE r.id IN (SELECT run_id FROM claimed)
       -- IS TRUE hides the state from index matching, so the primary key is the only way
       -- in. Otherwise, when the statistics say PENDING runs (or READY, RUNNING, PENDING
       -- tasks) are rare — taken on a quiet system just before a burst of triggers — the
       -- planner reads every such row through an index on the state, once per claim or per
       -- released dependent (tests/integration/test_query_plans.py).
       AND (r.state = 'PENDING') IS TRUE
), taken_locally AS (
    -- With local: the worker claims dependents its own finish made READY, without the broker.
    -- Their outbox rows are marked dispatched unless a publisher holds them right now (then
    -- the message goes out anyway, and its claim finds nothing to do).
    UPDATE outbox o
       SET published_at = now()
     WHERE %(local)s::bool AND o.id IN (
           SELECT q.id
             FROM outbox q
             JOIN claimed c ON q.task_run_id = c.id AND q.fencing_token = c.fencing_token - 1
            WHERE (q.published_at IS NULL) IS TRUE  -- by its key, as stamp_outbox says why
              FOR UPDATE OF q SKIP LOCKED)
)
, upstream_settled AS (
    -- With local (the worker claims what its own finish released): the upstream tasks of
    -- what it claims that SUCCEEDED and wait for their propagation are marked propagated. Each
    -- leaves its run a task RUNNING at this commit (the one claimed, row locked here), so the
    -- run's state cannot change by it, and whatever ends that task later propagates it (or,
    -- a success, passes this on): a chain's steps leave a scheduler pass nothing to do.
    UPDATE task_runs u
       SET propagated = true
      FROM task_edges e
      JOIN claimed c ON c.id = e.downstream_id
      JOIN workflow_runs r ON r.id = c.run_id
     WHERE %(local)s::bool AND u.id = e.upstream_id
       -- (the state and the flag hidden from index matching: the edges and the primary key
       -- are the only way in, as in claimed; see runs_started)
       AND (u.state = 'SUCCEEDED') IS TRUE AND NOT coalesce(u.propagated, true)
       AND r.cancel_requested_at IS NULL
), counted AS (
    -- every claimed task's upstream tasks, counted on the edges' index in one grouped read (a
    -- lateral subquery per claimed task cost more to plan than the rest of the claim:
    -- docs/performance.md "Chain hop and CPU per task"); a map's item has its map's but the
    -- list it maps over, which is always one of them (dag.py makes for_each a dependency)
    SELECT c.id, count(*) - CASE WHEN c.map_id IS NULL THEN 0 ELSE 1 END AS n
      FROM claimed c
      JOIN task_edges e ON e.downstream_id = coalesce(c.map_id, c.id)
     GROUP BY c.id, c.map_id
)
-- (a map's item sees its map's upstream results but the list it maps over, which it has as its
-- item: 10,000 items each given the 10,000-element list would move it 10,000 times)
-- The upstream results travel inline only within %(inline)s (worker.upstream_inline_items,
-- issue 22): upstream_n counts the upstream tasks, and above the bound upstream is NULL (the
-- handler pages them by name: upstream_names_page); an upstream whose result is a list longer
-- than the bound is left out of upstream and named in upstream_large with its length (the
-- handler pages its elements: upstream_items_page), so no claim carries more than the bound's
-- worth of results whatever the fan-in or the map's width.
-- payload_bytes: what the claim carries as JSON text, as the worker receives and decodes it
-- (input, item, inline upstream results), which the worker's window follows (roles/intake.py:
-- a batch's payload is held whole). Not pg_column_size: that is a TOASTed value's compressed
-- size, and an 8 MB input of repeated text stores as 90 KB.
SELECT c.*, r.input, r.workflow, coalesce(k.n, 0) AS upstream_n,
       CASE WHEN coalesce(k.n, 0) <= %(inline)s THEN v.upstream END AS upstream,
       v.large AS upstream_large,
       octet_length(r.input::text) + coalesce(octet_length(c.item::text), 0)
           + octet_length(v.upstream::text) AS payload_bytes
  FROM claimed c
  JOIN workflow_runs r ON r.id = c.run_id
  LEFT JOIN counted k ON k.id = c.id  -- (a task without upstream tasks has no row)
  CROSS JOIN LATERAL (
      -- (the WHERE on k.n is a one-time filter: a wide fan-in reads no result here at all)
      SELECT coalesce(jsonb_object_agg(w.name, w.result) FILTER (WHERE w.n IS NULL),
                      '{}'::jsonb) AS upstream,
             coalesce(jsonb_object_agg(w.name, jsonb_build_object('id', w.id, 'n', w.n,
                                                                  'items', w.items))
                      FILTER (WHERE w.n IS NOT NULL), '{}'::jsonb) AS large
        FROM (SELECT u.name, u.id, u.result, u.for_each IS NOT NULL AS items,
                     CASE WHEN l.n > %(inline)s THEN l.n END AS n
                FROM task_edges e JOIN task_runs u ON u.id = e.upstream_id
                LEFT JOIN task_runs m ON m.id = c.map_id
                -- (OFFSET 0: evaluated once per upstream, not once per use of l.n)
                CROSS JOIN LATERAL (SELECT
-- use: upstream_length(u)
                    AS n OFFSET 0) l
               WHERE e.downstream_id = coalesce(c.map_id, c.id)
                 AND u.name IS DISTINCT FROM m.for_each
                 AND coalesce(k.n, 0) <= %(inline)s) w) v;

-- fragment: upstream_length(task)
-- The length of an upstream task's result when it is a list, else NULL: a SUCCEEDED map's
-- counted on its items' index (its result is their results in item order; reading the stored
-- list to count it would read all of it), another task's from its result.
CASE WHEN {task}.for_each IS NOT NULL
     THEN CASE WHEN {task}.state = 'SUCCEEDED'
               THEN (SELECT count(*) FROM task_runs i WHERE i.map_id = {task}.id) END
     WHEN jsonb_typeof({task}.result) = 'array' THEN jsonb_array_length({task}.result) END
-- (end of upstream_length)

-- name: upstream_names_page
-- A claimed task's upstream tasks (as claim finds them) in name order after %(after)s (NULL:
-- from the first), up to %(limit)s: each one's result inline, or (a list longer than
-- %(inline)s) its id and length instead, as claim's upstream_large.
-- (%(results)s false: names only, as iterating the names needs no result.) The edges hold
-- their upstream's name, indexed with the downstream id (task_edges_downstream_name_idx), so a
-- page reads its own edges in name order and only their tasks' rows, whatever the fan-in.
SELECT p.name, p.id, p.for_each IS NOT NULL AS items,
       CASE WHEN l.n > %(inline)s THEN l.n END AS n,
       CASE WHEN l.n > %(inline)s OR NOT %(results)s::bool THEN NULL ELSE p.result END AS result
  FROM (SELECT e.upstream_name AS name, u.id, u.for_each, u.state, u.result
          -- the join's edges (a map item's: its map's) as scalars first, so the page is an
          -- ordered range of the index that stops at the limit, not a sort of every edge
          FROM (SELECT e.upstream_name, e.upstream_id
                  FROM task_edges e
                 WHERE e.downstream_id = (SELECT coalesce(t.map_id, t.id)
                                            FROM task_runs t WHERE t.id = %(id)s)
                   AND e.upstream_name IS DISTINCT FROM
                       (SELECT m.for_each FROM task_runs t JOIN task_runs m ON m.id = t.map_id
                         WHERE t.id = %(id)s)
                   AND (%(after)s::text IS NULL OR e.upstream_name > %(after)s::text)
                   AND (%(name)s::text IS NULL OR e.upstream_name = %(name)s::text)
                 ORDER BY e.upstream_name
                 LIMIT %(limit)s) e
          JOIN task_runs u ON u.id = e.upstream_id) p
  CROSS JOIN LATERAL (SELECT
-- use: upstream_length(p)
      AS n OFFSET 0) l
 ORDER BY p.name;

-- name: upstream_map_items_page
-- A page of a SUCCEEDED map's result read from its items' rows (task_runs_map_item_idx, keyset
-- on the item index): the elements after index %(after)s, up to %(limit)s. A map's indexes run
-- 0..n-1 without a gap, so the page is also a closed range: however stale the statistics (a
-- map just expanded has not been analyzed), no plan reads more than the page's rows.
SELECT i.item_index AS i, i.result AS value
  FROM task_runs i
 WHERE i.map_id = %(id)s AND i.item_index > %(after)s::int
   AND i.item_index <= %(after)s::int + %(limit)s::int
 ORDER BY i.item_index
 LIMIT %(limit)s;

-- name: upstream_list_page
-- A page of another task's list result: the elements after index %(after)s, up to %(limit)s
-- (PostgreSQL reads the whole stored value for each page: such a list is one value).
SELECT (e.i - 1) AS i, e.value
  FROM task_runs t
 CROSS JOIN LATERAL jsonb_array_elements(t.result) WITH ORDINALITY AS e(value, i)
 WHERE t.id = %(id)s AND jsonb_typeof(t.result) = 'array' AND e.i - 1 > %(after)s
 ORDER BY e.i
 LIMIT %(limit)s;

-- name: park
-- READY → RETRYING for a task the gate holds (its handler's breaker open, its queue or handler
-- paused: flowforge_gate, migration 0018): no attempt used, no retry time (the scheduler's
-- unpark_tasks gives it one when nothing holds it), its token bumped so the message that
-- brought it is stale, why in parked_on. Run by claim_many for a pair its claim left alone, so
-- only a gated (or stale) pair pays for it.
UPDATE task_runs t
   SET state = 'RETRYING', fencing_token = t.fencing_token + 1, retry_at = NULL,
       parked_on = flowforge_gate(t.handler, t.queue, t.breaker_key, t.id), updated_at = now()
 WHERE t.id = %(id)s AND t.state = 'READY' AND t.fencing_token = %(token)s
   AND flowforge_gate(t.handler, t.queue, t.breaker_key, t.id) IS NOT NULL
RETURNING t.id, t.parked_on;

-- name: acquire_key
-- Claims an idempotency key exclusively. A RUNNING key may be taken over only once its
-- holder's lease has lapsed; the WHERE is evaluated on the latest committed row version.
INSERT INTO idempotency_keys (key, state, task_run_id, fencing_token, lease_expires_at)
VALUES (%(key)s, 'RUNNING', %(id)s, %(token)s, now() + make_interval(secs => %(lease_s)s))
ON CONFLICT (key) DO UPDATE
   SET task_run_id = EXCLUDED.task_run_id, fencing_token = EXCLUDED.fencing_token,
       lease_expires_at = EXCLUDED.lease_expires_at, updated_at = now()
 WHERE idempotency_keys.state = 'RUNNING'
   AND (idempotency_keys.lease_expires_at < now()
        OR idempotency_keys.task_run_id = EXCLUDED.task_run_id)
RETURNING state;

-- name: read_key
-- A SUCCEEDED key's stored result, for reuse; the reuse renews the key's retention (updated_at),
-- so a key is kept scheduler.idempotency_retention_days after its last use. A key held by a
-- running execution returns nothing (the caller waits for it).
UPDATE idempotency_keys SET updated_at = now()
 WHERE key = %(key)s AND state = 'SUCCEEDED'
RETURNING state, result, task_run_id;

-- name: defer
-- READY → RETRYING without using an attempt: the idempotency key is busy elsewhere.
UPDATE task_runs
   SET state = 'RETRYING', fencing_token = fencing_token + 1,
       retry_at = now() + make_interval(secs => %(delay_s)s), updated_at = now()
 WHERE id = %(id)s AND state = 'READY' AND fencing_token = %(token)s
RETURNING id;

-- name: renew_leases
-- Extends every lease the worker still holds (id/token pairs); returns the ones it holds.
WITH held AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(tokens)s::bigint[]) AS h(id, token)
), renewed AS (
    UPDATE task_runs t
       SET lease_expires_at = now() + make_interval(secs => %(lease_s)s)
      FROM held h
     WHERE t.id = h.id AND t.state = 'RUNNING' AND t.fencing_token = h.token
    RETURNING t.id, t.fencing_token, t.cancel_requested, t.idempotency_key
), keys_renewed AS (
    UPDATE idempotency_keys k
       SET lease_expires_at = now() + make_interval(secs => %(lease_s)s)
      FROM renewed r
     WHERE k.key = r.idempotency_key AND k.task_run_id = r.id
       AND k.fencing_token = r.fencing_token AND k.state = 'RUNNING'
)
SELECT id, cancel_requested FROM renewed;

-- name: write_output
-- A running attempt's captured output and progress so far (the worker's lease keeper, at most
-- every worker.output_flush_ms, only for attempts that wrote or reported something since: a
-- silent handler never costs this statement). Written only while the task is RUNNING with that
-- token, so nothing lands after its finish or on another worker's attempt; a NULL output or
-- progress leaves the stored one. Returns the task runs written.
WITH live AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(tokens)s::bigint[], %(outputs)s::text[],
                         %(dropped)s::bigint[], %(progress)s::float8[], %(messages)s::text[])
           AS l(id, token, output, dropped, progress, message)
), current AS (
    -- (… IS TRUE): the primary key is the only way in (see claim)
    SELECT t.id, t.attempt, l.output, l.dropped, l.progress, l.message
      FROM task_runs t JOIN live l ON t.id = l.id
     WHERE (t.state = 'RUNNING') IS TRUE AND t.fencing_token = l.token
), progressed AS (
    UPDATE task_runs t
       SET progress = c.progress, progress_message = c.message, progress_attempt = c.attempt,
           progress_at = now()
      FROM current c
     WHERE t.id = c.id AND c.progress IS NOT NULL
), written AS (
    UPDATE task_attempts a
       SET output = c.output, output_dropped = c.dropped
      FROM current c
     WHERE a.task_run_id = c.id AND a.attempt = c.attempt AND c.output IS NOT NULL
)
SELECT id FROM current;

-- name: release_claims
-- Claims whose handler never started: a worker held up by a slow handler hands the tasks it
-- claimed behind it back. The attempt is un-counted (its row deleted) and the token bumped.
-- RUNNING → READY with a fresh outbox row, so another worker takes the task; or, when its run
-- asked it to stop meanwhile, RUNNING → CANCELLED (cancellation skipped it while it was
-- RUNNING, so nothing else would) — DEAD 'operator' when an operator buried it meanwhile.
WITH unstarted AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(tokens)s::bigint[]) AS u(id, token)
), released AS (
    UPDATE task_runs t
       SET state = CASE WHEN t.bury_requested THEN 'DEAD'
                        WHEN t.cancel_requested THEN 'CANCELLED' ELSE 'READY' END,
           failure_reason = CASE WHEN t.bury_requested THEN 'operator'
                                 WHEN t.cancel_requested THEN 'cancelled' END,
           cancel_cause = CASE WHEN t.bury_requested THEN NULL ELSE t.cancel_cause END,
           finished_at = CASE WHEN t.cancel_requested THEN now() END,
           propagated = CASE WHEN t.cancel_requested THEN false ELSE t.propagated END,
           attempt = t.attempt - 1, fencing_token = t.fencing_token + 1,
           lease_owner = NULL, lease_expires_at = NULL,
           ready_at = CASE WHEN t.cancel_requested THEN t.ready_at ELSE now() END,
           started_at = CASE WHEN t.attempt = 1 THEN NULL ELSE t.started_at END,
           updated_at = now()
      FROM unstarted u
     WHERE t.id = u.id AND t.state = 'RUNNING' AND t.fencing_token = u.token
    RETURNING t.id, t.state, t.attempt, t.fencing_token, t.idempotency_key, t.queue,
              t.priority
), forgotten AS (
    DELETE FROM task_attempts a
     USING released r
     WHERE a.task_run_id = r.id AND a.attempt = r.attempt + 1
), keys_released AS (
    DELETE FROM idempotency_keys k
     USING released r
     WHERE k.key = r.idempotency_key AND k.task_run_id = r.id
       AND k.fencing_token = r.fencing_token - 1 AND k.state = 'RUNNING'
), queued AS (
    INSERT INTO outbox (task_run_id, fencing_token, queue, priority)
    SELECT id, fencing_token, queue, priority FROM released WHERE state = 'READY'
    ON CONFLICT (task_run_id, fencing_token) DO NOTHING
)
SELECT id, state,
       CASE WHEN state = 'READY' THEN pg_notify('flowforge_outbox', '')::text
            ELSE pg_notify('flowforge_scheduler', '')::text END AS notified
  FROM released;

-- name: finish
-- RUNNING → SUCCEEDED / FAILED / CANCELLED for each outcome whose token is current; a stale
-- token matches nothing (the caller counts it: count_stale_completions). A task an operator
-- buried while it ran ends DEAD 'operator' where its stop would have ended it CANCELLED.
-- Attempts are closed, idempotency keys settled,
-- dependents released (PENDING → READY with an outbox row when nothing else holds them) and
-- the scheduler and publisher notified in the same statement: one round trip for a batch.
-- The results come as one jsonb array (rows.jsonb_array, as insert_runs' inputs), each a
-- one-element array or null: a stored JSON null stays apart from no result (SQL NULL).
WITH outcome AS (
    -- (a scalar's -> 0 is itself: the type, not the operator, tells null from [null])
    SELECT o.*, CASE WHEN jsonb_typeof(r.wrapped) = 'array' THEN r.wrapped -> 0 END AS result
      -- Generic plans of arrays: a custom plan estimates unnest of a constant array at its
      -- length, a generic plan at 10 rows, so for the one-task batches of a busy tree every
      -- custom plan looked cheaper than the generic one and PostgreSQL, which keeps a generic
      -- plan only while it costs no more than the custom plans' average, planned this
      -- statement (and claim) at every execution once the tables had grown. The ids behind a
      -- sub-select (an InitPlan: its value is not known when planning) make every plan guess
      -- at least 10 rows, so the generic plan wins after five custom ones (docs/performance.md
      -- "Prepared statements that PostgreSQL plans anyway"; test_prepared_plans).
      FROM unnest((SELECT %(ids)s::uuid[]), %(tokens)s::bigint[], %(states)s::text[],
                  %(reasons)s::text[], %(errors)s::text[],
                  %(tracebacks)s::text[], %(outcomes)s::text[], %(outputs)s::text[],
                  %(dropped)s::bigint[], %(progress)s::float8[], %(messages)s::text[])
           WITH ORDINALITY
           AS o(id, token, state, reason, error, traceback, outcome, output, dropped,
                progress, message, n)
      JOIN jsonb_array_elements(%(results)s::jsonb) WITH ORDINALITY AS r(wrapped, n)
           USING (n)
), settling AS (
    -- A success that ends its run, settled here instead of by a scheduler pass (a second write
    -- of the task's row and five statements; docs/architecture.md "A finish settles a one-task
    -- run"): the run's definition has this one task (no sibling by construction; read by the
    -- definition's key, never the run's other tasks), the run RUNNING, not asked to stop, not
    -- failed by its deadline (expire_deadlines), no child run (settle_children hands those
    -- on), the task nothing a pass must see (the complement of done.for_pass). Locked task then run (the scheduler's order); a change committed
    -- since the snapshot is rechecked on the locked rows.
    SELECT t.id, t.run_id
      FROM outcome o
      JOIN task_runs t ON t.id = o.id
      -- the run from its task, never the tasks from their run: t.run_id cast to text and back
      -- is no column an index of task_runs has, so no plan reads every task of a RUNNING run
      -- to find the one finished (a plan made on small tables did, once per finish of a wide
      -- fan-out: docs/performance.md "A finish settles a one-task run")
      JOIN workflow_runs r ON r.id = t.run_id::text::uuid
      JOIN workflow_definitions d ON d.name = r.workflow AND d.digest = r.workflow_digest
     WHERE t.id = ANY((SELECT %(ids)s::uuid[])::uuid[]) AND o.state = 'SUCCEEDED'
       AND d.task_count = 1
       AND (t.state = 'RUNNING') IS TRUE AND t.fencing_token = o.token
       AND num_nonnulls(t.concurrency_key, t.ordering_key, t.map_id) = 0
       AND NOT t.cancel_requested AND NOT t.bury_requested
       AND (r.state = 'RUNNING') IS TRUE AND r.cancel_requested_at IS NULL
       AND r.failure_reason IS NULL AND r.parent_run_id IS NULL
       FOR UPDATE OF t, r
), done AS (
    UPDATE task_runs t
       SET state = CASE WHEN o.state = 'CANCELLED' AND t.bury_requested THEN 'DEAD'
                        ELSE o.state END,
           result = o.result,
           failure_reason = CASE WHEN o.state = 'CANCELLED' AND t.bury_requested
                                 THEN 'operator' ELSE o.reason END,
           last_error = coalesce(o.error, t.last_error),
           lease_owner = NULL,
           lease_expires_at = NULL,
           crash_streak = 0,
           cancel_cause = CASE WHEN o.state = 'CANCELLED' AND NOT t.bury_requested
                               THEN coalesce(t.cancel_cause, 'operator') END,
           finished_at = CASE WHEN o.state = 'FAILED' THEN NULL ELSE now() END,
           propagated = (o.state = 'FAILED') OR t.id IN (SELECT id FROM settling),
           updated_at = now(),
           -- the attempt's last ctx.progress (NULL: none reported, the stored one is kept)
           progress = coalesce(o.progress, t.progress),
           progress_message = CASE WHEN o.progress IS NULL THEN t.progress_message
                                   ELSE o.message END,
           progress_attempt = CASE WHEN o.progress IS NULL THEN t.progress_attempt
                                   ELSE t.attempt END,
           progress_at = CASE WHEN o.progress IS NULL THEN t.progress_at ELSE now() END
      FROM outcome o
     -- (… IS TRUE): the primary key is the only way in (see claim); the ids again as = ANY,
     -- as the claim's: a generic plan made while RUNNING was rare in the statistics read
     -- task_runs whole at every finish (docs/performance.md "The finish's batch by id")
     WHERE t.id = o.id AND t.id = ANY((SELECT %(ids)s::uuid[])::uuid[])
       AND (t.state = 'RUNNING') IS TRUE AND t.fencing_token = o.token
    RETURNING t.id, t.attempt, t.idempotency_key, o.token, o.state, o.result, o.reason,
              o.error, o.traceback, o.outcome, o.output, o.dropped,
              -- its end frees what a scheduler pass hands on: a concurrency slot, an ordering
              -- stream, a map's item (settle, open a slot); or its run asked it to stop (a rate
              -- window counts starts, not ends: a rate key needs no pass here)
              num_nonnulls(t.concurrency_key, t.ordering_key, t.map_id) > 0
                  OR t.cancel_requested AS for_pass
), settled AS (
    UPDATE workflow_runs r
       SET state = 'SUCCEEDED', finished_at = now(), updated_at = now()
     WHERE r.id IN (SELECT s.run_id FROM settling s JOIN done d ON d.id = s.id)
), closed AS (
    -- with the attempt's captured output (NULL: it wrote nothing, or kept what was written)
    UPDATE task_attempts a
       SET finished_at = now(), outcome = d.outcome, failure_reason = d.reason,
           error = d.error, traceback = d.traceback,
           output = coalesce(d.output, a.output),
           output_dropped = coalesce(d.dropped, a.output_dropped)
      FROM done d
     WHERE a.task_run_id = d.id AND a.attempt = d.attempt
), keys_kept AS (
    UPDATE idempotency_keys k
       SET state = 'SUCCEEDED', result = d.result, lease_expires_at = NULL, updated_at = now()
      FROM done d
     WHERE d.state = 'SUCCEEDED' AND k.key = d.idempotency_key
       AND k.task_run_id = d.id AND k.fencing_token = d.token AND k.state = 'RUNNING'
), keys_released AS (
    DELETE FROM idempotency_keys k
     USING done d
     WHERE d.state <> 'SUCCEEDED' AND k.key = d.idempotency_key
       AND k.task_run_id = d.id AND k.fencing_token = d.token AND k.state = 'RUNNING'
),
-- Success releases the dependents here rather than in a scheduler pass (one hop fewer per DAG
-- level).
-- use: release_dependents(done)
, woken AS (
    -- The scheduler is woken only when its pass has work from this finish: an outcome other
    -- than success (route a failure, propagate a cancellation), an end that frees something
    -- (done.for_pass), a dependent left for a pass (released.for_pass), a gate held (a probe's
    -- verdict, a parked task), or a success that released no dependent: its run may be over.
    -- A success that released one leaves its run an unfinished task, so the run's state
    -- cannot change: its propagation (marking it) waits for whichever pass comes next.
    SELECT pg_notify('flowforge_scheduler', '')
     WHERE EXISTS (SELECT 1 FROM done d
                    WHERE d.state <> 'SUCCEEDED' OR d.for_pass
                       OR NOT EXISTS (SELECT 1 FROM task_edges e
                                        JOIN released r ON r.id = e.downstream_id
                                       WHERE e.upstream_id = d.id)
                          AND d.id NOT IN (SELECT id FROM settling))
        OR EXISTS (SELECT 1 FROM released WHERE for_pass)
        OR (SELECT flowforge_gates_closed())
)
-- one row per finished task (ready_token NULL), then up to %(offer)s of the dependents made
-- READY (NULL: all) on the finishing worker's queue %(queue)s (or on none: see migration
-- 0014) and of at least its %(min_priority)s (a reserved worker's), which it may claim itself;
-- the rest go out as messages, to their own queues and bands. Keyless ones first: a
-- continuation claims only those (finish_many), and up to its limit of them. With
-- %(publish)s false the publisher is not notified here: the caller claims the dependents in
-- this transaction and notifies it (notify_outbox) only for those it did not claim (queued
-- counts the outbox rows written either way).
SELECT id, NULL::bigint AS ready_token, (SELECT count(*) FROM woken) AS woken,
       (SELECT count(*) FROM queued) AS queued,
       (SELECT count(pg_notify('flowforge_outbox', '')) FROM queued WHERE %(publish)s)
           AS published
  FROM done
UNION ALL
(SELECT id, fencing_token, NULL, NULL, NULL FROM released
  WHERE state = 'READY' AND (queue IS NULL OR queue = %(queue)s)
    AND priority >= %(min_priority)s
  ORDER BY keyless DESC LIMIT %(offer)s);

-- name: count_stale_completions
-- Outcomes a finish matched nothing for (their token was no longer current: reaped, or
-- finished elsewhere), counted by the finishing worker once the finish committed (best
-- effort: Claims._count_stale): it knows how many it sent and which committed. Not in the
-- finish itself: that statement is parsed by psycopg only while it stays under 4,096 bytes
-- (tests/unit/test_queries.py), and a stale outcome is rare.
INSERT INTO counters (name, value) VALUES ('stale_completions', %(n)s)
ON CONFLICT (name) DO UPDATE SET value = counters.value + EXCLUDED.value;

-- ------------------------------------------------------------------ operator actions

-- name: mark_run_cancel_requested
UPDATE workflow_runs
   SET cancel_requested_at = coalesce(cancel_requested_at, now()), updated_at = now()
 WHERE id = %(id)s
RETURNING id;

-- name: requeue_dead
-- DEAD → PENDING with a fresh retry budget; dependencies are counted anew (for a conditional
-- run_if task: its unfinished ones and its condition gate, evaluated again).
UPDATE task_runs t
   SET state = 'PENDING', budget_start = t.attempt, fencing_token = t.fencing_token + 1,
       failure_reason = NULL, retry_at = NULL, finished_at = NULL, crash_streak = 0,
       cancel_requested = false, bury_requested = false, propagated = true, updated_at = now(),
       pending_deps = CASE
           WHEN t.run_if = 'all_succeeded' THEN
               (SELECT count(*) FROM task_edges e JOIN task_runs u ON u.id = e.upstream_id
                 WHERE e.downstream_id = t.id AND u.state <> 'SUCCEEDED')
           ELSE 1 + (SELECT count(*) FROM task_edges e JOIN task_runs u ON u.id = e.upstream_id
                      WHERE e.downstream_id = t.id  -- the gate's invariant: regate_conditions
                        AND NOT (u.state = 'SUCCEEDED'
                                 OR (u.state IN ('DEAD', 'CANCELLED') AND u.propagated)))
       END
 WHERE t.id = %(id)s AND t.state = 'DEAD'
RETURNING t.id, t.run_id, t.attempt;

-- name: revive_cancelled
-- Tasks cancelled only because the requeued task died come back with it: those downstream of
-- it, and — once no task of the run is DEAD any more — whatever fail-fast cancelled. Running
-- siblings that fail-fast asked to stop are told to carry on. Nothing is revived in a run an
-- operator cancelled.
WITH RECURSIVE downstream(id) AS (
    SELECT downstream_id FROM task_edges WHERE upstream_id = %(id)s
    UNION
    SELECT e.downstream_id FROM task_edges e JOIN downstream d ON e.upstream_id = d.id
), run_state AS (
    SELECT NOT EXISTS (SELECT 1 FROM task_runs
                        WHERE run_id = %(run_id)s AND state = 'DEAD') AS nothing_dead,
           EXISTS (SELECT 1 FROM workflow_runs
                    WHERE id = %(run_id)s AND cancel_requested_at IS NOT NULL) AS operator_cancel
), revived AS (
    UPDATE task_runs t
       SET state = 'PENDING', cancel_cause = NULL, failure_reason = NULL, finished_at = NULL,
           fencing_token = t.fencing_token + 1, cancel_requested = false, propagated = true,
           updated_at = now(),
           pending_deps = (SELECT count(*) FROM task_edges e JOIN task_runs u ON u.id = e.upstream_id
                            WHERE e.downstream_id = t.id AND u.state <> 'SUCCEEDED')
                          -- a map's item waits for a max_parallel slot again (no edge of its
                          -- own), unless keyed: admit_gated applies its map's max_parallel
                          + (SELECT count(*) FROM task_runs m
                              WHERE m.id = t.map_id AND m.max_parallel IS NOT NULL
                                AND t.ready_by_itself)
      FROM run_state s
     WHERE t.run_id = %(run_id)s AND t.state = 'CANCELLED' AND t.cancel_cause = 'upstream'
       AND NOT s.operator_cancel
       AND (s.nothing_dead OR t.id IN (SELECT id FROM downstream))
    RETURNING t.id
), resumed AS (
    UPDATE task_runs t
       SET cancel_requested = false, cancel_cause = NULL, updated_at = now()
      FROM run_state s
     WHERE t.run_id = %(run_id)s AND t.state = 'RUNNING' AND t.cancel_cause = 'upstream'
       AND NOT s.operator_cancel AND s.nothing_dead
)
SELECT id FROM revived;

-- name: insert_audit
INSERT INTO requeue_audit (task_run_id, requested_by, reason, previous_reason, attempt)
VALUES (%(id)s, %(by)s, %(reason)s, %(previous_reason)s, %(attempt)s);

-- name: regate_conditions
-- A requeue brings tasks back from DEAD / CANCELLED: the conditional (run_if) dependents still
-- waiting on them have their gate counted anew, as the invariant every writer keeps: 1 (the
-- condition) + each dependency not yet counted off — a success is counted off by the statement
-- that makes it, a death or cancellation by propagate (release_conditions), so one not yet
-- propagated still counts here and is counted off once, later.
UPDATE task_runs t
   SET pending_deps = 1 + (SELECT count(*) FROM task_edges e JOIN task_runs u ON u.id = e.upstream_id
                            WHERE e.downstream_id = t.id
                              AND NOT (u.state = 'SUCCEEDED'
                                       OR (u.state IN ('DEAD', 'CANCELLED') AND u.propagated))),
       updated_at = now()
 WHERE t.id IN (SELECT downstream_id FROM task_edges WHERE upstream_id = ANY(%(ids)s::uuid[]))
   AND t.state = 'PENDING' AND t.run_if <> 'all_succeeded';

-- name: lock_rerun
-- The run to rerun, locked after its tasks (lock_run_tasks), with what a rerun needs to know.
SELECT id, state, finished_at IS NOT NULL AS finished
  FROM workflow_runs
 WHERE id = %(id)s
   FOR UPDATE;

-- name: run_task_names
SELECT name FROM task_runs WHERE run_id = %(id)s;

-- name: rerun_tasks
-- A finished run's DEAD and CANCELLED tasks (and, with from_task, that task), with everything
-- downstream of them, back to PENDING in one conditional statement: a fresh retry budget, a
-- new token, no result. Every task left out SUCCEEDED, so a reset task waits for its reset
-- upstream tasks only (plus its condition gate, for a run_if task). Results of the others
-- stay and are handed downstream as before.
WITH RECURSIVE chosen(id) AS (
    SELECT id FROM task_runs
     WHERE run_id = %(id)s
       AND (state IN ('DEAD', 'CANCELLED') OR name = %(from_task)s)
    UNION
    SELECT e.downstream_id FROM task_edges e JOIN chosen c ON e.upstream_id = c.id
)
UPDATE task_runs t
   SET state = 'PENDING', budget_start = t.attempt, fencing_token = t.fencing_token + 1,
       failure_reason = NULL, last_error = NULL, result = NULL, retry_at = NULL,
       finished_at = NULL, crash_streak = 0, cancel_requested = false, cancel_cause = NULL,
       wake_at = NULL, start_gate = false, propagated = true, bury_requested = false,
       updated_at = now(),
       pending_deps = (SELECT count(*) FROM task_edges e
                        WHERE e.downstream_id = t.id
                          AND e.upstream_id IN (SELECT id FROM chosen))
                      + CASE WHEN t.run_if <> 'all_succeeded' THEN 1 ELSE 0 END
 WHERE t.id IN (SELECT id FROM chosen) AND t.run_id = %(id)s
   AND t.state IN ('SUCCEEDED', 'DEAD', 'CANCELLED')
RETURNING t.id, t.name;

-- name: reopen_run
-- A rerun run is no longer finished, cancelled or past a deadline: it has none any more (its
-- deadline ended it once; a rerun is the operator's decision to carry on).
UPDATE workflow_runs
   SET finished_at = NULL, cancel_requested_at = NULL, failure_reason = NULL,
       deadline_at = NULL, updated_at = now()
 WHERE id = %(id)s AND finished_at IS NOT NULL
RETURNING id;

-- name: insert_rerun_audit
INSERT INTO rerun_audit (run_id, requested_by, reason, from_task, previous_state,
                         task_run_ids, task_names)
VALUES (%(id)s, %(by)s, %(reason)s, %(from_task)s, %(previous_state)s, %(task_run_ids)s,
        %(task_names)s);

-- name: get_rerun_audit
SELECT requested_by, reason, from_task, previous_state, task_run_ids, task_names, requested_at
  FROM rerun_audit
 WHERE run_id = %(id)s
 ORDER BY id;

-- ------------------------------------------------------------------ reads

-- name: task_state
SELECT state, failure_reason, attempt FROM task_runs WHERE id = %(id)s;

-- fragment: run_columns(w)
-- A run's columns as its reads show it (rows.run), of the row {w}: get_run and
-- insert_runs_answered answer the same.
{w}.id, {w}.workflow, {w}.state, {w}.input, {w}.idempotency_key, {w}.cancel_requested_at,
{w}.created_at, {w}.started_at, {w}.finished_at, {w}.start_at, {w}.deadline_at,
{w}.failure_reason, {w}.schedule, {w}.fire_time, {w}.parent_run_id, {w}.parent_task_id

-- name: get_run
SELECT
-- use: run_columns(w)
  FROM workflow_runs w WHERE w.id = %(id)s;

-- fragment: task_columns(t)
-- A task's columns as a run's read shows it (rows.task_run), of the row {t}, but its
-- depends_on, item_counts and waiting_on, which read other rows: get_run_tasks and
-- insert_tasks_answered answer the same. Ends with a comma: the caller's columns follow.
{t}.id, {t}.run_id, {t}.name, {t}.handler, {t}.state, {t}.attempt, {t}.max_attempts,
{t}.fencing_token, {t}.failure_reason, {t}.last_error, {t}.result, {t}.idempotency_key,
{t}.ordering_key, {t}.lease_owner, {t}.lease_expires_at, {t}.retry_at, {t}.cancel_requested,
{t}.created_at, {t}.ready_at, {t}.started_at, {t}.finished_at, {t}.sleep_s, {t}.wake_at,
{t}.event_name, {t}.event_key, {t}.run_if, {t}.cancel_cause,
-- a progress another attempt reported is not this one's (migration 0021)
CASE WHEN {t}.progress_attempt = {t}.attempt THEN {t}.progress END AS progress,
{t}.progress_message, {t}.for_each, {t}.child_workflow, {t}.child_run_id, {t}.queue,
{t}.concurrency_key, {t}.concurrency_limit, {t}.rate_key, {t}.rate_limit, {t}.rate_per_s,
{t}.breaker_key, {t}.priority,

-- name: get_run_tasks
SELECT
-- use: task_columns(t)
       coalesce((SELECT array_agg(u.name ORDER BY u.name)
                   FROM task_edges e JOIN task_runs u ON u.id = e.upstream_id
                  WHERE e.downstream_id = t.id), '{}') AS depends_on,
       -- a map is one task here with its items counted by state (map_items_page lists them)
       CASE WHEN t.for_each IS NOT NULL
            THEN (SELECT coalesce(jsonb_object_agg(c.state, c.n), '{}'::jsonb)
                    FROM (SELECT i.state, count(*) AS n FROM task_runs i
                           WHERE i.map_id = t.id GROUP BY i.state) AS c) END AS item_counts,
-- use: waiting_on(t)
  FROM task_runs t
 WHERE t.run_id = %(id)s AND t.map_id IS NULL
 ORDER BY t.seq;

-- name: get_task
SELECT t.id, t.run_id, t.name, t.handler, t.state, t.attempt, t.max_attempts, t.fencing_token,
       t.failure_reason, t.last_error, t.result, t.idempotency_key, t.ordering_key,
       t.lease_owner, t.lease_expires_at, t.retry_at, t.cancel_requested, t.created_at,
       t.ready_at, t.started_at, t.finished_at, t.sleep_s, t.wake_at, t.event_name, t.event_key,
       t.run_if, t.cancel_cause,
       -- a progress another attempt reported is not this one's (migration 0021)
       CASE WHEN t.progress_attempt = t.attempt THEN t.progress END AS progress,
       t.progress_message,
       coalesce((SELECT array_agg(u.name ORDER BY u.name)
                   FROM task_edges e JOIN task_runs u ON u.id = e.upstream_id
                  WHERE e.downstream_id = t.id), '{}') AS depends_on,
       t.for_each, t.map_id, t.item_index, t.child_workflow, t.child_run_id, t.queue,
       t.concurrency_key, t.concurrency_limit, t.rate_key, t.rate_limit, t.rate_per_s,
       t.breaker_key, t.priority,
-- use: waiting_on(t)
  FROM task_runs t
 WHERE t.id = %(id)s;

-- name: get_attempt_output
-- One attempt's captured output (%(attempt)s; NULL: the latest) with its task's state; no row:
-- no such task run; a NULL attempt: no such attempt (or none yet).
SELECT t.id AS task_run_id, t.state, t.attempt AS attempts, a.attempt, a.started_at,
       a.finished_at, a.outcome, a.output, a.output_dropped
  FROM task_runs t
  LEFT JOIN task_attempts a
    ON a.task_run_id = t.id
   AND a.attempt = coalesce(%(attempt)s::integer,
                            (SELECT max(l.attempt) FROM task_attempts l WHERE l.task_run_id = t.id))
 WHERE t.id = %(id)s;

-- name: get_attempts
SELECT task_run_id, attempt, fencing_token, worker, started_at, finished_at, outcome,
       failure_reason, error, traceback
  FROM task_attempts
 WHERE task_run_id = %(id)s
 ORDER BY attempt;

-- name: list_runs
-- Keyset pagination, newest first: (created_at, id) below the cursor, created within
-- [since, until). Run unprepared (a custom plan): the NULL tests then fold away and each filter
-- combination gets its index (state / workflow / workflow+state / created_at).
SELECT id, workflow, state, input, idempotency_key, cancel_requested_at, created_at,
       started_at, finished_at, start_at, deadline_at, failure_reason, schedule, fire_time,
       parent_run_id, parent_task_id
  FROM workflow_runs
 WHERE (%(state)s::text IS NULL OR state = %(state)s::text)
   AND (%(workflow)s::text IS NULL OR workflow = %(workflow)s::text)
   AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
   AND (%(until)s::timestamptz IS NULL OR created_at < %(until)s::timestamptz)
   AND (%(before_created)s::timestamptz IS NULL
        OR (created_at, id) < (%(before_created)s::timestamptz, %(before_id)s::uuid))
 ORDER BY created_at DESC, id DESC
 LIMIT %(limit)s;

-- name: list_dead
-- Dead tasks newest first, filtered by reason / workflow / handler, keyset-paginated on
-- (finished_at, id) (a DEAD task always has finished_at). Run unprepared, like list_runs.
SELECT t.id, t.run_id, t.name, t.handler, t.state, t.attempt, t.max_attempts, t.fencing_token,
       t.failure_reason, t.last_error, t.result, t.idempotency_key, t.ordering_key,
       t.lease_owner, t.lease_expires_at, t.retry_at, t.cancel_requested, t.created_at,
       t.ready_at, t.started_at, t.finished_at, t.sleep_s, t.wake_at, t.event_name, t.event_key,
       '{}'::text[] AS depends_on, r.workflow
  FROM task_runs t
  JOIN workflow_runs r ON r.id = t.run_id
 WHERE t.state = 'DEAD'
   AND (%(reason)s::text IS NULL OR t.failure_reason = %(reason)s::text)
   AND (%(handler)s::text IS NULL OR t.handler = %(handler)s::text)
   AND (%(workflow)s::text IS NULL OR r.workflow = %(workflow)s::text)
   AND (%(before_finished)s::timestamptz IS NULL
        OR (t.finished_at, t.id) < (%(before_finished)s::timestamptz, %(before_id)s::uuid))
 ORDER BY t.finished_at DESC, t.id DESC
 LIMIT %(limit)s;

-- name: count_dead
-- How many dead tasks the filters of list_dead match (the dry run of a bulk requeue).
SELECT count(*) AS n
  FROM task_runs t
  JOIN workflow_runs r ON r.id = t.run_id
 WHERE t.state = 'DEAD'
   AND (%(reason)s::text IS NULL OR t.failure_reason = %(reason)s::text)
   AND (%(handler)s::text IS NULL OR t.handler = %(handler)s::text)
   AND (%(workflow)s::text IS NULL OR r.workflow = %(workflow)s::text);

-- name: dead_ids_matching
-- The ids a bulk requeue takes (a bounded batch), newest first like the list.
SELECT t.id
  FROM task_runs t
  JOIN workflow_runs r ON r.id = t.run_id
 WHERE t.state = 'DEAD'
   AND (%(reason)s::text IS NULL OR t.failure_reason = %(reason)s::text)
   AND (%(handler)s::text IS NULL OR t.handler = %(handler)s::text)
   AND (%(workflow)s::text IS NULL OR r.workflow = %(workflow)s::text)
 ORDER BY t.finished_at DESC, t.id DESC
 LIMIT %(limit)s;

-- name: task_context
-- What a task was given: its run's input and the results of its upstream tasks (a map's
-- item: its map's upstream tasks but the one it maps over, as claim gives them; a map
-- likewise: that list is its items, which the items endpoint pages, and 10,000 of them are
-- too many to send whole with every read of the map's detail).
SELECT r.workflow, r.state AS run_state, r.input,
       (SELECT coalesce(jsonb_object_agg(u.name, u.result), '{}'::jsonb)
          FROM task_edges e JOIN task_runs u ON u.id = e.upstream_id
          LEFT JOIN task_runs m ON m.id = t.map_id
         WHERE e.downstream_id = coalesce(t.map_id, t.id)
           AND u.name IS DISTINCT FROM coalesce(m.for_each, t.for_each)) AS upstream
  FROM task_runs t
  JOIN workflow_runs r ON r.id = t.run_id
 WHERE t.id = %(id)s;

-- name: get_audit
-- Every operator action on the task, oldest first, in one shape: its requeues (requeue_audit)
-- and its cancels, retries-now and burials (task_audit).
SELECT requested_by, reason, previous_reason, attempt, requested_at, 'requeue' AS action,
       'DEAD' AS previous_state, 'PENDING' AS new_state
  FROM requeue_audit
 WHERE task_run_id = %(id)s
UNION ALL
SELECT requested_by, reason, NULL, attempt, requested_at, action, previous_state, new_state
  FROM task_audit
 WHERE task_run_id = %(id)s
 ORDER BY requested_at;

-- ------------------------------------------------------------------ publisher

-- name: lock_outbox
-- Pending dispatches, highest priority first, then oldest (outbox_pending_priority_idx): a
-- priority-9 row never waits behind a backlog of priority-0 rows. SKIP LOCKED lets several
-- publishers divide them. Rows of the queues in %(skip)s (ones the broker refused lately)
-- wait, so they cannot hold up others.
SELECT id, task_run_id, fencing_token, queue, priority
  FROM outbox
 WHERE published_at IS NULL AND (queue IS NULL OR queue <> ALL(%(skip)s::text[]))
 ORDER BY priority DESC, id
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED;

-- name: lock_outbox_above
-- While a sweep waits for its confirms, a NOTIFY wakes it: pending rows of a higher priority
-- than the sweep's lowest join it (the priority lane: a priority-9 row does not wait for a
-- sweep of priority-0 rows in flight). The sweep's own rows are left out by id (a transaction's
-- own locks do not make SKIP LOCKED skip them); %(skip)s as for lock_outbox.
SELECT id, task_run_id, fencing_token, queue, priority
  FROM outbox
 WHERE published_at IS NULL AND priority > %(above)s
   AND id <> ALL(%(taken)s::bigint[])
   AND (queue IS NULL OR queue <> ALL(%(skip)s::text[]))
 ORDER BY priority DESC, id
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED;

-- name: stamp_outbox
-- Only rows the broker confirmed; the publisher never writes task state. Rows that joined the
-- sweep in flight (%(joined)s, lock_outbox_above) were published after every row it locked
-- first, and after they were created: they take the statement's time, later than the sweep's
-- now() (redispatch_lost reads "published after" from these stamps).
UPDATE outbox
   SET published_at = CASE WHEN id = ANY(%(joined)s::bigint[]) THEN statement_timestamp()
                           ELSE now() END
 -- (… IS TRUE): the primary key is the only way in. Matched to the index of unpublished rows,
 -- a generic plan made while the statistics said they were rare (a quiet tree's outbox) read
 -- them all for each batch (docs/performance.md "The publisher's stamp on a published outbox")
 WHERE id = ANY(%(ids)s::bigint[]) AND (published_at IS NULL) IS TRUE;

-- ------------------------------------------------------------------ process registry

-- name: register_process
INSERT INTO processes (id, host, pid, role, queue)
VALUES (%(id)s, %(host)s, %(pid)s, %(role)s, %(queue)s)
ON CONFLICT (id) DO UPDATE SET last_seen_at = now();

-- name: deregister_process
DELETE FROM processes WHERE id = %(id)s;

-- name: forget_silent_processes
-- Registrations not refreshed for a long time belong to processes that died uncleanly.
DELETE FROM processes WHERE last_seen_at < now() - make_interval(secs => %(age_s)s);

-- name: list_processes
SELECT id, host, pid, role, started_at, last_seen_at,
       extract(epoch FROM now() - last_seen_at) AS silent_s, queue
  FROM processes
 ORDER BY host, role, pid;

-- ------------------------------------------------------------------ operations

-- name: ping
SELECT 1 AS ok;

-- name: task_state_counts
-- Task runs by state, exact up to %(cap)s each, else PostgreSQL's estimate with estimated true
-- (migration 0024's flowforge_state_counts): SUCCEEDED and CANCELLED — no index of unsettled
-- rows holds them — are estimated whenever the table has more than %(cap)s rows. A state the
-- statistics already put above twice the cap (big) is not counted at all: the count would stop
-- at the cap, and reading cap + 1 rows of each such state was most of these counts' time.
WITH guessed AS (
    SELECT g.state, flowforge_estimate('task_runs', 'state', g.state) AS guess
      FROM unnest(ARRAY['PENDING', 'READY', 'RUNNING', 'SUCCEEDED', 'FAILED', 'RETRYING',
                    'DEAD', 'CANCELLED']) AS g(state)
), big AS (
    SELECT g.state, g.guess FROM guessed g
     WHERE g.guess > 2 * %(cap)s
       AND (SELECT c.reltuples FROM pg_class c WHERE c.oid = 'task_runs'::regclass) > %(cap)s
)
SELECT b.state, b.guess AS n, true AS estimated FROM big b
UNION ALL
SELECT c.state, c.n, c.estimated
  FROM flowforge_state_counts(
       'task_runs', ARRAY(SELECT g.state FROM guessed g WHERE g.state NOT IN (SELECT state FROM big)),
       ARRAY['SUCCEEDED', 'CANCELLED'], %(cap)s) AS c;

-- name: run_state_counts
-- Runs by state, as task_state_counts (workflow_runs_state_created_idx holds every state: each
-- is counted up to the cap, unless big).
WITH guessed AS (
    SELECT g.state, flowforge_estimate('workflow_runs', 'state', g.state) AS guess
      FROM unnest(ARRAY['SCHEDULED', 'PENDING', 'RUNNING', 'SUCCEEDED', 'FAILED',
                    'CANCELLED']) AS g(state)
), big AS (
    SELECT g.state, g.guess FROM guessed g
     WHERE g.guess > 2 * %(cap)s
       AND (SELECT c.reltuples FROM pg_class c WHERE c.oid = 'workflow_runs'::regclass) > %(cap)s
)
SELECT b.state, b.guess AS n, true AS estimated FROM big b
UNION ALL
SELECT c.state, c.n, c.estimated
  FROM flowforge_state_counts(
       'workflow_runs', ARRAY(SELECT g.state FROM guessed g WHERE g.state NOT IN (SELECT state FROM big)),
       ARRAY[]::text[], %(cap)s) AS c;

-- name: finished_per_minute
-- Task runs that reached a final state, per minute of the last hour (oldest first, every
-- minute present). Reads the finished_at index: only the last hour's rows are visited.
WITH minutes AS (
    SELECT generate_series(date_trunc('minute', now()) - interval '59 minutes',
                           date_trunc('minute', now()), interval '1 minute') AS minute
), finished AS (
    SELECT date_trunc('minute', finished_at) AS minute,
           count(*) FILTER (WHERE state = 'SUCCEEDED') AS succeeded,
           count(*) FILTER (WHERE state = 'DEAD') AS dead,
           count(*) FILTER (WHERE state = 'CANCELLED') AS cancelled
      FROM task_runs
     WHERE finished_at IS NOT NULL
       AND finished_at >= date_trunc('minute', now()) - interval '59 minutes'
     GROUP BY 1
)
SELECT m.minute, coalesce(f.succeeded, 0) AS succeeded, coalesce(f.dead, 0) AS dead,
       coalesce(f.cancelled, 0) AS cancelled
  FROM minutes m
  LEFT JOIN finished f ON f.minute = m.minute
 ORDER BY m.minute;

-- name: dead_by_reason
SELECT coalesce(failure_reason, 'unknown') AS reason, count(*) AS n
  FROM task_runs
 WHERE state = 'DEAD'
 GROUP BY 1
 ORDER BY n DESC, reason;

-- name: live_processes_by_host
SELECT host, role, count(*) AS n
  FROM processes
 WHERE last_seen_at > now() - make_interval(secs => %(fresh_s)s)
 GROUP BY host, role
 ORDER BY host, role;

-- name: outbox_backlog
SELECT count(*) AS pending,
       coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest_s
  FROM outbox
 WHERE published_at IS NULL;

-- name: live_process_counts
SELECT role, count(*) AS n
  FROM processes
 WHERE last_seen_at > now() - make_interval(secs => %(fresh_s)s)
 GROUP BY role;

-- name: stats_attempts
-- How many attempts task runs needed (or have used so far): counted while the table has at
-- most %(cap)s rows, else PostgreSQL's estimate from its statistics (estimated true; the most
-- common attempt counts only — a rare one is left out). One of the two branches runs.
SELECT attempt, count(*) AS n, false AS estimated
  FROM task_runs
 WHERE (SELECT reltuples FROM pg_class WHERE oid = 'task_runs'::regclass) <= %(cap)s
 GROUP BY attempt
UNION ALL
SELECT f.val::integer, round(c.reltuples * f.freq)::bigint, true
  FROM pg_class c
  JOIN pg_namespace ns ON ns.oid = c.relnamespace
  JOIN pg_stats s ON s.schemaname = ns.nspname AND s.tablename = c.relname
                 AND s.attname = 'attempt'
 CROSS JOIN LATERAL unnest(s.most_common_vals::text::text[], s.most_common_freqs) AS f(val, freq)
 WHERE c.oid = 'task_runs'::regclass AND c.reltuples > %(cap)s
 ORDER BY 1;

-- name: stats_failure_reasons
SELECT failure_reason AS reason, count(*) AS n
  FROM task_attempts
 WHERE failure_reason IS NOT NULL
 GROUP BY failure_reason
 ORDER BY n DESC;

-- name: stats_retry_backlog
SELECT count(*) AS n, min(retry_at) AS next_at, max(retry_at) AS latest_at
  FROM task_runs
 WHERE state = 'RETRYING';

-- name: stats_poison_candidates
-- Unfinished task runs that already used many attempts (threshold >= 1).
SELECT t.id, t.run_id, t.name, t.handler, t.state, t.attempt, t.failure_reason, r.workflow
  FROM task_runs t
  JOIN workflow_runs r ON r.id = t.run_id
 WHERE t.attempt >= %(threshold)s AND t.state NOT IN ('SUCCEEDED', 'CANCELLED', 'DEAD')
   AND t.attempt > 0  -- the threshold is at least 1; stated so task_runs_poison_idx applies
 ORDER BY t.attempt DESC
 LIMIT %(limit)s;

-- name: stats_dead_by_workflow
-- Dead task runs by workflow, handler and reason, counted over the newest %(cap)s of them
-- (by finished_at, through task_runs_dead_page_idx); ``newest_only`` (on every row) is that
-- cap when there are more (a store keeps them until an operator purges them), else NULL.
-- (That check reads the index a second time, up to cap + 1 entries: one read of cap + 1 rows
-- numbered by a window was slower, 43-46 against 33-35 ms, its CTE then materialized.) Each
-- counted task's run is found by key: LATERAL ... LIMIT 1 keeps that a nested loop, where
-- PostgreSQL would plan a join of thousands of tasks as a hash over workflow_runs read whole
-- (docs/performance.md "Stored scale on a quiet machine, and dead tasks in the store").
WITH newest AS (
    SELECT t.run_id, t.handler, t.failure_reason
      FROM task_runs t
     WHERE t.state = 'DEAD'
     ORDER BY t.finished_at DESC, t.id DESC
     LIMIT %(cap)s
)
SELECT r.workflow, d.handler, d.failure_reason AS reason, count(*) AS n,
       CASE WHEN (SELECT count(*) FROM (SELECT FROM task_runs WHERE state = 'DEAD'
                                         LIMIT %(cap)s + 1) AS x) > %(cap)s
            THEN %(cap)s END AS newest_only
  FROM newest d
 CROSS JOIN LATERAL (SELECT w.workflow FROM workflow_runs w WHERE w.id = d.run_id LIMIT 1) AS r
 GROUP BY r.workflow, d.handler, d.failure_reason
 ORDER BY n DESC;

-- ------------------------------------------------------------------ lost dispatches

-- name: redispatch_lost
-- A READY task whose message was confirmed long ago, while dispatches published after it have
-- already been claimed (the FIFO queue moved past it), was lost by the broker — e.g. a node
-- killed right after confirming, or a queue deleted by hand. Only dispatches of its own queue
-- count: another queue moving on says nothing about this one (a queue with no consumer). Nor
-- does another priority band of its queue (migration 0019: a band is a quorum queue of its
-- own, and a priority-0 message waiting behind a backlog while priority-9 ones overtake it is
-- not lost); within its band, a later dispatch counts when it was published after this one:
-- in a later sweep, or in the same sweep behind it (a sweep publishes priority first, then
-- id), or not at all (claimed by a finishing worker straight from its finish). It gets a new
-- dispatch generation
-- (token + 1) with its own outbox row; should the old message still turn up, it is stale and
-- claims nothing. Only tasks of a queue a registered worker consumes are judged (or of no
-- queue, migration 0014): a queue nobody consumes has moved past nothing, and its backlog —
-- a million READY tasks waiting for a pool not started — would otherwise be compared, task by
-- task, with every claimed dispatch. A message lost on such a queue is judged once a worker of
-- it registers (docs/failure-model.md, 17). The candidates are read first, through
-- task_runs_ready_queue_idx (migration 0024; one branch per kind of queue, each an index range:
-- a backlog on a queue nobody consumes is not read), MATERIALIZED (with none, the claimed
-- dispatches are never read).
-- Publication order is the key (coalesce(published_at, 'infinity'), -priority, id): a
-- candidate was moved past when the latest claimed dispatch of its queue and band has a
-- greater key. That latest dispatch is found once per queue and band (latest, from the newest
-- publication back, through outbox_published_idx, until the first claimed one; '' stands for
-- NULL: no queue may be named '') and every candidate is compared with it: linear in the
-- candidates. Searching, for each candidate, for any claimed dispatch after it read, for a
-- backlog that was not lost (nothing claimed after any of it), every dispatch behind each
-- candidate: quadratic in the backlog (docs/performance.md "redispatch_lost, linear").
-- Its plan must not depend on the statistics (it is planned at each run, on whatever the last
-- ANALYZE saw: a backlog analyzed before it was published or claimed made every join a rescan,
-- docs/performance.md "redispatch_lost on stale statistics"): each candidate's dispatch is
-- looked up by key (a LATERAL with LIMIT, which the planner cannot turn into a join read from
-- the outbox side; its publication `(…) IS TRUE`, so outbox_published_idx cannot serve the
-- lookup and read every publication before the age for each candidate), a dispatch is tested claimed by a sub-select per outbox row read (not a
-- join, which could be driven from task_attempts, read whole), and the lost tasks are locked
-- and renewed by key, `= ANY(ARRAY(...))` with the state `(…) IS TRUE` (architecture.md).
WITH candidates AS MATERIALIZED (
    SELECT t.id, coalesce(o.queue, '') AS queue, o.priority > 0 AS b1, o.priority >= 5 AS b5,
           o.priority, o.published_at, o.id AS outbox_id
      FROM (SELECT r.id, r.fencing_token FROM task_runs r  -- two branches: each an index range
             WHERE r.state = 'READY' AND r.ready_at < now() - make_interval(secs => %(age_s)s)
               AND r.queue = ANY (ARRAY(SELECT p.queue FROM processes p WHERE p.role = 'worker'))
            UNION ALL
            SELECT r.id, r.fencing_token FROM task_runs r
             WHERE r.state = 'READY' AND r.ready_at < now() - make_interval(secs => %(age_s)s)
               AND r.queue IS NULL) AS t
     CROSS JOIN LATERAL (  -- LIMIT: a lookup by key per candidate, never a join turned around
           SELECT o.queue, o.priority, o.published_at, o.id FROM outbox o
            WHERE o.task_run_id = t.id AND o.fencing_token = t.fencing_token
              AND (o.published_at < now() - make_interval(secs => %(age_s)s)) IS TRUE
            LIMIT 1) AS o
), latest AS MATERIALIZED (  -- once per queue and band, not once per candidate
    SELECT g.queue, g.b1, g.b5, l.pub, l.priority, l.id
      FROM (SELECT DISTINCT queue, b1, b5 FROM candidates) AS g
     CROSS JOIN LATERAL (
           SELECT * FROM (
               (SELECT 'infinity'::timestamptz AS pub, later.priority, later.id
                  FROM outbox later
                 WHERE later.published_at IS NULL AND coalesce(later.queue, '') = g.queue
                   AND (later.priority > 0) = g.b1 AND (later.priority >= 5) = g.b5
                   AND (SELECT true FROM task_attempts a  -- claimed: an attempt holds its token + 1
                         WHERE a.task_run_id = later.task_run_id
                           AND a.fencing_token = later.fencing_token + 1 LIMIT 1)
                 ORDER BY later.priority, later.id DESC
                 LIMIT 1)
               UNION ALL
               (SELECT later.published_at, later.priority, later.id
                  FROM outbox later
                 WHERE later.published_at IS NOT NULL AND coalesce(later.queue, '') = g.queue
                   AND (later.priority > 0) = g.b1 AND (later.priority >= 5) = g.b5
                   AND (SELECT true FROM task_attempts a
                         WHERE a.task_run_id = later.task_run_id
                           AND a.fencing_token = later.fencing_token + 1 LIMIT 1)
                 ORDER BY later.published_at DESC, later.priority, later.id DESC
                 LIMIT 1)
           ) AS claimed
            ORDER BY pub DESC, priority, id DESC
            LIMIT 1
           ) AS l
), judged AS (
    SELECT c.id
      FROM candidates c
      JOIN latest l ON l.queue = c.queue AND l.b1 = c.b1 AND l.b5 = c.b5
     WHERE (l.pub, -l.priority, l.id) > (c.published_at, -c.priority, c.outbox_id)
), lost AS (
    SELECT t.id
      FROM task_runs t
     WHERE t.id = ANY (ARRAY(SELECT id FROM judged)) AND (t.state = 'READY') IS TRUE
     ORDER BY t.ready_at
     LIMIT %(limit)s
       FOR UPDATE OF t SKIP LOCKED
), renewed AS (
    UPDATE task_runs t
       SET fencing_token = t.fencing_token + 1, ready_at = now(), updated_at = now()
     WHERE t.id = ANY (ARRAY(SELECT id FROM lost)) AND (t.state = 'READY') IS TRUE
    RETURNING t.id, t.fencing_token, t.queue, t.priority
), queued AS (
    INSERT INTO outbox (task_run_id, fencing_token, queue, priority)
    SELECT id, fencing_token, queue, priority FROM renewed
    ON CONFLICT (task_run_id, fencing_token) DO NOTHING
    RETURNING id
)
SELECT (SELECT count(*) FROM queued) AS queued, pg_notify('flowforge_outbox', '')::text AS notified
 WHERE EXISTS (SELECT 1 FROM queued);

-- ------------------------------------------------------------------ operator purge of dead tasks

-- name: purgeable_dead_runs
-- Runs `flowforge purge --dead` may delete: with a DEAD task that died before the cutoff, and
-- nothing else unsettled — every other task SUCCEEDED, CANCELLED or DEAD before the cutoff too.
-- (An old DEAD task whose run still has work that can change is kept: deleting it alone would
-- let the run read SUCCEEDED and revive its dependents without their upstream.) In run id
-- order, bounded by limit (NULL: all); only restricts them to the given ids (NULL: any).
SELECT r.id
  FROM workflow_runs r
 WHERE r.id IN (SELECT d.run_id FROM task_runs d
                 WHERE d.state = 'DEAD'
                   AND d.finished_at < now() - make_interval(secs => %(age_s)s))
   AND (%(workflow)s::text IS NULL OR r.workflow = %(workflow)s::text)
   AND (%(only)s::uuid[] IS NULL OR r.id = ANY(%(only)s::uuid[]))
   AND NOT EXISTS (SELECT 1 FROM task_runs u
                    WHERE u.run_id = r.id
                      AND u.state NOT IN ('SUCCEEDED', 'CANCELLED')
                      AND NOT (u.state = 'DEAD'
                               AND u.finished_at < now() - make_interval(secs => %(age_s)s)))
 ORDER BY r.id
 LIMIT %(limit)s;

-- name: lock_run_tasks
-- Every task of the given runs, in id order: a requeue racing the purge either committed first
-- (the purge re-checks and keeps the run) or waits until the purge has committed.
SELECT id FROM task_runs WHERE run_id = ANY(%(ids)s::uuid[]) ORDER BY id FOR UPDATE;

-- name: dead_purge_preview
-- What deleting the given runs takes: runs, tasks, the DEAD tasks (up to show of them listed,
-- oldest death first) and the ordering streams it releases — the keys of on_dead: block DEAD
-- tasks among them that no DEAD blocking task outside them holds any more.
WITH doomed AS (
    SELECT id, workflow FROM workflow_runs WHERE id = ANY(%(ids)s::uuid[])
), tasks AS (
    SELECT t.*, d.workflow FROM task_runs t JOIN doomed d ON d.id = t.run_id
), dead AS (
    SELECT * FROM tasks WHERE state = 'DEAD'
), released AS (
    SELECT DISTINCT b.ordering_key
      FROM dead b
     WHERE b.on_dead = 'block' AND b.ordering_key IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM task_runs o
                        WHERE o.ordering_key = b.ordering_key AND o.state = 'DEAD'
                          AND o.on_dead = 'block' AND NOT (o.run_id = ANY(%(ids)s::uuid[])))
)
SELECT (SELECT count(*) FROM doomed) AS runs,
       (SELECT count(*) FROM tasks) AS tasks,
       (SELECT count(*) FROM dead) AS dead_tasks,
       (SELECT coalesce(array_agg(id ORDER BY id), '{}') FROM dead) AS dead_task_ids,
       (SELECT coalesce(array_agg(ordering_key ORDER BY ordering_key), '{}')
          FROM released) AS released_streams,
       (SELECT coalesce(jsonb_agg(jsonb_build_object(
                   'id', s.id, 'run_id', s.run_id, 'workflow', s.workflow, 'name', s.name,
                   'handler', s.handler, 'failure_reason', s.failure_reason,
                   'finished_at', s.finished_at) ORDER BY s.finished_at, s.id), '[]')
          FROM (SELECT * FROM dead ORDER BY finished_at, id LIMIT %(show)s) s) AS shown;

-- name: delete_purged_runs
-- Deletes the runs (tasks, attempts, edges, outbox rows and requeue audit go by ON DELETE
-- CASCADE; idempotency keys are not tied to them and stay), writes the audit row in the same
-- transaction, and wakes the scheduler: a released stream's next task can now be promoted.
WITH deleted AS (
    DELETE FROM workflow_runs WHERE id = ANY(%(ids)s::uuid[]) RETURNING id
), audited AS (
    INSERT INTO purge_audit (requested_by, older_than_s, workflow, runs, tasks, dead_task_ids,
                             released_streams)
    SELECT %(by)s::text, %(age_s)s::float8, %(workflow)s::text, count(*), %(tasks)s::int,
           %(dead_task_ids)s::uuid[], %(released_streams)s::text[]
      FROM deleted
    HAVING count(*) > 0
)
SELECT count(*) AS runs, pg_notify('flowforge_scheduler', '')::text AS notified FROM deleted;

-- name: count_old_dead
-- DEAD tasks that died before the cutoff (of one workflow, or of all): after a purge, those
-- that remain are kept because their run still has work that can change.
SELECT count(*) AS n
  FROM task_runs t
  JOIN workflow_runs r ON r.id = t.run_id
 WHERE t.state = 'DEAD' AND t.finished_at < now() - make_interval(secs => %(age_s)s)
   AND (%(workflow)s::text IS NULL OR r.workflow = %(workflow)s::text);

-- name: notify_cancel
-- Tells the workers that LISTEN (roles/lease.py CancelWatch) which runs were asked to stop;
-- delivered at the commit of the request, only if it commits.
SELECT pg_notify('flowforge_cancel', run_id::text) FROM unnest(%(run_ids)s::uuid[]) AS run_id;

-- ------------------------------------------------------------------ schedules (SPEC 7.2)
-- Fire times are decided on the database clock: every statement that compares with "now"
-- uses now(), and the pass computes the next fire times from the now() it read in its own
-- transaction (flowforge/store/schedules.py, flowforge/domain/schedule.py).

-- name: lock_synced_schedules
-- The rows a scheduler's sync may change: its workflows' schedules and any row of a name it
-- defines, locked in name order (the order every writer of several schedules uses).
SELECT name, workflow, spec, next_fire_at, retired_at, now() AS now
  FROM schedules
 WHERE workflow = ANY(%(workflows)s::text[]) OR name = ANY(%(names)s::text[])
 ORDER BY name
   FOR UPDATE;

-- name: upsert_schedules
-- New schedules, and changed or returning ones with their recomputed next fire time.
INSERT INTO schedules (name, workflow, spec, next_fire_at)
SELECT * FROM unnest(%(names)s::text[], %(workflows)s::text[], %(specs)s::jsonb[],
                     %(next)s::timestamptz[])
ON CONFLICT (name) DO UPDATE
   SET workflow = EXCLUDED.workflow, spec = EXCLUDED.spec, next_fire_at = EXCLUDED.next_fire_at,
       retired_at = NULL, updated_at = now()
 WHERE schedules.spec IS DISTINCT FROM EXCLUDED.spec
    OR schedules.workflow IS DISTINCT FROM EXCLUDED.workflow
    OR schedules.retired_at IS NOT NULL;

-- name: retire_schedules
-- A schedule of these workflows that the files no longer define: kept (its history), never fired.
UPDATE schedules
   SET retired_at = now(), updated_at = now()
 WHERE workflow = ANY(%(workflows)s::text[]) AND NOT (name = ANY(%(names)s::text[]))
   AND retired_at IS NULL
RETURNING name;

-- name: lock_due_schedules
-- Due schedules of the caller's workflows, earliest first; a schedule another scheduler holds is
-- skipped (it is being fired), and one it fired meanwhile no longer matches when re-checked.
SELECT s.name, s.workflow, s.spec, s.next_fire_at, s.last_run_id, now() AS now,
       coalesce((SELECT r.finished_at IS NULL FROM workflow_runs r WHERE r.id = s.last_run_id),
                false) AS previous_unfinished
  FROM schedules s
 WHERE s.next_fire_at <= now() AND NOT s.paused AND s.retired_at IS NULL
   AND s.workflow = ANY(%(workflows)s::text[])
 ORDER BY s.next_fire_at
 LIMIT %(limit)s
   FOR UPDATE OF s SKIP LOCKED;

-- name: insert_fires
-- The decisions; a (schedule, fire time) decided already is not decided again (the unique key
-- answers for it), and only those inserted are returned: their runs are the ones to create.
INSERT INTO schedule_fires (schedule, fire_time, last_fire_time, manual, outcome, reason, run_id)
SELECT f.schedule, f.fire_time, f.last_fire_time, false, f.outcome, f.reason, f.run_id
  FROM unnest(%(schedules)s::text[], %(fire_times)s::timestamptz[],
              %(last_fire_times)s::timestamptz[], %(outcomes)s::text[], %(reasons)s::text[],
              %(run_ids)s::uuid[])
       AS f(schedule, fire_time, last_fire_time, outcome, reason, run_id)
ON CONFLICT DO NOTHING
RETURNING schedule, fire_time, run_id;

-- name: insert_manual_fire
-- A fire by hand: at the database's clock_timestamp(), in the manual key space.
INSERT INTO schedule_fires (schedule, fire_time, manual, outcome, run_id)
VALUES (%(schedule)s, clock_timestamp(), true, 'created', %(run_id)s)
RETURNING fire_time;

-- name: stamp_schedule_runs
-- The schedule and fire time on the runs just created in this transaction.
UPDATE workflow_runs r
   SET schedule = d.schedule, fire_time = d.fire_time
  FROM unnest(%(ids)s::uuid[], %(schedules)s::text[], %(fire_times)s::timestamptz[])
       AS d(id, schedule, fire_time)
 WHERE r.id = d.id;

-- name: advance_schedules
-- After a pass's decisions: the next fire time, the last one decided, the last run created.
UPDATE schedules s
   SET next_fire_at = d.next_fire_at, last_fire_at = coalesce(d.last_fire_at, s.last_fire_at),
       last_run_id = coalesce(d.run_id, s.last_run_id), updated_at = now()
  FROM unnest(%(names)s::text[], %(next)s::timestamptz[], %(last)s::timestamptz[],
              %(run_ids)s::uuid[]) AS d(name, next_fire_at, last_fire_at, run_id)
 WHERE s.name = d.name;

-- name: database_now
SELECT now() AS now;

-- name: lock_schedule
SELECT name, workflow, spec, paused, retired_at, next_fire_at, now() AS now
  FROM schedules
 WHERE name = %(name)s
   FOR UPDATE;

-- name: pause_schedule
UPDATE schedules
   SET paused = true, paused_at = now(), updated_at = now()
 WHERE name = %(name)s AND NOT paused
RETURNING name;

-- name: resume_schedule
-- Fire times that passed while paused are recorded skipped (reason paused) by the caller.
UPDATE schedules
   SET paused = false, paused_at = NULL, next_fire_at = %(next)s, updated_at = now()
 WHERE name = %(name)s AND paused
RETURNING name;

-- name: note_manual_run
UPDATE schedules SET last_run_id = %(run_id)s, updated_at = now() WHERE name = %(name)s;

-- name: list_schedules
-- Every schedule (or one), with what its last run did and its last decision; by name, after
-- the name ``after`` (NULL: from the first), at most ``limit`` (NULL: all).
SELECT s.name, s.workflow, s.spec, s.paused, s.paused_at, s.retired_at, s.next_fire_at,
       s.last_fire_at, s.last_run_id, s.created_at, r.state AS last_run_state,
       f.fire_time AS last_decision_fire_time, f.outcome AS last_outcome,
       f.reason AS last_reason, f.manual AS last_manual, f.decided_at AS last_decided_at
  FROM schedules s
  LEFT JOIN workflow_runs r ON r.id = s.last_run_id
  LEFT JOIN LATERAL (SELECT fire_time, outcome, reason, manual, decided_at
                       FROM schedule_fires
                      WHERE schedule = s.name
                      ORDER BY id DESC
                      LIMIT 1) f ON true
 WHERE (%(name)s::text IS NULL OR s.name = %(name)s::text)
   AND (%(after)s::text IS NULL OR s.name > %(after)s::text)
 ORDER BY s.name
 LIMIT %(limit)s;

-- name: schedule_fire_history
-- A schedule's latest decisions, newest first.
SELECT schedule, fire_time, last_fire_time, manual, outcome, reason, run_id, decided_at
  FROM schedule_fires
 WHERE schedule = %(name)s
 ORDER BY id DESC
 LIMIT %(limit)s;

-- name: purge_schedule_fires
-- Decisions older than the retention, in a bounded batch (the schedule row keeps the last).
WITH doomed AS (
    SELECT id FROM schedule_fires
     WHERE decided_at < now() - make_interval(secs => %(age_s)s)
     ORDER BY decided_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
DELETE FROM schedule_fires f USING doomed WHERE f.id = doomed.id;

-- ------------------------------------------------------------------ maps (SPEC 7.3): passes, reads, requeue

-- name: lock_maps_to_expand
-- Map tasks whose dependencies are met, with what their expansion needs: the upstream's result
-- (source), the run input, the map's stored definition (its key templates) and the workflow's
-- max_items. Locked until the expansion (or burial) commits: SKIP LOCKED and expand_map's
-- state test divide maps among schedulers, so each map is expanded by exactly one of them.
SELECT t.id, t.run_id, t.name, t.for_each, r.input, u.result AS source,
       d.definition -> 'max_items' AS max_items,
       (SELECT x FROM jsonb_array_elements(d.definition -> 'tasks') AS x
         WHERE x ->> 'name' = t.name) AS definition
  FROM task_runs t
  JOIN workflow_runs r ON r.id = t.run_id
  JOIN workflow_definitions d ON d.name = r.workflow AND d.digest = r.workflow_digest
  LEFT JOIN task_runs u ON u.run_id = t.run_id AND u.name = t.for_each
 WHERE t.state = 'PENDING' AND t.pending_deps = 0 AND t.for_each IS NOT NULL
 ORDER BY t.seq
 LIMIT %(limit)s
   -- NO KEY: the items' foreign key to the map (KEY SHARE) must not make the map look busy
   FOR NO KEY UPDATE OF t SKIP LOCKED;

-- name: expand_map
-- PENDING → RUNNING for the map, and one PENDING item row per element of its upstream's list
-- result, in the same statement: a crash before the commit leaves neither, a repeat finds the
-- map RUNNING (and the unique (map_id, item_index) would refuse a second item anyway). Items
-- past max_parallel wait behind a closed slot (pending_deps 1) that open_item_slots opens;
-- promote_ready makes the others READY, lowest item first under its batch limit (the outbox
-- rows of one statement carry no order among themselves). An item with a concurrency or rate
-- key (rendered per item, with the map's limits) is not ready_by_itself: admit_gated admits
-- it, as any limited task — and, the map's max_parallel too (it counts the map's items READY
-- or RUNNING), so a keyed item is created with no closed slot. An empty list leaves the map
-- RUNNING with no items: settle_maps completes it in the same pass.
WITH map AS (
    UPDATE task_runs t
       SET state = 'RUNNING', started_at = coalesce(t.started_at, now()), updated_at = now()
     WHERE t.id = %(id)s AND t.state = 'PENDING' AND t.pending_deps = 0
       AND t.for_each IS NOT NULL
    RETURNING t.*
), source AS (
    SELECT e.item, (e.n - 1)::int AS idx
      FROM map m
      JOIN task_runs u ON u.run_id = m.run_id AND u.name = m.for_each
     CROSS JOIN LATERAL jsonb_array_elements(u.result) WITH ORDINALITY AS e(item, n)
), keys AS (
    SELECT (k.n - 1)::int AS idx, k.idem, k.okey, k.ckey, k.rkey, k.bkey
      FROM unnest(%(idem_keys)s::text[], %(ordering_keys)s::text[],
                  %(concurrency_keys)s::text[], %(rate_keys)s::text[],
                  %(breaker_keys)s::text[]) WITH ORDINALITY
           AS k(idem, okey, ckey, rkey, bkey, n)
), items AS (
    INSERT INTO task_runs (id, run_id, name, handler, pending_deps, max_attempts, base_delay_s,
                           max_delay_s, jitter, timeout_s, idempotency_key, ordering_key,
                           on_dead, map_id, item_index, item, queue, priority,
                           breaker_failures, breaker_window_s, breaker_cooldown_s, breaker_key,
                           concurrency_key, concurrency_limit, rate_key, rate_limit, rate_per_s)
    SELECT flowforge_new_id(), m.run_id, m.name || '[' || s.idx || ']', m.handler,
           CASE WHEN s.idx >= m.max_parallel AND k.ckey IS NULL AND k.rkey IS NULL
                THEN 1 ELSE 0 END, m.max_attempts,
           m.base_delay_s, m.max_delay_s, m.jitter, m.timeout_s, k.idem, k.okey, m.on_dead,
           m.id, s.idx, s.item, m.queue, m.priority,
           m.breaker_failures, m.breaker_window_s, m.breaker_cooldown_s, k.bkey,
           k.ckey, CASE WHEN k.ckey IS NOT NULL THEN %(concurrency_limit)s::int END,
           k.rkey, CASE WHEN k.rkey IS NOT NULL THEN %(rate_limit)s::int END,
           CASE WHEN k.rkey IS NOT NULL THEN %(rate_per_s)s::float8 END
      FROM map m
     CROSS JOIN source s
      LEFT JOIN keys k ON k.idx = s.idx
     ORDER BY s.idx
    ON CONFLICT (map_id, item_index) WHERE map_id IS NOT NULL DO NOTHING
    RETURNING id
), runs_started AS (
    UPDATE workflow_runs r
       SET state = 'RUNNING', started_at = coalesce(r.started_at, now()), updated_at = now()
     WHERE r.id = ANY(ARRAY(SELECT run_id FROM map)) AND (r.state = 'PENDING') IS TRUE
)
SELECT (SELECT count(*) FROM map) AS expanded, (SELECT count(*) FROM items) AS items;

-- name: bury_map
-- A map whose upstream result cannot be expanded (not a list, too many items, a key template
-- an item cannot fill) is DEAD at once; propagate then cancels its dependents (and, fail-fast,
-- the run).
UPDATE task_runs
   SET state = 'DEAD', failure_reason = %(reason)s, last_error = %(error)s,
       finished_at = now(), propagated = false, updated_at = now()
 WHERE id = %(id)s AND state = 'PENDING' AND pending_deps = 0 AND for_each IS NOT NULL
RETURNING id;

-- name: open_item_slots
-- RUNNING maps with a max_parallel and items waiting for a slot: as many of the lowest-index
-- waiting items as the map has free slots (max_parallel minus its items in play) get their slot
-- (pending_deps 0) for promote_ready. The map row is locked, so two schedulers never both hand
-- out the same free slot.
WITH maps AS (
    SELECT m.id, m.max_parallel
      FROM task_runs m
     WHERE m.state = 'RUNNING' AND m.for_each IS NOT NULL AND m.max_parallel IS NOT NULL
       AND EXISTS (SELECT 1 FROM task_runs g
                    WHERE g.map_id = m.id AND g.pending_deps > 0 AND g.state = 'PENDING')
     ORDER BY m.seq
     LIMIT %(limit)s
       FOR UPDATE OF m SKIP LOCKED
), free AS (
    SELECT m.id,
           greatest(m.max_parallel - (SELECT count(*) FROM task_runs a
                                       WHERE a.map_id = m.id AND a.pending_deps = 0
                                         AND a.state NOT IN ('SUCCEEDED', 'DEAD', 'CANCELLED')),
                    0) AS n
      FROM maps m
), opened AS (
    UPDATE task_runs t
       SET pending_deps = 0, updated_at = now()
     -- by id, no row source joined (see dispatch)
     WHERE t.id = ANY(ARRAY(SELECT g.id
                              FROM free f
                             CROSS JOIN LATERAL (SELECT g.id FROM task_runs g
                                                  WHERE g.map_id = f.id AND g.pending_deps > 0
                                                    AND g.state = 'PENDING'
                                                  ORDER BY g.item_index
                                                  LIMIT f.n) g))
       AND (t.state = 'PENDING' AND t.pending_deps > 0) IS TRUE
    RETURNING t.id
)
SELECT count(*) AS n FROM opened;

-- name: settle_maps
-- RUNNING maps none of whose items is unfinished take their state from them: every item
-- SUCCEEDED → SUCCEEDED with the items' results as a list in item order, releasing dependents
-- as a finish does; an item DEAD → DEAD (item_failed); else an item CANCELLED → CANCELLED
-- (with its cause). propagate then applies the consequences and derives the run.
WITH due AS (
    SELECT m.id
      FROM task_runs m
     WHERE m.state = 'RUNNING' AND m.for_each IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM task_runs a
                        WHERE a.map_id = m.id AND a.pending_deps = 0
                          AND a.state NOT IN ('SUCCEEDED', 'DEAD', 'CANCELLED'))
       AND NOT EXISTS (SELECT 1 FROM task_runs g
                        WHERE g.map_id = m.id AND g.pending_deps > 0 AND g.state = 'PENDING')
     ORDER BY m.seq
     LIMIT %(limit)s
       FOR UPDATE OF m SKIP LOCKED
), facts AS MATERIALIZED (
    -- each map's items read once, through their index (an aggregate per map: a LATERAL no
    -- plan turns into a join read from task_runs); as sub-selects, each test of the SET below
    -- read them all again — six reads of a 10,000-item map's items to settle it
    -- (docs/performance.md "settle_maps in one read")
    SELECT d.id, a.n_dead > 0 AS dead, a.cause, a.n_dead, a.results
      FROM due d
     CROSS JOIN LATERAL (
           SELECT count(*) FILTER (WHERE i.state = 'DEAD') AS n_dead,
                  min(i.cancel_cause) FILTER (WHERE i.state = 'CANCELLED') AS cause,
                  coalesce(jsonb_agg(i.result ORDER BY i.item_index), '[]'::jsonb) AS results
             FROM task_runs i
            WHERE i.map_id = d.id) AS a
), settled AS (
    UPDATE task_runs t
       SET state = CASE WHEN f.dead THEN 'DEAD' WHEN f.cause IS NOT NULL THEN 'CANCELLED'
                        ELSE 'SUCCEEDED' END,
           result = CASE WHEN NOT f.dead AND f.cause IS NULL THEN f.results END,
           failure_reason = CASE WHEN f.dead THEN 'item_failed'
                                 WHEN f.cause IS NOT NULL THEN 'cancelled' END,
           last_error = CASE WHEN f.dead THEN f.n_dead || ' item(s) DEAD' ELSE t.last_error END,
           cancel_cause = CASE WHEN NOT f.dead THEN f.cause END,
           finished_at = now(), propagated = false, updated_at = now()
      FROM facts f
     WHERE t.id = f.id AND t.state = 'RUNNING'
    RETURNING t.id, t.state
),
-- use: release_dependents(settled)
SELECT (SELECT count(*) FROM settled) AS settled, (SELECT count(*) FROM queued) AS queued;

-- name: map_item_counts
-- The items of the given maps, counted by state (status, API, dashboard: a map is one node).
SELECT map_id, state, count(*) AS n
  FROM task_runs
 WHERE map_id = ANY(%(ids)s::uuid[])
 GROUP BY map_id, state;

-- name: map_items_page
-- A page of a map's items in item order, after item index %(after)s (-1: from the start), in
-- state %(state)s only unless it is null (task_runs_map_item_idx walks them in order), each
-- with why it waits (an item held by its concurrency or rate key: docs/flow-control.md).
SELECT t.id, t.item_index, t.state, t.attempt, t.failure_reason, t.last_error, t.result, t.item,
       t.idempotency_key, t.started_at, t.finished_at,
-- use: waiting_on(t)
  FROM task_runs t
 WHERE t.map_id = %(id)s AND t.item_index > %(after)s
   AND (%(state)s::text IS NULL OR t.state = %(state)s::text)
 ORDER BY t.item_index
 LIMIT %(limit)s;

-- name: requeue_map_items
-- The requeue of a DEAD map requeues its DEAD items with it (the map's audit row covers them):
-- DEAD → PENDING with a fresh retry budget, waiting for a max_parallel slot if it has one (a
-- keyed item has none: admit_gated applies its map's max_parallel).
UPDATE task_runs t
   SET state = 'PENDING', budget_start = t.attempt, fencing_token = t.fencing_token + 1,
       failure_reason = NULL, retry_at = NULL, finished_at = NULL, crash_streak = 0,
       cancel_requested = false, propagated = true, updated_at = now(),
       pending_deps = CASE WHEN m.max_parallel IS NULL OR NOT t.ready_by_itself THEN 0 ELSE 1 END
  FROM task_runs m
 WHERE m.id = %(id)s AND m.for_each IS NOT NULL AND t.map_id = m.id AND t.state = 'DEAD'
RETURNING t.id;

-- name: reopen_map
-- The requeue of a DEAD item reopens its DEAD map: DEAD → PENDING, so the expansion pass takes
-- it again (its items exist: the unique (map_id, item_index) leaves them as they are) and
-- settle_maps judges it anew once its items are finished.
UPDATE task_runs m
   SET state = 'PENDING', fencing_token = m.fencing_token + 1, failure_reason = NULL,
       last_error = NULL, result = NULL, finished_at = NULL, cancel_requested = false,
       propagated = true, updated_at = now(),
       pending_deps = (SELECT count(*) FROM task_edges e JOIN task_runs u ON u.id = e.upstream_id
                        WHERE e.downstream_id = m.id AND u.state <> 'SUCCEEDED')
  FROM task_runs i
 WHERE i.id = %(id)s AND m.id = i.map_id AND m.state = 'DEAD'
RETURNING m.id;

-- ------------------------------------------------------------------ events

-- name: lock_event_key
-- Serialises a send with the waits of its name and key that start meanwhile (see
-- start_event_waits): whichever commits first, the other's next statement sees it. The
-- one-bigint form is a lock space of its own (ordering keys use two int4s).
SELECT pg_advisory_xact_lock(hashtextextended(%(name)s || chr(31) || %(key)s, 0));

-- name: deliver_event
-- Stores an event and wakes every task waiting for its name and key (before its timeout, on
-- the database clock): RUNNING → SUCCEEDED with the event's data as result, one delivery row
-- each (its primary key: a task is woken once), dependents released as a finish does. Rows
-- are locked in id order, so concurrent senders cannot deadlock; a row another transaction
-- changed meanwhile is re-checked, so a wait woken (or timed out, or cancelled) by someone
-- else is left alone. One row per woken task, or one with task_run_id NULL.
WITH stored AS (
    INSERT INTO events (name, key, data)
    VALUES (%(name)s, %(key)s, %(data)s)
    RETURNING id, data, created_at
), waiting AS (
    SELECT t.id
      FROM task_runs t
     WHERE t.state = 'RUNNING' AND t.event_name = %(name)s AND t.event_key = %(key)s
       AND t.wake_at > now()
     ORDER BY t.id
       FOR UPDATE OF t
), woke AS (
    UPDATE task_runs t
       SET state = 'SUCCEEDED', result = s.data, finished_at = now(), propagated = false,
           updated_at = now()
      FROM waiting w, stored s
     WHERE t.id = w.id AND t.state = 'RUNNING'
    RETURNING t.id, t.run_id, t.name, t.state
), delivered AS (
    INSERT INTO event_deliveries (task_run_id, event_id)
    SELECT w.id, s.id FROM woke w, stored s
),
-- use: release_dependents(woke)
SELECT s.id AS event_id, s.created_at, w.id AS task_run_id, w.run_id, w.name AS task,
       CASE WHEN w.id IS NOT NULL THEN pg_notify('flowforge_scheduler', '')::text END AS notified,
       (SELECT count(pg_notify('flowforge_outbox', '')) FROM queued) AS queued
  FROM stored s
  LEFT JOIN woke w ON true
 ORDER BY w.run_id, w.name;

-- name: lock_event_starts
-- Event waits whose dependencies are met, and the lock key of each one's name and key (what
-- lock_event_key takes), for start_event_waits in the same transaction.
SELECT t.id, hashtextextended(t.event_name || chr(31) || t.event_key, 0) AS lock_key
  FROM task_runs t
 WHERE t.state = 'PENDING' AND t.pending_deps = 0 AND t.event_name IS NOT NULL
 ORDER BY t.seq
 LIMIT %(limit)s
   FOR UPDATE OF t SKIP LOCKED;

-- name: lock_event_keys
-- The advisory locks of lock_event_key, in ascending order (no two starters deadlock).
SELECT pg_advisory_xact_lock(k)
  FROM (SELECT DISTINCT k FROM unnest(%(keys)s::int8[]) AS k ORDER BY k) AS sorted;

-- name: start_event_waits
-- The locked waits start: a wait whose event is stored already (the oldest of its name and
-- key within the retention, on the database clock) SUCCEEDS at once with that event's data,
-- one delivery row, dependents released; the others wait, RUNNING with their timeout as
-- wake_at, no lease (never reaped), no outbox row (no worker). Their runs are marked started
-- as a claim marks them.
WITH due AS (
    SELECT t.id, t.event_name, t.event_key
      FROM task_runs t
     WHERE t.id = ANY(%(ids)s::uuid[]) AND t.state = 'PENDING' AND t.pending_deps = 0
       AND t.event_name IS NOT NULL
), found AS (
    SELECT d.id, e.id AS event_id, e.data
      FROM due d
     CROSS JOIN LATERAL (
           SELECT ev.id, ev.data
             FROM events ev
            WHERE ev.name = d.event_name AND ev.key = d.event_key
              AND ev.created_at >= now() - make_interval(secs => %(retention_s)s::float8)
            ORDER BY ev.created_at, ev.id
            LIMIT 1) AS e
), started AS (
    UPDATE task_runs t
       SET state = CASE WHEN f.id IS NULL THEN 'RUNNING' ELSE 'SUCCEEDED' END,
           wake_at = CASE WHEN f.id IS NULL
                          THEN now() + make_interval(secs => t.event_timeout_s) END,
           result = CASE WHEN f.id IS NULL THEN t.result ELSE f.data END,
           finished_at = CASE WHEN f.id IS NULL THEN NULL ELSE now() END,
           propagated = (f.id IS NULL),
           started_at = coalesce(t.started_at, now()), updated_at = now()
      FROM due d
      LEFT JOIN found f ON f.id = d.id
     WHERE t.id = d.id AND t.state = 'PENDING'
    RETURNING t.id, t.run_id, t.state, f.event_id
), delivered AS (
    INSERT INTO event_deliveries (task_run_id, event_id)
    SELECT id, event_id FROM started WHERE event_id IS NOT NULL
),
-- use: release_dependents(started)
, runs_started AS (
    UPDATE workflow_runs r
       SET state = 'RUNNING', started_at = coalesce(r.started_at, now()), updated_at = now()
     WHERE r.id = ANY(ARRAY(SELECT run_id FROM started)) AND (r.state = 'PENDING') IS TRUE
)
SELECT (SELECT count(*) FROM started WHERE state = 'RUNNING') AS waiting,
       (SELECT count(*) FROM started WHERE state = 'SUCCEEDED') AS delivered,
       (SELECT count(*) FROM queued) AS queued;

-- name: expire_event_waits
-- Waits whose timeout has come (on the database clock) with no event: RUNNING → DEAD
-- event_timeout, token bumped; propagate then cancels their dependents as for any death.
WITH due AS (
    SELECT t.id
      FROM task_runs t
     WHERE t.state = 'RUNNING' AND t.wake_at <= now() AND t.event_name IS NOT NULL
     ORDER BY t.wake_at
     LIMIT %(limit)s
       FOR UPDATE OF t SKIP LOCKED
)
UPDATE task_runs t
   SET state = 'DEAD', failure_reason = 'event_timeout',
       last_error = 'no event ' || t.event_name || ' arrived for its key before the timeout',
       fencing_token = t.fencing_token + 1, finished_at = now(), propagated = false,
       updated_at = now()
 -- by id, no row source joined (see dispatch)
 WHERE t.id = ANY(ARRAY(SELECT id FROM due))
   AND (t.state = 'RUNNING' AND t.wake_at <= now()) IS TRUE
RETURNING t.id, t.run_id, t.name, t.event_name, t.event_key;

-- name: purge_events
-- Events older than events.retention, in a bounded batch (their delivery rows go with them).
WITH doomed AS (
    SELECT id FROM events
     WHERE created_at < now() - make_interval(secs => %(age_s)s::float8)
     ORDER BY created_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
DELETE FROM events e USING doomed WHERE e.id = doomed.id;

-- ------------------------------------------------------------------ sub-workflows (SPEC 7.3)

-- name: register_definitions
-- Every workflow a scheduler loaded (and, at a trigger, the child workflows its run may start)
-- is known to the database: a child run is made from its workflow's latest registered
-- definition (latest_definitions).
INSERT INTO workflow_definitions (name, digest, definition)
SELECT * FROM unnest(%(names)s::text[], %(digests)s::text[], %(definitions)s::jsonb[])
ON CONFLICT (name, digest) DO NOTHING;

-- name: register_latest_definitions
-- A scheduler's loaded set, at its start (so at every SIGHUP's reload): each becomes the latest
-- of its workflow, a version registered before too (a reload back to it), so child runs are
-- made from what the tree runs now. A trigger's registration (register_definitions) never
-- moves it: a run's own version, or an api child still on an older one, is no reload.
INSERT INTO workflow_definitions (name, digest, definition)
SELECT * FROM unnest(%(names)s::text[], %(digests)s::text[], %(definitions)s::jsonb[])
ON CONFLICT (name, digest) DO UPDATE SET registered_at = now();

-- name: lock_child_starts
-- Child-workflow tasks whose dependencies are met (PENDING) or whose retry is due (RETRYING),
-- with what starting a child needs: the run input, the parent run's nesting depth, the task's
-- stored definition (its input template), its dependencies' results and its queue (the child
-- run's tasks that name none go there: where the parent run's go), and the priority the parent
-- run was triggered with (the child run's too: NULL, its tasks keep their own). Locked until the child
-- run is inserted and the task moved on, in the same transaction: SKIP LOCKED and begin_child's
-- state test divide the tasks among schedulers, so each attempt starts one child.
SELECT t.id, t.run_id, t.name, t.state, t.fencing_token, t.attempt, t.child_workflow,
       t.queue, r.priority AS run_priority, r.input, r.depth, r.workflow,
       (SELECT x FROM jsonb_array_elements(d.definition -> 'tasks') AS x
         WHERE x ->> 'name' = t.name) AS definition,
       (SELECT coalesce(jsonb_object_agg(u.name, u.result), '{}'::jsonb)
          FROM task_edges e JOIN task_runs u ON u.id = e.upstream_id
         WHERE e.downstream_id = t.id) AS upstream
  FROM task_runs t
  JOIN workflow_runs r ON r.id = t.run_id
  JOIN workflow_definitions d ON d.name = r.workflow AND d.digest = r.workflow_digest
 WHERE ((t.state = 'PENDING' AND t.pending_deps = 0)
        OR (t.state = 'RETRYING' AND t.retry_at <= now()))
   AND t.child_workflow IS NOT NULL
 ORDER BY t.seq
 LIMIT %(limit)s
   FOR UPDATE OF t SKIP LOCKED;

-- name: latest_definitions
-- The most recently registered definition of each named workflow (the version a child run is
-- made from).
SELECT DISTINCT ON (name) name, definition
  FROM workflow_definitions
 WHERE name = ANY(%(names)s::text[])
 ORDER BY name, registered_at DESC, digest;

-- name: begin_child
-- PENDING / RETRYING → RUNNING for a child task: a new attempt whose child run is
-- %(child_run_id)s (inserted next, in the same transaction), no lease (never reaped), no
-- outbox row (no worker). Its run is marked started as a claim marks it.
WITH begun AS (
    UPDATE task_runs t
       SET state = 'RUNNING', attempt = t.attempt + 1, child_run_id = %(child_run_id)s,
           retry_at = NULL, cancel_requested = false, started_at = coalesce(t.started_at, now()),
           updated_at = now()
     WHERE t.id = %(id)s AND t.state = %(state)s AND t.fencing_token = %(token)s
       AND t.child_workflow IS NOT NULL
    RETURNING t.id, t.run_id, t.attempt
), runs_started AS (
    UPDATE workflow_runs r
       SET state = 'RUNNING', started_at = coalesce(r.started_at, now()), updated_at = now()
     WHERE r.id = ANY(ARRAY(SELECT run_id FROM begun)) AND (r.state = 'PENDING') IS TRUE
)
SELECT id, attempt FROM begun;

-- name: bury_child
-- A child task whose child cannot be started (its workflow registered nowhere, its input not
-- renderable, nested too deep) is DEAD at once; propagate then cancels its dependents.
UPDATE task_runs
   SET state = 'DEAD', failure_reason = %(reason)s, last_error = %(error)s,
       fencing_token = fencing_token + 1, retry_at = NULL, finished_at = now(),
       propagated = false, updated_at = now()
 WHERE id = %(id)s AND state = %(state)s AND fencing_token = %(token)s
   AND child_workflow IS NOT NULL
RETURNING id;

-- name: settle_children
-- RUNNING child tasks whose child run has finished take its outcome: SUCCEEDED → SUCCEEDED
-- with the child's result (its leaf tasks — those nothing depends on — each to its result;
-- a map leaf is its list) and its dependents released as a finish does; FAILED → the attempt
-- FAILED child_failed (route_failed applies the retry policy: a retry starts a new child);
-- CANCELLED (by someone else: a parent's cancel cancels its task first) → FAILED
-- child_cancelled, which no retry follows. A child run that is gone (deleted by `purge --dead`
-- before its task was settled; a RUNNING task's child is committed with it, never missing
-- otherwise) counts as FAILED.
WITH due AS (
    SELECT t.id, t.child_run_id AS child_id, coalesce(c.state, 'GONE') AS child_state
      FROM task_runs t
      LEFT JOIN workflow_runs c ON c.id = t.child_run_id
     WHERE t.state = 'RUNNING' AND t.child_workflow IS NOT NULL
       AND (c.finished_at IS NOT NULL OR c.id IS NULL)
     ORDER BY t.seq
     LIMIT %(limit)s
       FOR UPDATE OF t SKIP LOCKED
), settled AS (
    UPDATE task_runs t
       SET state = CASE WHEN d.child_state = 'SUCCEEDED' THEN 'SUCCEEDED' ELSE 'FAILED' END,
           result = CASE WHEN d.child_state = 'SUCCEEDED'
                         THEN (SELECT coalesce(jsonb_object_agg(l.name, l.result), '{}'::jsonb)
                                 FROM task_runs l
                                WHERE l.run_id = d.child_id AND l.map_id IS NULL
                                  AND NOT EXISTS (SELECT 1 FROM task_edges e
                                                   WHERE e.upstream_id = l.id)) END,
           failure_reason = CASE WHEN d.child_state = 'CANCELLED' THEN 'child_cancelled'
                                 WHEN d.child_state <> 'SUCCEEDED' THEN 'child_failed' END,
           last_error = CASE WHEN d.child_state = 'SUCCEEDED' THEN t.last_error
                             WHEN d.child_state = 'GONE'
                             THEN 'child run ' || d.child_id || ' is gone (deleted)'
                             ELSE 'child run ' || d.child_id || ' ' || d.child_state END,
           finished_at = CASE WHEN d.child_state = 'SUCCEEDED' THEN now() END,
           propagated = (d.child_state <> 'SUCCEEDED'),
           updated_at = now()
      FROM due d
     WHERE t.id = d.id AND t.state = 'RUNNING' AND t.child_run_id = d.child_id
    RETURNING t.id, t.state
),
-- use: release_dependents(settled)
SELECT (SELECT count(*) FROM settled WHERE state = 'SUCCEEDED') AS succeeded,
       (SELECT count(*) FROM settled WHERE state = 'FAILED') AS failed,
       (SELECT count(*) FROM queued) AS queued;

-- name: cancel_child_runs
-- The child runs of cancelled child tasks are cancelled as an operator's cancel does (their
-- tasks were stopped first: task rows before run rows); a child that has finished (an earlier
-- attempt's, or one that ended meanwhile) is left as it ended.
UPDATE workflow_runs
   SET cancel_requested_at = coalesce(cancel_requested_at, now()), updated_at = now()
 WHERE id = ANY(%(ids)s::uuid[]) AND finished_at IS NULL
RETURNING id;

-- name: run_children
-- Every child run of a run (one per attempt of its child tasks), oldest first.
SELECT c.id AS run_id, c.workflow, c.state, c.parent_task_id AS task_run_id,
       c.parent_attempt AS attempt, t.name AS task
  FROM workflow_runs c
  LEFT JOIN task_runs t ON t.id = c.parent_task_id
 WHERE c.parent_run_id = %(id)s
 ORDER BY c.created_at, c.id;
-- ------------------------------------------------------------------ control of single tasks
-- (SPEC 7.4; flowforge/store/control.py). Each change names the state and the fencing token
-- the operator's transaction read: a task that moved meanwhile (claimed, finished, reaped,
-- promoted) matches nothing, and the action is refused with nothing changed or audited.

-- name: control_facts
SELECT id, run_id, state, fencing_token, attempt, cancel_requested, needs_worker,
       for_each IS NOT NULL AS is_map, retry_at, child_run_id
  FROM task_runs
 WHERE id = %(id)s;

-- name: end_task
-- Cancel (CANCELLED, cause operator) or bury (DEAD, reason operator) a task nothing executes:
-- not started, or a sleeping timer or an event wait. The token is bumped (a message already
-- sent for it is stale); propagate then treats it as any cancellation or death: dependents
-- cancelled (cause upstream), run_if dependents counted, fail-fast, on_dead.
UPDATE task_runs
   SET state = %(target)s, failure_reason = %(reason)s,
       cancel_cause = CASE WHEN %(target)s = 'CANCELLED' THEN 'operator' END,
       fencing_token = fencing_token + 1, retry_at = NULL, finished_at = now(),
       propagated = false, updated_at = now()
 WHERE id = %(id)s AND state = %(state)s AND fencing_token = %(token)s
RETURNING id;

-- name: request_task_stop
-- A task a worker executes is asked to stop, as a run's cancel asks (cancel_requested, heard
-- through notify_task_cancel or at the next lease renewal); a bury also marks it, so the stop
-- ends it DEAD 'operator' (finish, release_claims, routing and reaping read the mark).
UPDATE task_runs
   SET cancel_requested = true, cancel_cause = 'operator', bury_requested = %(bury)s,
       updated_at = now()
 WHERE id = %(id)s AND state = 'RUNNING' AND fencing_token = %(token)s AND NOT cancel_requested
RETURNING id;

-- name: notify_task_cancel
-- Tells the workers that LISTEN (roles/lease.py CancelWatch) which one task was asked to stop
-- ('task:' and its id: a run id alone would stop its siblings too); at the commit, if any.
SELECT pg_notify('flowforge_cancel', 'task:' || %(id)s::text);

-- name: retry_task_now
-- RETRYING → READY with its outbox row, its backoff skipped: the attempt it waited to make is
-- made now (no attempt is added or refunded). A child-workflow task (no worker executes it)
-- stays RETRYING with its retry due now: the scheduler's start_children starts its next child.
-- So does a task with a concurrency or rate key: admit_gated makes it READY when its keys have
-- room (ready_by_itself, migration 0017).
WITH promoted AS (
    UPDATE task_runs
       SET state = CASE WHEN ready_by_itself THEN 'READY' ELSE state END,
           retry_at = CASE WHEN ready_by_itself THEN NULL ELSE now() END,
           ready_at = CASE WHEN ready_by_itself THEN now() ELSE ready_at END,
           updated_at = now()
     WHERE id = %(id)s AND state = 'RETRYING' AND fencing_token = %(token)s
    RETURNING id, state, fencing_token, queue, priority
), queued AS (
    INSERT INTO outbox (task_run_id, fencing_token, queue, priority)
    SELECT id, fencing_token, queue, priority FROM promoted WHERE state = 'READY'
    ON CONFLICT (task_run_id, fencing_token) DO NOTHING
)
SELECT id, state FROM promoted;

-- name: insert_task_audit
INSERT INTO task_audit (task_run_id, run_id, action, requested_by, reason, previous_state,
                        new_state, attempt, details)
VALUES (%(id)s, %(run_id)s, %(action)s, %(by)s, %(reason)s, %(previous_state)s, %(new_state)s,
        %(attempt)s, %(details)s);

-- name: key_stream
-- The tasks of an ordering key's stream that hold it or wait on it, in stream order: those
-- promote_ready counts as not done (not SUCCEEDED or CANCELLED, and not DEAD with on_dead:
-- release). The first holds the stream; n counts them all. Reads task_runs_stream_idx.
SELECT t.id, t.run_id, r.workflow, t.name, t.state, t.failure_reason, t.on_dead,
       t.created_at, t.pending_deps, t.cancel_requested, count(*) OVER () AS n
  FROM task_runs t
  JOIN workflow_runs r ON r.id = t.run_id
 WHERE t.ordering_key = %(key)s AND t.state NOT IN ('SUCCEEDED', 'CANCELLED')
   AND NOT (t.state = 'DEAD' AND t.on_dead = 'release')
 ORDER BY t.seq
 LIMIT %(limit)s;

-- ------------------------------------------------------------------ queues (issue 20)

-- name: queue_load
-- READY task runs per queue (up to %(cap)s each, else cap + 1 and estimated: migration 0024)
-- and the live workers consuming each (seen within %(fresh_s)s seconds), every queue that has
-- either; NULL: task runs on no queue and workers that record
-- none (migration 0014). '' stands for NULL in the join: no queue may be named ''.
WITH ready AS (
    SELECT queue, n, estimated FROM flowforge_ready_by_queue(%(cap)s)
), consumers AS (
    SELECT queue, count(*) AS n
      FROM processes
     WHERE role = 'worker' AND last_seen_at > now() - make_interval(secs => %(fresh_s)s)
     GROUP BY queue
)
SELECT coalesce(r.queue, c.queue) AS queue, coalesce(r.n, 0) AS ready,
       coalesce(r.estimated, false) AS estimated, coalesce(c.n, 0) AS consumers
  FROM ready r
  FULL JOIN consumers c ON coalesce(r.queue, '') = coalesce(c.queue, '')
 ORDER BY 1 NULLS FIRST;

-- ------------------------------------------------------------------ concurrency limits (issue 20)

-- fragment: awaiting_admission(task)
-- Whether a task of {task} waits for the admission pass: a worker executes it but a gate holds
-- it back (a concurrency or rate key: not ready_by_itself), and it is PENDING with its
-- dependencies met and its ordering stream free (as promote_ready judges it), or RETRYING with
-- its backoff over — and, for a map's item, its map is not at its max_parallel (an item that
-- waits for its map takes no turn in its keys' lines: other tasks of the key go ahead).
{task}.needs_worker AND NOT {task}.ready_by_itself
AND (({task}.state = 'PENDING' AND {task}.pending_deps = 0 AND
-- use: stream_free({task})
     ) OR ({task}.state = 'RETRYING' AND {task}.retry_at <= now()))
AND
-- use: map_has_room({task})

-- fragment: map_has_room(task)
-- Whether {task}, if a map's item, may be admitted as far as its map's max_parallel goes: its
-- map is not among the RUNNING maps with as many items READY or RUNNING as their max_parallel.
-- Those maps are read once per statement (the subquery does not read {task}: an InitPlan), each
-- counted through task_runs_map_busy_idx (migration 0022), which holds only busy items.
({task}.map_id IS NULL OR {task}.map_id <> ALL(ARRAY(
    SELECT m.id FROM task_runs m
     WHERE m.state = 'RUNNING' AND m.for_each IS NOT NULL AND m.max_parallel IS NOT NULL
       AND (SELECT count(*) FROM task_runs b
             WHERE b.map_id = m.id AND b.state IN ('READY', 'RUNNING')) >= m.max_parallel)))

-- name: concurrency_keys_waiting
-- Keys with a task the admission pass could admit: PENDING with its dependencies met and its
-- ordering stream free, or RETRYING with its backoff over — and a worker to execute it. Sorted:
-- admit_gated's callers lock them in this order (two schedulers never deadlock).
SELECT DISTINCT t.concurrency_key AS key
  FROM task_runs t
 WHERE t.concurrency_key IS NOT NULL AND
-- use: awaiting_admission(t)
 ORDER BY 1
 LIMIT %(limit)s;

-- name: lock_concurrency_keys
-- (Also rate keys, in their own namespace, after the concurrency keys.)
-- One transaction-scoped advisory lock per key, in key order: two schedulers admitting for one
-- key take turns, so each counts the slots the other's admissions took (its statement snapshot
-- is taken after the lock is granted).
SELECT pg_advisory_xact_lock(%(namespace)s::int4, hashtext(k))
  FROM unnest(%(keys)s::text[]) AS k
 ORDER BY k;

-- name: lock_admission_maps
-- The RUNNING maps with a max_parallel whose items are keyed (their first item is not
-- ready_by_itself: a map's items are all keyed or none) and that have room (fewer items READY or
-- RUNNING than max_parallel; a full one admits nothing), up to %(limit)s, oldest first, each
-- locked (advisory, transaction-scoped, namespace %(namespace)s, in id order, after every key:
-- no deadlock with another admission), and returned: admit_gated admits items of these maps
-- only, so two schedulers admitting items of one map for different keys take turns and each
-- counts what the other admitted. Nothing else makes a keyed item READY. Read from the few
-- RUNNING maps (task_runs_map_running_idx), not from the waiting items: a pass over 10,000
-- waiting items pays for them once, in admit_gated.
SELECT l.id
  FROM (SELECT m.id, pg_advisory_xact_lock(%(namespace)s::int4, hashtext(m.id::text))
          FROM (SELECT p.id
                  FROM task_runs p
                 WHERE p.state = 'RUNNING' AND p.for_each IS NOT NULL
                   AND p.max_parallel IS NOT NULL
                   AND (SELECT NOT i.ready_by_itself FROM task_runs i
                         WHERE i.map_id = p.id AND i.item_index = 0)
                   AND (SELECT count(*) FROM task_runs b
                         WHERE b.map_id = p.id AND b.state IN ('READY', 'RUNNING'))
                       < p.max_parallel
                 ORDER BY p.seq
                 LIMIT %(limit)s) AS m
         ORDER BY m.id) AS l;

-- name: admit_gated
-- For each concurrency key (ckeys) and rate key (rkeys), each locked by lock_concurrency_keys: its
-- waiting tasks (as concurrency_keys_waiting finds them; a task with both kinds of key only
-- when both are locked; a map's item of a map with a max_parallel only when lock_admission_maps
-- locked its map: maps) become READY with an outbox row, oldest first (seq), as many as both
-- its keys have room for — and its map (max_parallel less the map's items READY or RUNNING):
-- - a concurrency key's room is its limit less its tasks READY or RUNNING now (a slot frees
--   when its task leaves READY/RUNNING: a finish, a reap, a defer, a cancel);
-- - a rate key's room is its limit less its tasks READY now (admitted, each will start) and
--   less the attempts of its tasks that STARTED since now() - per (task_attempts.rate_key).
--   Counting what will start as well as what started makes the bound hold for starts, however
--   late a worker claims: docs/flow-control.md "Rate limits" has the argument.
-- Tasks of one key that declare different rules: the smallest limit (and for a rate key the
-- longest per) among the waiting ones applies. Rate room is ranked among the tasks the
-- concurrency keys let through, and a map's room among those both kinds of key let through, so
-- a task held by a key takes no room of the next gate (an item waiting for its tenant's key
-- holds no max_parallel slot).
-- Only the oldest waiting tasks of each key are candidates, as many as the largest limit its
-- waiting tasks declare (no more can be admitted) and at most per_key: a key with 10,000
-- waiting map items costs a pass what its limit's worth of them cost, not a lock on each.
WITH candidates AS (
    SELECT c.id
      FROM unnest(%(ckeys)s::text[]) AS k(key)
     CROSS JOIN LATERAL (
           SELECT t.id FROM task_runs t
            WHERE t.concurrency_key = k.key AND
-- use: awaiting_admission(t)
            ORDER BY t.seq
            LIMIT least(%(per_key)s, (SELECT max(u.concurrency_limit) FROM task_runs u
                                       WHERE u.concurrency_key = k.key
                                         AND u.state IN ('PENDING', 'RETRYING')))) AS c
    UNION
    SELECT c.id
      FROM unnest(%(rkeys)s::text[]) AS k(key)
     CROSS JOIN LATERAL (
           SELECT t.id FROM task_runs t
            WHERE t.rate_key = k.key AND
-- use: awaiting_admission(t)
            ORDER BY t.seq
            LIMIT least(%(per_key)s, (SELECT max(u.rate_limit) FROM task_runs u
                                       WHERE u.rate_key = k.key
                                         AND u.state IN ('PENDING', 'RETRYING')))) AS c
), waiting AS (
    SELECT t.id, t.seq, t.concurrency_key, t.concurrency_limit, t.rate_key, t.rate_limit,
           t.rate_per_s, t.map_id
      FROM task_runs t
     -- the candidates by their ids, the conditions (… IS TRUE), no row source joined: a plan
     -- made while PENDING was rare in the statistics read every PENDING task through the
     -- state index and compared each with every candidate (architecture.md, "one release
     -- fragment"; docs/performance.md "admit_gated's waiting by id")
     WHERE t.id = ANY(ARRAY(SELECT id FROM candidates))
       AND (t.concurrency_key IS NULL OR t.concurrency_key = ANY(%(ckeys)s::text[]))
       AND (t.rate_key IS NULL OR t.rate_key = ANY(%(rkeys)s::text[]))
       AND (t.map_id IS NULL OR t.map_id = ANY(%(maps)s::uuid[])
            OR (SELECT p.max_parallel FROM task_runs p WHERE p.id = t.map_id) IS NULL) AND (
-- use: awaiting_admission(t)
       ) IS TRUE
       FOR UPDATE OF t SKIP LOCKED
), c_room AS MATERIALIZED (
    SELECT w.concurrency_key AS key,
           min(w.concurrency_limit)
           - (SELECT count(*) FROM task_runs h
               WHERE h.concurrency_key = w.concurrency_key
                 AND h.state IN ('READY', 'RUNNING')) AS room
      FROM waiting w
     WHERE w.concurrency_key IS NOT NULL
     GROUP BY w.concurrency_key
), c_ok AS (
    SELECT w.*
      FROM (SELECT w.*, row_number() OVER (PARTITION BY w.concurrency_key ORDER BY w.seq) AS rn
              FROM waiting w) w
      LEFT JOIN c_room c ON c.key = w.concurrency_key
     WHERE w.concurrency_key IS NULL OR w.rn <= c.room
), r_rule AS (
    SELECT w.rate_key AS key, min(w.rate_limit) AS lim, max(w.rate_per_s) AS per
      FROM waiting w
     WHERE w.rate_key IS NOT NULL
     GROUP BY w.rate_key
), r_room AS MATERIALIZED (
    SELECT r.key,
           r.lim
           - (SELECT count(*) FROM task_runs h WHERE h.rate_key = r.key AND h.state = 'READY')
           - (SELECT count(*) FROM task_attempts a
               WHERE a.rate_key = r.key
                 AND a.started_at > now() - make_interval(secs => r.per)) AS room
      FROM r_rule r
), r_ok AS (
    SELECT o.id, o.seq, o.map_id
      FROM (SELECT o.id, o.seq, o.map_id, o.rate_key,
                   row_number() OVER (PARTITION BY o.rate_key ORDER BY o.seq) AS rn
              FROM c_ok o) o
      LEFT JOIN r_room r ON r.key = o.rate_key
     WHERE o.rate_key IS NULL OR o.rn <= r.room
), m_room AS MATERIALIZED (
    SELECT p.id,
           p.max_parallel - (SELECT count(*) FROM task_runs b
                              WHERE b.map_id = p.id AND b.state IN ('READY', 'RUNNING')) AS room
      FROM task_runs p
     WHERE p.id = ANY(%(maps)s::uuid[])
), chosen AS (
    SELECT o.id
      FROM (SELECT o.id, o.map_id,
                   row_number() OVER (PARTITION BY o.map_id ORDER BY o.seq) AS rn
              FROM r_ok o) o
      LEFT JOIN m_room m ON m.id = o.map_id
     WHERE m.id IS NULL OR o.rn <= m.room
),
-- use: dispatch(chosen)
SELECT (SELECT count(*) FROM promoted) AS admitted, (SELECT count(*) FROM queued) AS queued;

-- name: concurrency_holds
-- A concurrency key's tasks that hold a slot (READY, RUNNING) and those that wait for one
-- (PENDING, RETRYING), holders first, each group oldest first; waiting and held count them all.
SELECT t.id, t.run_id, r.workflow, t.name, t.state, t.failure_reason, t.on_dead,
       t.created_at, t.pending_deps, t.cancel_requested, t.concurrency_limit,
       t.state IN ('READY', 'RUNNING') AS holds,
       count(*) FILTER (WHERE t.state IN ('PENDING', 'RETRYING')) OVER () AS waiting,
       count(*) FILTER (WHERE t.state IN ('READY', 'RUNNING')) OVER () AS held
  FROM task_runs t
  JOIN workflow_runs r ON r.id = t.run_id
 WHERE t.concurrency_key = %(key)s AND t.state IN ('PENDING', 'RETRYING', 'READY', 'RUNNING')
 ORDER BY t.state IN ('READY', 'RUNNING') DESC, t.seq
 LIMIT %(limit)s;

-- fragment: waiting_on(task)
-- Why a task of {task} that is not executing waits (SPEC 7.4 `waiting_on`), NULL when nothing
-- named holds it: `start_at` (its run's start time: the start gate is closed), `timer` (a
-- sleeping durable timer), `event` (an event wait), `circuit_open` or `paused` (parked at its
-- claim: its handler's breaker is open, its queue or handler paused), `concurrency`
-- (dependencies met, or its backoff over, and no free slot of its concurrency key yet),
-- `rate_limit` (the same, and its concurrency key, if any, has a free slot: its rate key's
-- window is full). A keyed map item whose keys have room but whose map is at its max_parallel
-- waits for the map: NULL, as an unkeyed item behind its closed slot.
CASE WHEN {task}.state = 'PENDING' AND {task}.start_gate THEN 'start_at'
     WHEN {task}.state = 'RUNNING' AND {task}.sleep_s IS NOT NULL THEN 'timer'
     WHEN {task}.state = 'RUNNING' AND {task}.event_name IS NOT NULL THEN 'event'
     WHEN {task}.state = 'RETRYING' AND {task}.parked_on IS NOT NULL THEN {task}.parked_on
     WHEN {task}.needs_worker AND NOT {task}.ready_by_itself
          AND (({task}.state = 'PENDING' AND {task}.pending_deps = 0)
               OR ({task}.state = 'RETRYING' AND {task}.retry_at <= now()))
     THEN CASE WHEN {task}.concurrency_key IS NOT NULL
                    AND (SELECT count(*) FROM task_runs h
                          WHERE h.concurrency_key = {task}.concurrency_key
                            AND h.state IN ('READY', 'RUNNING')) >= {task}.concurrency_limit
               THEN 'concurrency'
               -- its keys' turn comes when its map has room: NULL, as an unkeyed item's slot
               WHEN NOT
-- use: map_has_room({task})
               THEN NULL
               WHEN {task}.rate_key IS NULL THEN 'concurrency' ELSE 'rate_limit' END
END AS waiting_on

-- name: concurrency_room
-- For a trigger's keys (locked by lock_concurrency_keys): the tasks of each holding a slot
-- (READY, RUNNING), those the admission pass would admit (awaiting_admission), and the
-- smallest limit among the key's not-yet-admitted ones (NULL: none). A key with no unfinished
-- task has no row.
SELECT t.concurrency_key AS key,
       count(*) FILTER (WHERE t.state IN ('READY', 'RUNNING')) AS held,
       count(*) FILTER (WHERE
-- use: awaiting_admission(t)
       ) AS waiting,
       min(t.concurrency_limit) FILTER (WHERE t.state IN ('PENDING', 'RETRYING')) AS waiting_limit
  FROM task_runs t
 WHERE t.concurrency_key = ANY(%(keys)s::text[])
   AND t.state IN ('PENDING', 'READY', 'RUNNING', 'RETRYING')
 GROUP BY t.concurrency_key;

-- ------------------------------------------------------------------ rate limits (issue 20)

-- name: rate_keys_waiting
-- Rate keys with a task the admission pass could admit (as concurrency_keys_waiting), sorted:
-- admit_gated's callers lock them in this order, after the concurrency keys.
SELECT DISTINCT t.rate_key AS key
  FROM task_runs t
 WHERE t.rate_key IS NOT NULL AND
-- use: awaiting_admission(t)
 ORDER BY 1
 LIMIT %(limit)s;

-- name: rate_room
-- For a trigger's rate keys (locked by lock_concurrency_keys in the rate namespace), each with
-- the longest per among the trigger's tasks of it: the key's READY tasks (admitted, not
-- started), the attempts of its tasks started within the window (the longer of that per and
-- the key's waiting tasks'), those the admission pass would admit (they go first), and the
-- smallest limit among its waiting tasks (NULL: none). Every key given has a row.
SELECT k.key,
       (SELECT count(*) FROM task_runs h WHERE h.rate_key = k.key AND h.state = 'READY') AS ready,
       (SELECT count(*) FROM task_attempts a
         WHERE a.rate_key = k.key
           AND a.started_at > now() - make_interval(secs => greatest(k.per, w.per))) AS started,
       w.waiting, w.waiting_limit
  FROM unnest(%(keys)s::text[], %(pers)s::float8[]) AS k(key, per)
 CROSS JOIN LATERAL (
       SELECT count(*) AS waiting, min(t.rate_limit) AS waiting_limit, max(t.rate_per_s) AS per
         FROM task_runs t
        WHERE t.rate_key = k.key AND
-- use: awaiting_admission(t)
       ) AS w;

-- name: rate_holds
-- A rate key's tasks that use its window or wait for it: READY (admitted, not started),
-- RUNNING, and PENDING or RETRYING, READY first, each group oldest first; with the number of
-- attempts of the key started within the window (the longest per among its unfinished tasks).
SELECT t.id, t.run_id, r.workflow, t.name, t.state, t.failure_reason, t.on_dead,
       t.created_at, t.pending_deps, t.cancel_requested, t.rate_limit, t.rate_per_s,
       t.state IN ('READY', 'RUNNING') AS holds,
       count(*) FILTER (WHERE t.state IN ('PENDING', 'RETRYING')) OVER () AS waiting,
       count(*) FILTER (WHERE t.state = 'READY') OVER () AS ready,
       (SELECT count(*) FROM task_attempts a
         WHERE a.rate_key = %(key)s
           AND a.started_at > now() - make_interval(secs => (
               SELECT max(u.rate_per_s) FROM task_runs u
                WHERE u.rate_key = %(key)s
                  AND u.state IN ('PENDING', 'RETRYING', 'READY', 'RUNNING')))) AS started
  FROM task_runs t
  JOIN workflow_runs r ON r.id = t.run_id
 WHERE t.rate_key = %(key)s AND t.state IN ('PENDING', 'RETRYING', 'READY', 'RUNNING')
 ORDER BY t.state IN ('READY', 'RUNNING') DESC, t.state = 'READY' DESC, t.seq
 LIMIT %(limit)s;

-- ------------------------------------------------------------------ breakers and pauses (issue 20)

-- name: trip_breakers
-- After a finish, in its transaction: tasks of that batch that failed with a handler failure
-- (domain/breakers.py COUNTED_FAILURES; the caller passes only those). Per breaker (handler and
-- breaker key, '' for a task without one: migration 0020), the
-- breaker row is read and written under its row lock (ON CONFLICT sees the latest committed
-- version), so concurrent finishes on any tree count every failure and one opens it: closed →
-- open when these make `failures` within the window (judged by the strictest thresholds of the
-- failing tasks that declare a breaker); half-open → open when one of them is its probe (a
-- fresh cooldown). previous_state tells the transition, written in the same statement. Only a
-- failure pays for this: a success or any other finish reads no breaker.
WITH failed AS (
    SELECT t.id, t.handler, coalesce(t.breaker_key, '') AS key, t.breaker_failures,
           t.breaker_window_s, t.breaker_cooldown_s
      FROM task_runs t
     WHERE t.id = ANY(%(ids)s::uuid[])
), hits AS (
    SELECT f.handler, f.key,
           count(*) FILTER (WHERE f.breaker_failures IS NOT NULL)::int AS n,
           min(f.breaker_failures) AS lim, max(f.breaker_window_s) AS win,
           max(f.breaker_cooldown_s) AS cool,
           -- the probe among them, as the statement's snapshot has it (checked again below
           -- on the locked row)
           (SELECT x.probe_task_id FROM breakers x
             WHERE x.handler = f.handler AND x.key = f.key AND x.state = 'half_open'
               AND x.probe_task_id = ANY(array_agg(f.id))) AS probe_id
      FROM failed f
     GROUP BY f.handler, f.key
), tripped AS (
    INSERT INTO breakers AS b (handler, key, state, previous_state, failures, failure_limit,
                               window_s, cooldown_s, opened_at, probe_task_id)
    SELECT h.handler, h.key, CASE WHEN h.n >= h.lim THEN 'open' ELSE 'closed' END, 'closed',
           array_fill(now(), ARRAY[h.n]), h.lim, h.win, h.cool,
           CASE WHEN h.n >= h.lim THEN now() END, h.probe_id
      FROM hits h
     WHERE h.n > 0 OR h.probe_id IS NOT NULL
     ORDER BY h.handler, h.key  -- one lock order: two batches never deadlock on their breakers
    ON CONFLICT (handler, key) DO UPDATE
       SET state = CASE
               WHEN b.state = 'half_open' AND b.probe_task_id = EXCLUDED.probe_task_id
               THEN 'open'
               WHEN b.state = 'closed' AND EXCLUDED.failure_limit IS NOT NULL
                    AND cardinality(breaker_recent(b.failures || EXCLUDED.failures,
                                                   EXCLUDED.window_s, EXCLUDED.failure_limit))
                        >= EXCLUDED.failure_limit
               THEN 'open'
               ELSE b.state END,
           previous_state = b.state,
           failures = CASE
               WHEN EXCLUDED.failure_limit IS NULL THEN b.failures
               ELSE breaker_recent(b.failures || EXCLUDED.failures, EXCLUDED.window_s,
                                   EXCLUDED.failure_limit) END,
           failure_limit = coalesce(EXCLUDED.failure_limit, b.failure_limit),
           window_s = coalesce(EXCLUDED.window_s, b.window_s),
           cooldown_s = coalesce(EXCLUDED.cooldown_s, b.cooldown_s),
           opened_at = CASE
               WHEN b.state = 'half_open' AND b.probe_task_id = EXCLUDED.probe_task_id
               THEN now()
               WHEN b.state = 'closed' AND EXCLUDED.failure_limit IS NOT NULL
                    AND cardinality(breaker_recent(b.failures || EXCLUDED.failures,
                                                   EXCLUDED.window_s, EXCLUDED.failure_limit))
                        >= EXCLUDED.failure_limit
               THEN now()
               ELSE b.opened_at END,
           probe_task_id = CASE
               WHEN b.state = 'half_open' AND b.probe_task_id = EXCLUDED.probe_task_id
               THEN NULL ELSE b.probe_task_id END,
           updated_at = now()
    RETURNING b.handler, b.key, b.previous_state, b.state
)
INSERT INTO breaker_transitions (handler, key, from_state, to_state, cause)
SELECT handler, key, previous_state, state,
       CASE WHEN previous_state = 'half_open' THEN 'probe_failed' ELSE 'failures' END
  FROM tripped
 WHERE state <> previous_state
RETURNING handler;

-- name: settle_probes
-- A half-open breaker whose probe has answered without a failure, or can no longer answer. Its
-- task SUCCEEDED at the probing attempt: → closed (its failures forgotten; unpark_tasks, in the
-- same pass, dispatches what it held). Its task is gone, finished without a verdict
-- (cancelled, buried, a failure that does not count), reaped (its attempt used and back in
-- READY or RETRYING) or parked by a pause: → open with its cooldown already over, so
-- probe_breakers picks another probe in the same pass — a probe whose worker died does not
-- wedge the breaker half-open. (A probe's handler failure reopened it in its finish:
-- trip_breakers.) Conditional on the state, so whichever writer is first wins.
WITH probed AS (
    SELECT b.handler, b.key,
           coalesce(t.state = 'SUCCEEDED' AND t.attempt = b.probe_attempt + 1, false) AS ok,
           coalesce(t.parked_on IS NULL
                    AND ((t.state = 'RUNNING' AND t.attempt = b.probe_attempt + 1)
                         OR (t.state IN ('READY', 'RETRYING') AND t.attempt = b.probe_attempt)),
                    false) AS alive
      FROM breakers b
      LEFT JOIN task_runs t ON t.id = b.probe_task_id
     WHERE b.state = 'half_open'
       FOR UPDATE OF b SKIP LOCKED
), settled AS (
    UPDATE breakers b
       SET state = CASE WHEN p.ok THEN 'closed' ELSE 'open' END, previous_state = 'half_open',
           failures = CASE WHEN p.ok THEN '{}' ELSE b.failures END, probe_task_id = NULL,
           updated_at = now()
      FROM probed p
     WHERE b.handler = p.handler AND b.key = p.key AND NOT p.alive
    RETURNING b.handler, b.key, b.state
)
INSERT INTO breaker_transitions (handler, key, from_state, to_state, cause)
SELECT handler, key, 'half_open', state,
       CASE WHEN state = 'closed' THEN 'probe_succeeded' ELSE 'probe_lost' END
  FROM settled
RETURNING handler;

-- name: gate_work
-- What the gate pass has to do, in one round trip: a breaker not closed (settle or probe it),
-- a parked task (unpark it), a transition not logged (log it). All false on a system where
-- nothing is held: the pass then costs the scheduler this statement only.
SELECT EXISTS (SELECT 1 FROM breakers WHERE state <> 'closed') AS breakers,
       EXISTS (SELECT 1 FROM task_runs WHERE parked_on IS NOT NULL AND state = 'RETRYING')
           AS parked,
       EXISTS (SELECT 1 FROM breaker_transitions WHERE NOT logged) AS unlogged;

-- name: probe_breakers
-- open → half-open for each breaker whose cooldown is over (not one an operator holds open):
-- its oldest parked task whose queue and handler are not paused becomes its probe — unparked
-- (a retry time of now: promote_ready or the admission pass dispatches it) and marked, and the
-- breaker lets that task alone through the claim's gate. The breaker row is locked (two
-- schedulers: one takes the probe slot, the other skips it) and the task too (SKIP LOCKED). A
-- breaker with no parked task stays open until one is parked.
WITH due AS (
    SELECT b.handler, b.key
      FROM breakers b
     WHERE b.state = 'open' AND NOT b.held
       AND b.opened_at + make_interval(secs => b.cooldown_s) <= now()
     ORDER BY b.handler, b.key
     LIMIT %(limit)s
       FOR UPDATE OF b SKIP LOCKED
), chosen AS (
    SELECT d.handler, d.key, p.id, p.attempt
      FROM due d
     CROSS JOIN LATERAL (
           SELECT t.id, t.attempt
             FROM task_runs t
            WHERE t.handler = d.handler AND coalesce(t.breaker_key, '') = d.key
              AND t.parked_on IS NOT NULL AND t.state = 'RETRYING'
              AND NOT EXISTS (SELECT 1 FROM pauses q
                               WHERE (q.scope = 'handler' AND q.name = t.handler)
                                  OR (q.scope = 'queue' AND q.name = t.queue))
            ORDER BY t.seq
            LIMIT 1
              FOR UPDATE OF t SKIP LOCKED) AS p
), probing AS (
    UPDATE breakers b
       SET state = 'half_open', previous_state = 'open', probe_task_id = c.id,
           probe_attempt = c.attempt, updated_at = now()
      FROM chosen c
     WHERE b.handler = c.handler AND b.key = c.key
    RETURNING b.handler, b.key, c.id, c.attempt
), unparked AS (
    UPDATE task_runs t
       SET parked_on = NULL, retry_at = now(), updated_at = now()
      FROM probing p
     WHERE t.id = p.id
)
INSERT INTO breaker_transitions (handler, key, from_state, to_state, cause, probe_task_id,
                                 probe_attempt)
SELECT handler, key, 'open', 'half_open', 'cooldown', id, attempt FROM probing
RETURNING handler;

-- name: unpark_tasks
-- Parked tasks that nothing holds any more (no pause of their queue or handler, their
-- breaker closed) get a retry time of now, oldest first: promote_ready (or the
-- admission pass, for a task with a concurrency key) dispatches them in this same pass. No
-- attempt was used by the parking, none is used by this.
UPDATE task_runs t
   SET parked_on = NULL, retry_at = now(), updated_at = now()
 WHERE t.id IN (
       SELECT p.id
         FROM task_runs p
        WHERE p.parked_on IS NOT NULL AND p.state = 'RETRYING'
          AND flowforge_gate(p.handler, p.queue, p.breaker_key, p.id) IS NULL
        ORDER BY p.seq
        LIMIT %(limit)s
          FOR UPDATE OF p SKIP LOCKED)
RETURNING t.id;

-- name: log_transitions
-- Breaker transitions not logged yet, marked logged by the scheduler that will log them: each
-- is logged once, by one scheduler, whichever tree made it.
UPDATE breaker_transitions x
   SET logged = true
 WHERE x.id IN (SELECT id FROM breaker_transitions
                 WHERE NOT logged ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
RETURNING x.id, x.handler, x.key, x.from_state, x.to_state, x.cause, x.at;

-- name: known_handler
-- Whether a handler is one FlowForge has seen: named by a task of a registered workflow
-- version, or with a breaker row already.
SELECT EXISTS (SELECT 1 FROM breakers WHERE handler = %(handler)s)
    OR EXISTS (SELECT 1 FROM workflow_definitions d,
                      jsonb_array_elements(d.definition -> 'tasks') AS t(task)
                WHERE t.task ->> 'handler' = %(handler)s) AS known;

-- name: open_breaker
-- An operator opens a breaker (a handler's: key '', or one key's) and holds it open: no probe
-- runs until an operator closes it. Refused (no row) when it is held open already. Its
-- transition (if the state changes) and the audit row are written in the same statement.
WITH opened AS (
    INSERT INTO breakers AS b (handler, key, state, previous_state, held, opened_at)
    VALUES (%(handler)s, %(key)s, 'open', 'closed', true, now())
    ON CONFLICT (handler, key) DO UPDATE
       SET state = 'open', previous_state = b.state, held = true, opened_at = now(),
           probe_task_id = NULL, updated_at = now()
     WHERE NOT (b.state = 'open' AND b.held)
    RETURNING b.previous_state
), transitioned AS (
    INSERT INTO breaker_transitions (handler, key, from_state, to_state, cause)
    SELECT %(handler)s, %(key)s, previous_state, 'open', 'operator' FROM opened
     WHERE previous_state <> 'open'
), audited AS (
    INSERT INTO gate_audit (action, scope, name, key, requested_by, reason, previous_state,
                            new_state)
    SELECT 'breaker_open', 'handler', %(handler)s, nullif(%(key)s, ''), %(by)s, %(reason)s,
           previous_state, 'open'
      FROM opened
)
SELECT previous_state FROM opened;

-- name: close_breaker
-- An operator closes a breaker (a handler's: key '', or one key's; open, held open, or
-- half-open): its failures are forgotten and the scheduler, notified, unparks its tasks.
-- Refused (no row) when it is closed.
WITH closed AS (
    UPDATE breakers b
       SET state = 'closed', previous_state = b.state, held = false, failures = '{}',
           probe_task_id = NULL, updated_at = now()
     WHERE b.handler = %(handler)s AND b.key = %(key)s AND b.state <> 'closed'
    RETURNING b.previous_state
), transitioned AS (
    INSERT INTO breaker_transitions (handler, key, from_state, to_state, cause)
    SELECT %(handler)s, %(key)s, previous_state, 'closed', 'operator' FROM closed
), audited AS (
    INSERT INTO gate_audit (action, scope, name, key, requested_by, reason, previous_state,
                            new_state)
    SELECT 'breaker_close', 'handler', %(handler)s, nullif(%(key)s, ''), %(by)s, %(reason)s,
           previous_state, 'closed'
      FROM closed
)
SELECT previous_state, pg_notify('flowforge_scheduler', '')::text AS notified FROM closed;

-- name: list_breakers
-- Every breaker row (one per handler, or handler and key, that failed under a breaker or that
-- an operator opened), with its recent failures, what is left of its cooldown, its parked
-- tasks and transitions (those retention deleted included). Filtered by handler and key when
-- given (NULL: any).
SELECT b.handler, b.key, b.state, b.held, b.failure_limit, b.window_s, b.cooldown_s,
       b.opened_at, b.probe_task_id, b.updated_at,
       cardinality(breaker_recent(b.failures, coalesce(b.window_s, 0), 1000000))
           AS recent_failures,
       CASE WHEN b.state = 'open' AND NOT b.held
            THEN greatest(0, extract(epoch FROM b.opened_at
                                     + make_interval(secs => b.cooldown_s) - now()))::float8
       END AS probe_due_in_s,
       (SELECT count(*) FROM task_runs t
         WHERE t.handler = b.handler AND coalesce(t.breaker_key, '') = b.key
           AND t.parked_on = 'circuit_open' AND t.state = 'RETRYING') AS parked,
       (SELECT count(*) FROM breaker_transitions x
         WHERE x.handler = b.handler AND x.key = b.key)
       + (SELECT coalesce(sum(p.n), 0)::bigint FROM breaker_transitions_purged p
           WHERE p.handler = b.handler AND p.key = b.key) AS transitions
  FROM breakers b
 WHERE (%(handler)s::text IS NULL OR b.handler = %(handler)s)
   AND (%(key)s::text IS NULL OR b.key = %(key)s)
 ORDER BY b.handler, b.key;

-- name: pause
-- Pause a queue or a handler: claims of its tasks park them from now on. Refused (no row) when
-- it is paused already. Audited in the same statement.
WITH paused AS (
    INSERT INTO pauses (scope, name, paused_by, reason)
    VALUES (%(scope)s, %(name)s, %(by)s, %(reason)s)
    ON CONFLICT (scope, name) DO NOTHING
    RETURNING scope
), audited AS (
    INSERT INTO gate_audit (action, scope, name, requested_by, reason, previous_state, new_state)
    SELECT 'pause', %(scope)s, %(name)s, %(by)s, %(reason)s, 'running', 'paused' FROM paused
)
SELECT scope FROM paused;

-- name: resume
-- Resume a paused queue or handler; the scheduler, notified, unparks its tasks (those no
-- other pause or breaker holds). Refused (no row) when it is not paused. Audited.
WITH resumed AS (
    DELETE FROM pauses WHERE scope = %(scope)s AND name = %(name)s
    RETURNING scope
), audited AS (
    INSERT INTO gate_audit (action, scope, name, requested_by, reason, previous_state, new_state)
    SELECT 'resume', %(scope)s, %(name)s, %(by)s, %(reason)s, 'paused', 'running' FROM resumed
)
SELECT scope, pg_notify('flowforge_scheduler', '')::text AS notified FROM resumed;

-- name: list_pauses
-- Every paused queue and handler, with the tasks parked as paused under it now.
SELECT p.scope, p.name, p.paused_by, p.reason, p.paused_at,
       (SELECT count(*) FROM task_runs t
         WHERE t.parked_on = 'paused' AND t.state = 'RETRYING'
           AND ((p.scope = 'handler' AND t.handler = p.name)
                OR (p.scope = 'queue' AND t.queue = p.name))) AS parked
  FROM pauses p
 ORDER BY p.scope, p.name;

-- name: breaker_gauges
-- /metrics: each breaker's state and its transitions by target state (a counter kept by the
-- database: every tree's transitions, however many apis scrape, with those retention deleted:
-- it never goes down). The handler-wide breakers (key '') first, then the keyed ones, those
-- not closed first, most recently changed first: the caller bounds the keyed series it shows.
SELECT b.handler, b.key, b.state,
       coalesce(c.opened, 0)::bigint AS opened,
       coalesce(c.half_opened, 0)::bigint AS half_opened,
       coalesce(c.closed, 0)::bigint AS closed
  FROM breakers b
 CROSS JOIN LATERAL (
       SELECT sum(u.n) FILTER (WHERE u.to_state = 'open') AS opened,
              sum(u.n) FILTER (WHERE u.to_state = 'half_open') AS half_opened,
              sum(u.n) FILTER (WHERE u.to_state = 'closed') AS closed
         FROM (SELECT x.to_state, count(*) AS n FROM breaker_transitions x
                WHERE x.handler = b.handler AND x.key = b.key
                GROUP BY x.to_state
               UNION ALL
               SELECT p.to_state, p.n FROM breaker_transitions_purged p
                WHERE p.handler = b.handler AND p.key = b.key) AS u) AS c
 ORDER BY b.key <> '', b.state = 'closed', b.updated_at DESC, b.handler, b.key;

-- name: parked_counts
-- /metrics: tasks parked now, by why.
SELECT parked_on AS reason, count(*) AS n
  FROM task_runs
 WHERE parked_on IS NOT NULL AND state = 'RETRYING'
 GROUP BY parked_on;

-- name: timeline_tasks
-- A run's timeline (store/timelines.py; docs/dashboard-contract.md "Timeline"): its first
-- %(max_tasks)s top-level tasks in creation order (`total`: how many it has), each map followed
-- by its first %(max_items)s items in item order, %(max_item_rows)s items in all (the first
-- maps' first; task_runs_map_item_idx walks each map's from index 0). `eligible_at`: when the
-- task could first start — its dependencies all finished and its run's start time reached
-- (null while one is unfinished); an item's: its map's expansion, which inserted it.
WITH top AS MATERIALIZED (
    SELECT t.id, t.seq, t.for_each, count(*) OVER () AS total
      FROM task_runs t
     WHERE t.run_id = %(id)s AND t.map_id IS NULL
     ORDER BY t.seq
     LIMIT %(max_tasks)s
), items AS (
    SELECT i.id, m.seq, i.item_index
      FROM top m
     CROSS JOIN LATERAL (SELECT x.id, x.item_index FROM task_runs x
                          WHERE x.map_id = m.id AND x.item_index < %(max_items)s
                          ORDER BY x.item_index) AS i
     WHERE m.for_each IS NOT NULL
     ORDER BY m.seq, i.item_index
     LIMIT %(max_item_rows)s
), shown AS (
    SELECT id, seq, -1 AS item_index FROM top
    UNION ALL
    SELECT id, seq, item_index FROM items
)
SELECT t.id, t.name, t.handler, t.state, t.attempt, t.created_at, t.started_at, t.finished_at,
       t.retry_at, t.failure_reason, t.map_id, t.item_index, t.sleep_s, t.for_each,
       t.event_name, t.child_workflow, (SELECT max(total) FROM top) AS total,
       CASE WHEN t.map_id IS NOT NULL THEN t.created_at
            WHEN d.unfinished = 0 THEN greatest(t.created_at, r.start_at, d.last_finished)
       END AS eligible_at
  FROM shown s
  JOIN task_runs t ON t.id = s.id
  JOIN workflow_runs r ON r.id = t.run_id
 CROSS JOIN LATERAL (SELECT count(*) FILTER (WHERE u.finished_at IS NULL) AS unfinished,
                            max(u.finished_at) AS last_finished
                       FROM task_edges e JOIN task_runs u ON u.id = e.upstream_id
                      WHERE e.downstream_id = t.id) AS d
 ORDER BY s.seq, s.item_index;

-- name: timeline_attempts
-- The latest %(max_attempts)s attempts of each task run of %(ids)s (the primary key walks them
-- from the last), first first; the error cut to %(error_chars)s characters, no traceback: a
-- timeline shows an attempt's first line (the task panel shows it whole).
SELECT a.task_run_id, a.attempt, a.fencing_token, a.worker, a.started_at, a.finished_at,
       a.outcome, a.failure_reason, left(a.error, %(error_chars)s) AS error,
       NULL::text AS traceback
  FROM unnest(%(ids)s::uuid[]) AS s(id)
 CROSS JOIN LATERAL (SELECT x.* FROM task_attempts x
                      WHERE x.task_run_id = s.id
                      ORDER BY x.attempt DESC
                      LIMIT %(max_attempts)s) AS a
 ORDER BY a.task_run_id, a.attempt;

-- name: timeline_map_rests
-- What a timeline leaves out of each map of %(maps)s: its items from index %(shown)s on (the
-- same position in the arrays), counted in all and by state, their attempts, the first start,
-- the last finish and how many started and are not finished. A map with none is absent.
SELECT s.map_id, sum(c.n)::bigint AS n, jsonb_object_agg(c.state, c.n) AS counts,
       sum(c.attempts)::bigint AS attempts, min(c.first_started) AS first_started_at,
       max(c.last_finished) AS last_finished_at,
       sum(c.unfinished_started)::bigint AS unfinished_started
  FROM unnest(%(maps)s::uuid[], %(shown)s::int[]) AS s(map_id, shown)
 CROSS JOIN LATERAL (SELECT i.state, count(*) AS n, sum(i.attempt) AS attempts,
                            min(i.started_at) AS first_started,
                            max(i.finished_at) AS last_finished,
                            count(*) FILTER (WHERE i.started_at IS NOT NULL
                                               AND i.finished_at IS NULL) AS unfinished_started
                       FROM task_runs i
                      WHERE i.map_id = s.map_id AND i.item_index >= s.shown
                      GROUP BY i.state) AS c
 GROUP BY s.map_id;
