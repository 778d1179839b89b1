"""The baseline of bench_ingest.py: the straightforward FastAPI endpoint, same routes, keys, values and answer.

Per request: FastAPI parses the body into a pydantic model, a `Depends` dependency verifies the HS256 JWT with PyJWT
(no cache), then two Redis round trips: SET the latest position, SADD the pending member.
    REDIS_URL=redis://127.0.0.1:6379/1 JWT_SECRET=... python bench/baseline_app.py --port 8001
"""

import argparse
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated

import jwt
import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Request, status
from pydantic import BaseModel, Field, create_model
from redis.asyncio import Redis

TTL_S = 3600
JWT_SECRET = os.environ.get("JWT_SECRET", "")
ContentId = Annotated[int, Field(ge=1, le=2**63 - 1)]
Position = Annotated[float, Field(ge=0, le=86_400, allow_inf_nan=False)]
ROUTES = {"lesson": "/engagements/progress/lesson", "audio": "/audios/progress",
          "meditation": "/meditations/progress", "live": "/lives/progress"}  # fmt: skip


async def current_user(authorization: Annotated[str | None, Header()] = None) -> int:
    if authorization is None or not authorization.startswith("Bearer "):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing bearer token")
    try:
        claims = jwt.decode(authorization[7:], JWT_SECRET, algorithms=["HS256"], options={"require": ["exp"]})
        return int(claims["user_id"])
    except (jwt.InvalidTokenError, KeyError, TypeError, ValueError) as exc:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, f"invalid token: {exc}") from None


@asynccontextmanager
async def lifespan(api: FastAPI) -> AsyncIterator[None]:
    api.state.redis = Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/1"))
    try:
        yield
    finally:
        await api.state.redis.aclose()


app = FastAPI(title="progress baseline", lifespan=lifespan, docs_url=None, redoc_url=None)


def route(content_type: str) -> Callable[..., Awaitable[dict[str, bool]]]:
    """The endpoint of one content type: its own body model (`{type}_id`, `position`), as a hand-written one."""
    field = f"{content_type}_id"
    model: type[BaseModel] = create_model(f"{content_type.title()}Progress", **{field: ContentId, "position": Position})

    async def endpoint(
        body: model,
        user_id: Annotated[int, Depends(current_user)],  # type: ignore[valid-type]
        request: Request,
    ) -> dict[str, bool]:
        redis: Redis = request.app.state.redis
        content_id, received_ms = getattr(body, field), time.time_ns() // 1_000_000
        key = f"progress:latest_position:{content_type}:{content_id}:{user_id}"
        await redis.set(key, f"{body.position!r}:{received_ms}", ex=TTL_S)  # type: ignore[attr-defined]
        await redis.sadd(f"progress:pending_flush:{content_type}", f"{content_id}:{user_id}")
        return {"data": True}

    return endpoint


for name, path in ROUTES.items():
    app.post(path, status_code=201)(route(name))


@app.get("/health/live")
async def live() -> dict[str, str]:
    return {"status": "ok"}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args()
    if len(JWT_SECRET) < 32:
        parser.error("set JWT_SECRET (at least 32 characters) in the environment")
    options = {"loop": "uvloop", "http": "httptools", "access_log": False, "server_header": False}
    uvicorn.run(app, host=args.host, port=args.port, workers=1, log_level="warning", **options)
