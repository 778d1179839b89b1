-- Reference copy of the monolith's tables that progress-service reads. The monolith owns them;
-- this file recreates them for tests and local runs. Re-runnable.
-- Foreign keys are DEFERRABLE INITIALLY DEFERRED, as Django creates them.

CREATE TABLE IF NOT EXISTS users_user (
    id          bigserial PRIMARY KEY,
    email       text        NOT NULL,
    date_joined timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS courses_lesson (
    id       bigserial PRIMARY KEY,
    title    text    NOT NULL,
    duration integer NOT NULL
);

CREATE TABLE IF NOT EXISTS audios_audio (
    id       bigserial PRIMARY KEY,
    title    text    NOT NULL,
    duration integer NOT NULL
);

CREATE TABLE IF NOT EXISTS audios_meditation (
    id       bigserial PRIMARY KEY,
    title    text    NOT NULL,
    duration integer NOT NULL
);

CREATE TABLE IF NOT EXISTS lives_live (
    id       bigserial PRIMARY KEY,
    title    text    NOT NULL,
    duration integer NOT NULL
);
