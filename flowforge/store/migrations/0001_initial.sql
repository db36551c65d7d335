-- FlowForge schema, version 1.
-- Every timestamp is written by PostgreSQL's clock (now()), never by a process.

CREATE TABLE workflow_definitions (
    name          text        NOT NULL,
    digest        text        NOT NULL,
    definition    jsonb       NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, digest)
);

CREATE TABLE workflow_runs (
    id                  uuid        PRIMARY KEY,
    workflow            text        NOT NULL,
    workflow_digest     text        NOT NULL,
    state               text        NOT NULL DEFAULT 'PENDING'
        CHECK (state IN ('PENDING', 'RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED')),
    input               jsonb       NOT NULL,
    fail_fast           boolean     NOT NULL,
    idempotency_key     text        UNIQUE,
    request_digest      text,
    cancel_requested_at timestamptz,
    created_at          timestamptz NOT NULL DEFAULT now(),
    started_at          timestamptz,
    finished_at         timestamptz,
    updated_at          timestamptz NOT NULL DEFAULT now(),
    FOREIGN KEY (workflow, workflow_digest) REFERENCES workflow_definitions (name, digest)
);
CREATE INDEX workflow_runs_created_idx ON workflow_runs (created_at DESC, id DESC);
CREATE INDEX workflow_runs_state_created_idx ON workflow_runs (state, created_at DESC, id DESC);
CREATE INDEX workflow_runs_workflow_created_idx ON workflow_runs (workflow, created_at DESC, id DESC);
CREATE INDEX workflow_runs_finished_idx ON workflow_runs (finished_at) WHERE finished_at IS NOT NULL;

CREATE TABLE task_runs (
    id               uuid        PRIMARY KEY,
    run_id           uuid        NOT NULL REFERENCES workflow_runs (id) ON DELETE CASCADE,
    name             text        NOT NULL,
    handler          text        NOT NULL,
    -- global creation order: decides "earlier" among tasks sharing an ordering key
    seq              bigserial   NOT NULL,
    state            text        NOT NULL DEFAULT 'PENDING'
        CHECK (state IN ('PENDING', 'READY', 'RUNNING', 'SUCCEEDED', 'FAILED', 'RETRYING',
                         'DEAD', 'CANCELLED')),
    -- dependencies not yet SUCCEEDED; the scheduler decrements it as upstream tasks succeed
    pending_deps     integer     NOT NULL CHECK (pending_deps >= 0),
    -- attempts are counted at claim time and numbered from 1
    attempt          integer     NOT NULL DEFAULT 0,
    -- the attempt count at the last requeue: the retry budget restarts from here
    budget_start     integer     NOT NULL DEFAULT 0,
    max_attempts     integer     NOT NULL CHECK (max_attempts >= 1),
    base_delay_s     double precision NOT NULL,
    max_delay_s      double precision NOT NULL,
    jitter           text        NOT NULL,
    timeout_s        double precision,
    idempotency_key  text,
    ordering_key     text,
    on_dead          text        NOT NULL DEFAULT 'release' CHECK (on_dead IN ('release', 'block')),
    -- bumped by every claim, reap, deferral, cancellation and requeue
    fencing_token    bigint      NOT NULL DEFAULT 0,
    lease_owner      text,
    lease_expires_at timestamptz,
    retry_at         timestamptz,
    cancel_requested boolean     NOT NULL DEFAULT false,
    cancel_cause     text        CHECK (cancel_cause IN ('operator', 'upstream')),
    -- consecutive attempts that ended with an expired lease (crash-loop detection)
    crash_streak     integer     NOT NULL DEFAULT 0,
    failure_reason   text,
    last_error       text,
    result           jsonb,
    -- false while the consequences of reaching a finished state are not yet applied
    propagated       boolean     NOT NULL DEFAULT true,
    created_at       timestamptz NOT NULL DEFAULT now(),
    ready_at         timestamptz,
    started_at       timestamptz,
    finished_at      timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (run_id, name)
);
CREATE INDEX task_runs_run_state_idx ON task_runs (run_id, state);
CREATE INDEX task_runs_eligible_idx ON task_runs (seq) WHERE state = 'PENDING' AND pending_deps = 0;
CREATE INDEX task_runs_due_retry_idx ON task_runs (retry_at) WHERE state = 'RETRYING';
CREATE INDEX task_runs_failed_idx ON task_runs (updated_at) WHERE state = 'FAILED';
CREATE INDEX task_runs_lease_idx ON task_runs (lease_expires_at) WHERE state = 'RUNNING';
CREATE INDEX task_runs_unpropagated_idx ON task_runs (finished_at) WHERE NOT propagated;
CREATE INDEX task_runs_stream_idx ON task_runs (ordering_key, seq)
    WHERE ordering_key IS NOT NULL AND state NOT IN ('SUCCEEDED', 'CANCELLED');
CREATE INDEX task_runs_dead_idx ON task_runs (finished_at) WHERE state = 'DEAD';

CREATE TABLE task_edges (
    upstream_id   uuid NOT NULL REFERENCES task_runs (id) ON DELETE CASCADE,
    downstream_id uuid NOT NULL REFERENCES task_runs (id) ON DELETE CASCADE,
    PRIMARY KEY (upstream_id, downstream_id)
);
CREATE INDEX task_edges_downstream_idx ON task_edges (downstream_id);

CREATE TABLE task_attempts (
    task_run_id    uuid        NOT NULL REFERENCES task_runs (id) ON DELETE CASCADE,
    attempt        integer     NOT NULL,
    fencing_token  bigint      NOT NULL,
    worker         text,
    started_at     timestamptz NOT NULL DEFAULT now(),
    finished_at    timestamptz,
    outcome        text        NOT NULL DEFAULT 'running'
        CHECK (outcome IN ('running', 'succeeded', 'failed', 'cancelled', 'reused',
                           'lease_expired')),
    failure_reason text,
    error          text,
    traceback      text,
    PRIMARY KEY (task_run_id, attempt)
);

-- transactional outbox: one row per dispatch generation of a task run
CREATE TABLE outbox (
    id            bigserial   PRIMARY KEY,
    task_run_id   uuid        NOT NULL REFERENCES task_runs (id) ON DELETE CASCADE,
    fencing_token bigint      NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    published_at  timestamptz,
    UNIQUE (task_run_id, fencing_token)
);
CREATE INDEX outbox_pending_idx ON outbox (id) WHERE published_at IS NULL;
CREATE INDEX outbox_published_idx ON outbox (published_at) WHERE published_at IS NOT NULL;

-- exclusive claims of task idempotency keys, and the results of the executions that won them
CREATE TABLE idempotency_keys (
    key              text        PRIMARY KEY,
    state            text        NOT NULL CHECK (state IN ('RUNNING', 'SUCCEEDED')),
    task_run_id      uuid        NOT NULL,
    fencing_token    bigint      NOT NULL,
    lease_expires_at timestamptz,
    result           jsonb,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE requeue_audit (
    id              bigserial   PRIMARY KEY,
    task_run_id     uuid        NOT NULL REFERENCES task_runs (id) ON DELETE CASCADE,
    requested_by    text        NOT NULL,
    reason          text,
    previous_reason text,
    attempt         integer     NOT NULL,
    requested_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX requeue_audit_task_idx ON requeue_audit (task_run_id);
