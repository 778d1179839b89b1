-- Owned by progress-service: the transactional outbox of the messages it owes the monolith's
-- Celery workers. Re-runnable.
--
-- Each outbox row is written in the same statement as the fact it announces (the completion event
-- by the flush upsert, the email row by the reservation), so nothing committed can miss its message.
-- The relay claims rows with a lease (claimed_until) under FOR UPDATE SKIP LOCKED, publishes, then
-- sets published_at. publish_attempts counts claims: above 1, the message may have gone out before
-- (same task id). A row the broker refused for good gets publish_failed_at and is left for a human.

ALTER TABLE progress_completion_event
    ADD COLUMN IF NOT EXISTS claimed_until     timestamptz NULL,
    ADD COLUMN IF NOT EXISTS publish_attempts  integer     NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS publish_failed_at timestamptz NULL,
    ADD COLUMN IF NOT EXISTS publish_error     text        NULL;

-- One row per won email reservation. dispatch_id is the emails_emaildispatch row (the task's
-- dispatch_id); deleting the dispatch row deletes its message.
CREATE TABLE IF NOT EXISTS trial_email_outbox (
    dispatch_id       bigint      PRIMARY KEY
                      REFERENCES emails_emaildispatch (id) ON DELETE CASCADE DEFERRABLE INITIALLY DEFERRED,
    user_id           bigint      NOT NULL,
    source            text        NOT NULL,
    email_key         text        NOT NULL,
    reserved_at       timestamptz NOT NULL,
    created_at        timestamptz NOT NULL DEFAULT now(),
    claimed_until     timestamptz NULL,
    publish_attempts  integer     NOT NULL DEFAULT 0,
    published_at      timestamptz NULL,
    publish_failed_at timestamptz NULL,
    publish_error     text        NULL
);

-- the relay scans only what is still owed
CREATE INDEX IF NOT EXISTS trial_email_outbox_unpublished_idx
    ON trial_email_outbox (dispatch_id) WHERE published_at IS NULL AND publish_failed_at IS NULL;
