"""Trial-journey emails: reserve each due email exactly once, in blocks; the outbox relay sends only the winners.

journey       the six steps and when each is due (pure, no I/O)
reservations  the SQL: load a batch's trials and dispatched keys, reserve a block and write its outbox rows
batch         send_trial_journey_emails_batch: load, resolve in memory, reserve in blocks (publishes nothing)
sweep         every trial still in its journey, in batches: `trial-emails run-once`, and periodically in `serve`
"""
