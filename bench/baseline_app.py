"""The baseline the ingest fast path is measured against: the straightforward FastAPI endpoint.

Per request: FastAPI parses the body into a pydantic model, a `Depends` dependency verifies the
HS256 JWT with PyJWT (no cache), then two awaits, two Redis round trips: SET the latest position,
SADD the pending member. Same routes, keys, values and answer (201 {"data": true}) as the service.

    REDIS_URL=redis://127.0.0.1:6379/1 JWT_SECRET=... python bench/baseline_app.py --port 8001
"""

import argparse
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

import jwt
import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Request, status
from pydantic import BaseModel, Field
from redis.asyncio import Redis

TTL_S = 3600
ContentId = Annotated[int, Field(ge=1, le=2**63 - 1)]
Position = Annotated[float, Field(ge=0, le=86_400, allow_inf_nan=False)]


class LessonProgress(BaseModel):
    lesson_id: ContentId
    position: Position


class AudioProgress(BaseModel):
    audio_id: ContentId
    position: Position


class MeditationProgress(BaseModel):
    meditation_id: ContentId
    position: Position


class LiveProgress(BaseModel):
    live_id: ContentId
    position: Position


JWT_SECRET = os.environ.get("JWT_SECRET", "")


async def current_user(authorization: Annotated[str | None, Header()] = None) -> int:
    if authorization is None or not authorization.startswith("Bearer "):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing bearer token")
    try:
        claims = jwt.decode(
            authorization[len("Bearer ") :], JWT_SECRET, algorithms=["HS256"], options={"require": ["exp"]}
        )
        return int(claims["user_id"])
    except (jwt.InvalidTokenError, KeyError, TypeError, ValueError) as exc:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, f"invalid token: {exc}") from None


User = Annotated[int, Depends(current_user)]


@asynccontextmanager
async def lifespan(api: FastAPI) -> AsyncIterator[None]:
    redis = Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/1"))
    api.state.redis = redis
    try:
        yield
    finally:
        await redis.aclose()


app = FastAPI(title="progress baseline", lifespan=lifespan, docs_url=None, redoc_url=None)


async def store(request: Request, content_type: str, content_id: int, user_id: int, position: float) -> None:
    redis: Redis = request.app.state.redis
    received_ms = time.time_ns() // 1_000_000
    key = f"progress:latest_position:{content_type}:{content_id}:{user_id}"
    await redis.set(key, f"{position!r}:{received_ms}", ex=TTL_S)
    await redis.sadd(f"progress:pending_flush:{content_type}", f"{content_id}:{user_id}")


@app.post("/engagements/progress/lesson", status_code=201)
async def lesson_progress(body: LessonProgress, user_id: User, request: Request) -> dict[str, bool]:
    await store(request, "lesson", body.lesson_id, user_id, body.position)
    return {"data": True}


@app.post("/audios/progress", status_code=201)
async def audio_progress(body: AudioProgress, user_id: User, request: Request) -> dict[str, bool]:
    await store(request, "audio", body.audio_id, user_id, body.position)
    return {"data": True}


@app.post("/meditations/progress", status_code=201)
async def meditation_progress(body: MeditationProgress, user_id: User, request: Request) -> dict[str, bool]:
    await store(request, "meditation", body.meditation_id, user_id, body.position)
    return {"data": True}


@app.post("/lives/progress", status_code=201)
async def live_progress(body: LiveProgress, user_id: User, request: Request) -> dict[str, bool]:
    await store(request, "live", body.live_id, user_id, body.position)
    return {"data": True}


@app.get("/health/live")
async def live() -> dict[str, str]:
    return {"status": "ok"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args()
    if len(JWT_SECRET) < 32:
        parser.error("set JWT_SECRET (at least 32 characters) in the environment")
    uvicorn.run(app, host=args.host, port=args.port, workers=1, loop="uvloop", http="httptools",
                access_log=False, log_level="warning", server_header=False)  # fmt: skip


if __name__ == "__main__":
    main()
