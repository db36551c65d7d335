-- Retention (issue 15): settled idempotency keys age on their own clock, and operator purges
-- of dead tasks leave an audit row.

-- The housekeeping purge of SUCCEEDED keys, oldest first, without reading every key.
CREATE INDEX idempotency_keys_settled_idx ON idempotency_keys (updated_at)
    WHERE state = 'SUCCEEDED';

-- One row per batch of `flowforge purge --dead`, written in the transaction that deletes:
-- who, when, with which age and filter, what went (the dead task ids) and which ordering
-- streams (on_dead: block) the purge released.
CREATE TABLE purge_audit (
    id               bigserial        PRIMARY KEY,
    requested_by     text             NOT NULL,
    older_than_s     double precision NOT NULL,
    workflow         text,
    runs             integer          NOT NULL,
    tasks            integer          NOT NULL,
    dead_task_ids    uuid[]           NOT NULL,
    released_streams text[]           NOT NULL,
    purged_at        timestamptz      NOT NULL DEFAULT now()
);
CREATE INDEX purge_audit_purged_idx ON purge_audit (purged_at);
