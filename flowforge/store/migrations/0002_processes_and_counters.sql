-- Process registry (every live role process of every tree) and global event counters.

CREATE TABLE processes (
    id           uuid        PRIMARY KEY,
    host         text        NOT NULL,
    pid          integer     NOT NULL,
    role         text        NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    last_seen_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX processes_role_seen_idx ON processes (role, last_seen_at);

-- Monotonic counters of rare events that must survive the process that saw them
-- (e.g. stale completions rejected by the fencing token).
CREATE TABLE counters (
    name  text   PRIMARY KEY,
    value bigint NOT NULL DEFAULT 0
);
