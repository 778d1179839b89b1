-- Reference copy of the monolith's trial and email-dispatch tables, read and written by the
-- trial-journey email module. Re-runnable. Foreign keys are DEFERRABLE INITIALLY DEFERRED and
-- every foreign key has its own index, as Django creates them.

CREATE TABLE IF NOT EXISTS trials_usertrial (
    id         bigserial PRIMARY KEY,
    user_id    bigint      NOT NULL REFERENCES users_user (id) DEFERRABLE INITIALLY DEFERRED,
    started_at timestamptz NOT NULL,
    ends_at    timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS trials_usertrial_user_id_idx ON trials_usertrial (user_id);

-- One row per email ever reserved for a user. The UNIQUE constraint is what makes "enqueued at
-- most once" hold across retries, redeliveries and workers: only the INSERT that wins it enqueues.
-- It ignores deleted_at, so a soft-deleted row still blocks a new reservation of the same key.
CREATE TABLE IF NOT EXISTS emails_emaildispatch (
    id         bigserial PRIMARY KEY,
    user_id    bigint      NOT NULL REFERENCES users_user (id) DEFERRABLE INITIALLY DEFERRED,
    source     text        NOT NULL,
    email_key  text        NOT NULL,
    sent_at    timestamptz NOT NULL,
    created_at timestamptz NOT NULL,
    deleted_at timestamptz NULL,
    CONSTRAINT emails_emaildispatch_user_source_email_key_uniq UNIQUE (user_id, source, email_key)
);
CREATE INDEX IF NOT EXISTS emails_emaildispatch_user_id_idx ON emails_emaildispatch (user_id);
