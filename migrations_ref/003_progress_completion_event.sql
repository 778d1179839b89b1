-- Owned by progress-service: one row per (content_type, content_id, user_id) the first time the
-- flusher sees that content completed. The UNIQUE constraint is what makes "one event, ever" hold
-- across pods and retries. published_at is for whoever relays the events (NULL = not yet).

CREATE TABLE IF NOT EXISTS progress_completion_event (
    id           bigserial PRIMARY KEY,
    content_type text        NOT NULL,
    content_id   bigint      NOT NULL,
    user_id      bigint      NOT NULL,
    completed_at timestamptz NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz NULL,
    CONSTRAINT progress_completion_event_key_uniq UNIQUE (content_type, content_id, user_id),
    CONSTRAINT progress_completion_event_type_check
        CHECK (content_type IN ('lesson', 'audio', 'meditation', 'live'))
);

-- a relay scans for what it has not published yet
CREATE INDEX IF NOT EXISTS progress_completion_event_unpublished_idx
    ON progress_completion_event (id) WHERE published_at IS NULL;
