-- Counts that stay cheap at a million rows (issue 22, "Scale of what is stored";
-- docs/operations.md "Counts above 100,000"). The overview, /metrics, /health/ready and
-- `flowforge stats` counted every row of task_runs, workflow_runs and task_attempts on each
-- call: seconds at a million finished runs and a million READY tasks. Now a count is exact up
-- to a cap (the caller's, 100,000 by default), read through an index and stopped at cap + 1
-- rows; above it, it is PostgreSQL's estimate (the planner's statistics: ANALYZE, autovacuum)
-- and says so.

-- The unsettled task runs by state: what a capped count of PENDING, READY, RUNNING, FAILED,
-- RETRYING or DEAD reads (index-only), never the settled millions.
CREATE INDEX task_runs_unsettled_state_idx ON task_runs (state)
 WHERE state NOT IN ('SUCCEEDED', 'CANCELLED');

-- READY task runs by queue: the queues with READY tasks found by skipping from one to the next
-- (a handful of index probes), each counted up to the cap.
CREATE INDEX task_runs_ready_queue_idx ON task_runs (queue) WHERE state = 'READY';

-- The attempts that failed, by reason (`stats`): not every attempt ever made.
CREATE INDEX task_attempts_failed_idx ON task_attempts (failure_reason)
 WHERE failure_reason IS NOT NULL;

-- PostgreSQL's estimate of how many rows of table tbl have value v in column col: the table's
-- estimated rows times v's frequency among the column's most common values (0 when v is not
-- among them, or the table was never analysed).
CREATE FUNCTION flowforge_estimate(tbl regclass, col text, v text) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT coalesce((
        SELECT round(greatest(c.reltuples, 0) * f.freq)::bigint
          FROM pg_class c
          JOIN pg_namespace ns ON ns.oid = c.relnamespace
          JOIN pg_stats s ON s.schemaname = ns.nspname AND s.tablename = c.relname
                         AND s.attname = col
         CROSS JOIN LATERAL unnest(s.most_common_vals::text::text[], s.most_common_freqs)
                    AS f(val, freq)
         WHERE c.oid = tbl AND f.val = v), 0)
$$;

-- Rows of table tbl per value of its `state` column, for each of states: (state, n,
-- estimated). A table of at most cap rows (by its statistics) is counted exactly, all at once.
-- Above, each state not in settled is counted through an index, up to cap + 1 rows: exact below
-- the cap, else the estimate (never less than cap + 1) with estimated true; each state in
-- settled — one no index of unsettled rows holds — is the estimate, estimated true. States
-- with no row are left out.
CREATE FUNCTION flowforge_state_counts(tbl regclass, states text[], settled text[], cap bigint)
RETURNS TABLE (state text, n bigint, estimated boolean)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    total real;
    s text;
    counted bigint;
BEGIN
    SELECT c.reltuples INTO total FROM pg_class c WHERE c.oid = tbl;
    IF total IS NULL OR total < 0 OR total <= cap THEN
        RETURN QUERY EXECUTE format(
            'SELECT t.state, count(*), false FROM %s t GROUP BY t.state', tbl);
        RETURN;
    END IF;
    FOREACH s IN ARRAY states LOOP
        IF s = ANY(settled) THEN
            counted := flowforge_estimate(tbl, 'state', s);
            IF counted > 0 THEN
                state := s; n := counted; estimated := true;
                RETURN NEXT;
            END IF;
            CONTINUE;
        END IF;
        -- a literal, not a parameter: the plan must see the state to use a partial index
        EXECUTE format('SELECT count(*) FROM (SELECT 1 FROM %s t WHERE t.state = %L LIMIT %s) x',
                       tbl, s, cap + 1) INTO counted;
        IF counted > cap THEN
            state := s; n := greatest(cap + 1, flowforge_estimate(tbl, 'state', s));
            estimated := true;
            RETURN NEXT;
        ELSIF counted > 0 THEN
            state := s; n := counted; estimated := false;
            RETURN NEXT;
        END IF;
    END LOOP;
END
$$;

-- READY task runs per queue (NULL: on no queue), each counted up to cap + 1 rows through
-- task_runs_ready_queue_idx: (queue, n, estimated) — above the cap, n is cap + 1 and
-- estimated is true ("more than cap": the statistics know a queue's rows, not its READY ones).
-- The queues are found by a loose index scan: one probe per queue with READY tasks, however
-- many tasks each has.
CREATE FUNCTION flowforge_ready_by_queue(cap bigint)
RETURNS TABLE (queue text, n bigint, estimated boolean)
LANGUAGE sql STABLE AS $$
    WITH RECURSIVE named AS (
        (SELECT t.queue FROM task_runs t
          WHERE t.state = 'READY' AND t.queue IS NOT NULL ORDER BY t.queue LIMIT 1)
        UNION ALL
        SELECT (SELECT t.queue FROM task_runs t
                 WHERE t.state = 'READY' AND t.queue > named.queue ORDER BY t.queue LIMIT 1)
          FROM named WHERE named.queue IS NOT NULL
    ), counted AS (
        SELECT named.queue, c.n
          FROM named
         CROSS JOIN LATERAL (
               SELECT count(*) AS n
                 FROM (SELECT 1 FROM task_runs t
                        WHERE t.state = 'READY' AND t.queue = named.queue
                        LIMIT cap + 1) x) c
         WHERE named.queue IS NOT NULL
        UNION ALL
        SELECT NULL, c.n
          FROM (SELECT count(*) AS n
                  FROM (SELECT 1 FROM task_runs t
                         WHERE t.state = 'READY' AND t.queue IS NULL
                         LIMIT cap + 1) x) c
         WHERE c.n > 0
    )
    SELECT counted.queue, least(counted.n, cap + 1), counted.n > cap FROM counted
$$;
