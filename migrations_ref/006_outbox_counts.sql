-- Owned by progress-service: indexes that keep the outbox counts cheap (the relay's gauges of owed
-- and parked messages, `progress-service status`, `outbox list --parked`). Re-runnable.
--
-- The owed rows by created_at: their count and the oldest one's age in one index-only scan. The
-- parked rows by publish_failed_at: their count, and `outbox list --parked` newest first. Both are
-- partial: a published row (nearly all of them) is in neither. On a large production table create
-- them with CREATE INDEX CONCURRENTLY (outside a transaction) so the flush is not held up.

CREATE INDEX IF NOT EXISTS progress_completion_event_owed_idx
    ON progress_completion_event (created_at) WHERE published_at IS NULL AND publish_failed_at IS NULL;
CREATE INDEX IF NOT EXISTS progress_completion_event_parked_idx
    ON progress_completion_event (publish_failed_at) WHERE publish_failed_at IS NOT NULL AND published_at IS NULL;

CREATE INDEX IF NOT EXISTS trial_email_outbox_owed_idx
    ON trial_email_outbox (created_at) WHERE published_at IS NULL AND publish_failed_at IS NULL;
CREATE INDEX IF NOT EXISTS trial_email_outbox_parked_idx
    ON trial_email_outbox (publish_failed_at) WHERE publish_failed_at IS NOT NULL AND published_at IS NULL;
