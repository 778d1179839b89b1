"""Trial-journey emails: reserve each due email exactly once, in blocks, and enqueue only the winners.

journey       the six steps and when each is due (pure, no I/O)
reservations  the SQL: load a batch's trials and dispatched keys, reserve a block of pairs
queue         where reserved emails go (the monolith's Celery email task by default, or a Redis stream)
batch         send_trial_journey_emails_batch: load, resolve in memory, reserve, enqueue
sweep         every trial still in its journey, in batches: `trial-emails run-once`, and periodically in `serve`
"""
