-- Reference copy of the monolith's four progress tables, written by the flusher. Re-runnable.

CREATE TABLE IF NOT EXISTS engagements_lessonprogress (
    id           bigserial PRIMARY KEY,
    user_id      bigint NOT NULL REFERENCES users_user (id) DEFERRABLE INITIALLY DEFERRED,
    lesson_id    bigint NOT NULL REFERENCES courses_lesson (id) DEFERRABLE INITIALLY DEFERRED,
    position     double precision NOT NULL,
    completed_at timestamptz NULL,
    created_at   timestamptz NOT NULL,
    updated_at   timestamptz NOT NULL,
    CONSTRAINT engagements_lessonprogress_user_lesson_id_uniq UNIQUE (user_id, lesson_id)
);
CREATE INDEX IF NOT EXISTS engagements_lessonprogress_lesson_id_idx ON engagements_lessonprogress (lesson_id);

CREATE TABLE IF NOT EXISTS audios_audioprogress (
    id           bigserial PRIMARY KEY,
    user_id      bigint NOT NULL REFERENCES users_user (id) DEFERRABLE INITIALLY DEFERRED,
    audio_id     bigint NOT NULL REFERENCES audios_audio (id) DEFERRABLE INITIALLY DEFERRED,
    position     double precision NOT NULL,
    completed_at timestamptz NULL,
    created_at   timestamptz NOT NULL,
    updated_at   timestamptz NOT NULL,
    CONSTRAINT audios_audioprogress_user_audio_id_uniq UNIQUE (user_id, audio_id)
);
CREATE INDEX IF NOT EXISTS audios_audioprogress_audio_id_idx ON audios_audioprogress (audio_id);

CREATE TABLE IF NOT EXISTS audios_meditationprogress (
    id           bigserial PRIMARY KEY,
    user_id      bigint NOT NULL REFERENCES users_user (id) DEFERRABLE INITIALLY DEFERRED,
    meditation_id bigint NOT NULL REFERENCES audios_meditation (id) DEFERRABLE INITIALLY DEFERRED,
    position     double precision NOT NULL,
    completed_at timestamptz NULL,
    created_at   timestamptz NOT NULL,
    updated_at   timestamptz NOT NULL,
    CONSTRAINT audios_meditationprogress_user_meditation_id_uniq UNIQUE (user_id, meditation_id)
);
CREATE INDEX IF NOT EXISTS audios_meditationprogress_meditation_id_idx ON audios_meditationprogress (meditation_id);

CREATE TABLE IF NOT EXISTS lives_liveprogress (
    id           bigserial PRIMARY KEY,
    user_id      bigint NOT NULL REFERENCES users_user (id) DEFERRABLE INITIALLY DEFERRED,
    live_id      bigint NOT NULL REFERENCES lives_live (id) DEFERRABLE INITIALLY DEFERRED,
    position     double precision NOT NULL,
    completed_at timestamptz NULL,
    created_at   timestamptz NOT NULL,
    updated_at   timestamptz NOT NULL,
    CONSTRAINT lives_liveprogress_user_live_id_uniq UNIQUE (user_id, live_id)
);
CREATE INDEX IF NOT EXISTS lives_liveprogress_live_id_idx ON lives_liveprogress (live_id);
