-- Queues that route (issue 20, SPEC 7.4; docs/flow-control.md "Queues and pools").

-- The queue a task's messages go to: its workflow's `queue:`, else the broker.queue of the
-- config that triggered the run. NULL: a row from before this migration (or a store-level
-- trigger that named none), published to the broker.queue of whichever publisher takes it —
-- what every row meant until now.
ALTER TABLE task_runs ADD COLUMN queue text;

-- Each dispatch carries its task's queue, so the publisher routes it without reading the task
-- (its lock stays one table's; docs/flow-control.md says why). NULL: as above.
ALTER TABLE outbox ADD COLUMN queue text;

-- The queue a worker consumes (NULL for the other roles): /health/ready and the overview warn
-- about a queue with READY tasks and no live consumer.
ALTER TABLE processes ADD COLUMN queue text;
