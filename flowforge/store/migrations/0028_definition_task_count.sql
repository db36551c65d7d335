-- How many tasks a stored definition declares, kept by PostgreSQL from the definition itself.
--
-- A worker's finish settles a run whose definition has one task (the run has no other task by
-- construction: a map's items need an upstream to expand from, a child workflow is a run of its
-- own), instead of leaving it to a scheduler pass that would write the task's row a second time
-- and derive the run (issue 22, docs/architecture.md "A finish settles a one-task run"). The
-- finish reads this by the definition's primary key: no read of the run's other tasks, and no
-- read of the definition's jsonb. Definitions are few and small, so the rewrite this ALTER makes
-- is brief.
ALTER TABLE workflow_definitions
    ADD COLUMN task_count integer
        GENERATED ALWAYS AS (jsonb_array_length(definition -> 'tasks')) STORED;
