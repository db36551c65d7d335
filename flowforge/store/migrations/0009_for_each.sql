-- Map tasks (for_each, issue 19, SPEC 7.3; docs/dynamic.md "Map").
-- A map task's row (for_each: the upstream task it maps over) never reaches a worker: when its
-- dependencies are met a scheduler pass expands it — in one statement — into one item row per
-- element of the upstream's JSON-list result, and marks it RUNNING; another pass settles it
-- from its items once they are all finished.

-- for_each / max_parallel: on a map's own row. map_id / item_index / item: on an item's row
-- (its map, its position from 0, its element of the list).
ALTER TABLE task_runs
    ADD COLUMN for_each     text,
    ADD COLUMN max_parallel integer CHECK (max_parallel >= 1),
    ADD COLUMN map_id       uuid REFERENCES task_runs (id) ON DELETE CASCADE,
    ADD COLUMN item_index   integer CHECK (item_index >= 0),
    ADD COLUMN item         jsonb,
    ADD CONSTRAINT task_runs_item_check CHECK ((map_id IS NULL) = (item_index IS NULL));

-- One row per (map, index): an expansion run twice (a retried transaction, two schedulers)
-- cannot create an item twice. Also the way to a map's items in order (pages, results).
CREATE UNIQUE INDEX task_runs_map_item_idx ON task_runs (map_id, item_index)
    WHERE map_id IS NOT NULL;
-- Maps due for expansion, and RUNNING maps (to settle, or to open item slots).
CREATE INDEX task_runs_map_due_idx ON task_runs (seq)
    WHERE state = 'PENDING' AND pending_deps = 0 AND for_each IS NOT NULL;
CREATE INDEX task_runs_map_running_idx ON task_runs (seq)
    WHERE state = 'RUNNING' AND for_each IS NOT NULL;
-- A map's items in play (unfinished, not waiting for a max_parallel slot), and those waiting for
-- a slot (pending_deps 1: an item has no other dependency): both stay small whatever the map's
-- size, so counting them on every pass is cheap.
CREATE INDEX task_runs_map_active_idx ON task_runs (map_id)
    WHERE map_id IS NOT NULL AND pending_deps = 0
      AND state NOT IN ('SUCCEEDED', 'DEAD', 'CANCELLED');
CREATE INDEX task_runs_map_gated_idx ON task_runs (map_id, item_index)
    WHERE map_id IS NOT NULL AND pending_deps > 0 AND state = 'PENDING';
