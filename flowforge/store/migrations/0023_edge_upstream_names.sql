-- A join's upstream tasks paged by name on the edges' own index (issue 22, "Wide fan-in";
-- docs/architecture.md "Bounded upstream results").
--
-- upstream_names_page served a join with more upstream tasks than the inline bound a page at a
-- time in name order, but names lived only on task_runs: every page read and sorted every
-- upstream task's row (10,000 rows a page for a 10,000-wide fan-in). An edge now holds its
-- upstream's name (a task's name never changes), and (downstream_id, upstream_name) replaces the
-- index on downstream_id alone — it serves every lookup that one did, the claim's count of a
-- task's upstream edges included — so a page reads the index range of its own edges.
--
-- Existing edges are filled from their upstream task: on a large task_edges this rewrites the
-- table once (docs/operations.md "Migrations that rewrite a table"). A tree of the version
-- before, still running while the migration is applied, inserts edges without the name: a
-- trigger fills it for them (its WHEN clause is all this version's inserts pay).
ALTER TABLE task_edges ADD COLUMN upstream_name text;

UPDATE task_edges e
   SET upstream_name = u.name
  FROM task_runs u
 WHERE u.id = e.upstream_id;

ALTER TABLE task_edges ALTER COLUMN upstream_name SET NOT NULL;

CREATE FUNCTION flowforge_edge_upstream_name() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    SELECT name INTO NEW.upstream_name FROM task_runs WHERE id = NEW.upstream_id;
    RETURN NEW;
END
$$;

CREATE TRIGGER task_edges_upstream_name BEFORE INSERT ON task_edges
    FOR EACH ROW WHEN (NEW.upstream_name IS NULL)
    EXECUTE FUNCTION flowforge_edge_upstream_name();

CREATE INDEX task_edges_downstream_name_idx ON task_edges (downstream_id, upstream_name);
DROP INDEX task_edges_downstream_idx;
