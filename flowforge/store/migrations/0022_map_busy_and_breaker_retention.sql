-- max_parallel counted at admission for a map's keyed items (issue 20, SPEC 7.3 and 7.4;
-- docs/flow-control.md "A map's items").

-- A map's items READY or RUNNING: what max_parallel bounds for an item with a concurrency or
-- rate key (admit_gated counts it per map on every pass, and map_has_room every full map).
-- Only busy items are indexed, so a count costs at most max_parallel entries whatever the map's
-- size.
CREATE INDEX task_runs_map_busy_idx ON task_runs (map_id)
    WHERE map_id IS NOT NULL AND state IN ('READY', 'RUNNING');

-- Keyed items created before this migration behind a closed max_parallel slot (pending_deps 1:
-- an item has no other dependency) are opened: admit_gated now applies their map's
-- max_parallel, and open_item_slots, which opens only slots of unkeyed items' maps by their
-- count in play, would otherwise open them by the old rule.
UPDATE task_runs
   SET pending_deps = 0, updated_at = now()
 WHERE map_id IS NOT NULL AND state = 'PENDING' AND pending_deps > 0 AND NOT ready_by_itself;

-- Retention of keyed breakers (docs/flow-control.md "Retention of transitions and gate audit").
-- A keyed breaker row that is closed, has no failure within its window and has not changed for
-- the retention time reads exactly as no row (the gate and trip_breakers take an absent row for
-- a closed one with no failures), so retention deletes it, with its transitions' kept counts:
-- those are added to its handler's here, so /metrics' per-handler transition counter never
-- goes down and nothing is kept per key that is gone. Never the handler-wide row (key '').
CREATE TABLE breaker_transitions_folded (
    handler  text   NOT NULL,
    to_state text   NOT NULL,
    n        bigint NOT NULL,
    PRIMARY KEY (handler, to_state)
);
-- The idle keyed rows, oldest change first (the handler-wide rows and any not closed are not
-- indexed: retention never deletes them).
CREATE INDEX breakers_idle_keyed_idx ON breakers (updated_at)
    WHERE key <> '' AND state = 'closed' AND NOT held;
