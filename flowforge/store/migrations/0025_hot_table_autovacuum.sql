-- Autovacuum of the four hot tables by their churn, not their size (issue 22, "Over time";
-- docs/operations.md "Autovacuum of the hot tables").
--
-- Every task writes its row, its attempt, its outbox row and its run's row several times, and
-- finished runs stay for the retention time, so these tables hold millions of rows. With the
-- server's default scale factor (0.2) a table waits for a fifth of its rows to be dead before a
-- vacuum, and the dead rows — in the partial indexes every claim and scheduler pass reads too
-- — grow with the table. A 30-minute soak at 250 tasks/s kept task_runs' dead rows at the
-- naptime's bound (49k) with these settings, against 122k with the defaults. An operator may
-- set other values (ALTER TABLE ... SET / RESET): a later migration does not touch them.
ALTER TABLE task_runs     SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 10000);
ALTER TABLE workflow_runs SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 10000);
ALTER TABLE task_attempts SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 10000);
ALTER TABLE outbox        SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 10000);
