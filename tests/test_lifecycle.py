"""The shutdown order that keeps the guarantees, held on a real app run (service/app.py start_services)."""

from service.config import Settings
from tests.helpers import auth, running_app, seed


async def test_the_parts_stop_in_the_order_that_keeps_the_guarantees(settings: Settings, db, token: str) -> None:  # type: ignore[no-untyped-def]
    await seed(db, users=7)
    everything = settings.model_copy(
        update={
            "relay_enabled": True,
            "celery_broker_url": settings.redis_url,
            "progress_flusher_enabled": True,
            "content_catalog_enabled": True,
        }
    )
    async with running_app(everything) as (app, client):
        response = await client.post("/audios/progress", json={"audio_id": 1, "position": 3}, headers=auth(token))
        assert response.status_code == 201
        lifecycle = app.api.state.lifecycle
        assert lifecycle.stopped == []
    assert lifecycle.stopped == list(reversed(lifecycle.started))
    order = lifecycle.stopped.index
    # the heartbeat writes stop before the loops' last flush
    assert order("progress reader") < order("content catalog") < order("heartbeat sink") < order("background loops")
    # the last flush before the relay's final pass, which sends its completions
    assert order("background loops") < order("relay final pass") < order("celery publisher")
    # and all of it before the pool and Redis close
    assert order("celery publisher") < order("postgres pool") < order("readiness checks") < order("redis")
    assert lifecycle.stopped[-1] == "redis"
