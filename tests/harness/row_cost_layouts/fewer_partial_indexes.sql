-- task_runs without twenty of its 28 partial indexes (what they cost an UPDATE; not a
-- proposal: each serves a scheduler pass or a lookup). Left: eligible, due_retry,
-- unpropagated, finished, ready, lease, unsettled_state, ready_queue and the three
-- non-partial ones (pkey, run_id_name_key, run_state).
DROP INDEX task_runs_stream_idx, task_runs_dead_page_idx, task_runs_poison_idx,
    task_runs_wake_idx, task_runs_timer_idx, task_runs_map_item_idx, task_runs_map_due_idx,
    task_runs_map_running_idx, task_runs_map_active_idx, task_runs_map_gated_idx,
    task_runs_event_wait_idx, task_runs_event_start_idx, task_runs_condition_idx,
    task_runs_child_start_idx, task_runs_child_running_idx, task_runs_concurrency_idx,
    task_runs_rate_idx, task_runs_parked_key_idx, task_runs_map_busy_idx, task_runs_failed_idx;
