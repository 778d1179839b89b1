"""Writes progress-service.json, the Grafana dashboard, next to this file: `python deploy/grafana/dashboard.py`.

Plain Python, no dependency: each panel is a title, a unit and its PromQL. Edit the panels here and
run the script again; tests/deploy/test_dashboard.py fails when the JSON and this script disagree, and
checks that every expression parses and names only metrics that /metrics serves.

Import: Grafana > Dashboards > New > Import > upload the JSON, then pick a Prometheus data source
(the `datasource` variable). Gauges of the flusher and of Redis describe shared state, the same on
every pod: they are aggregated with `max`, counters with `sum` (as in deploy/prometheus/alerts.yml).
"""

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("progress-service.json")
UID = "progress-service"
RATE = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# the data source picked on import or from the variable's drop-down
DATASOURCE_VARIABLE = {
    "type": "datasource",
    "name": "datasource",
    "label": "Prometheus",
    "query": "prometheus",
    "current": {},
    "hide": 0,
    "refresh": 1,
    "regex": "",
    "includeAll": False,
    "multi": False,
}
Target = tuple[str, str]  # (expr, legend)


def _target(ref: int, expr: str, legend: str) -> dict[str, Any]:
    return {
        "datasource": DATASOURCE,
        "refId": chr(ord("A") + ref),
        "expr": expr,
        "legendFormat": legend,
        "range": True,
        "editorMode": "code",
    }


def _panel(
    kind: str,
    title: str,
    description: str,
    unit: str,
    targets: list[Target],
    thresholds: list[tuple[str, float | None]] | None = None,
    mappings: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    steps = [{"color": color, "value": value} for color, value in (thresholds or [("green", None)])]
    panel: dict[str, Any] = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [_target(i, expr, legend) for i, (expr, legend) in enumerate(targets)],
        "fieldConfig": {
            "defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps}, "mappings": mappings or []},
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }
    if thresholds and kind == "timeseries":
        panel["fieldConfig"]["defaults"]["custom"] = {"thresholdsStyle": {"mode": "line"}}
    return panel


def graph(title: str, description: str, unit: str, *targets: Target, **options: Any) -> dict[str, Any]:
    return _panel("timeseries", title, description, unit, list(targets), **options)


def stat(title: str, description: str, unit: str, *targets: Target, **options: Any) -> dict[str, Any]:
    panel = _panel("stat", title, description, unit, list(targets), **options)
    panel["options"] = {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "colorMode": "background",
        "graphMode": "area",
        "textMode": "auto",
    }
    return panel


# fmt: off
ROWS: list[tuple[str, list[dict[str, Any]]]] = [
    ("Traffic", [
        graph("Heartbeats/s by route and status", "Requests answered on the progress routes.", "reqps",
              (f"sum by (route, status) (rate(progress_http_requests_total[{RATE}]))", "{{route}} {{status}}")),
        graph("4xx by reason", "Client errors by status (401 token, 404 unknown content, 408 slow body, 413, "
              "422 bad body) and the door's refusals by reason.", "reqps",
              (f'sum by (status) (rate(progress_http_requests_total{{status=~"4.."}}[{RATE}])) or vector(0)',
               "{{status}}"),
              (f"sum by (reason) (rate(progress_refused_total[{RATE}])) or vector(0)", "refused: {{reason}}")),
        graph("5xx", "Server errors per second and as a share of all answers (ProgressServerErrors: > 1 %).",
              "reqps",
              (f'sum by (route, status) (rate(progress_http_requests_total{{status=~"5.."}}[{RATE}])) or vector(0)',
               "{{route}} {{status}}")),
        graph("5xx share", "5xx answers over all answers; ProgressServerErrors fires over 1 % for 5 min.",
              "percentunit",
              (f'(sum(rate(progress_http_requests_total{{status=~"5.."}}[{RATE}])) or vector(0))'
               f" / sum(rate(progress_http_requests_total[{RATE}]))", "5xx share"),
              thresholds=[("green", None), ("red", 0.01)]),
        graph("Heartbeat write p50 / p99", "The request path's Redis write (one pipeline for one or more "
              "heartbeats), the heartbeat's latency budget. No whole-request histogram is exported.", "s",
              (f"histogram_quantile(0.5, sum by (le) (rate(progress_redis_write_seconds_bucket[{RATE}])))", "p50"),
              (f"histogram_quantile(0.99, sum by (le) (rate(progress_redis_write_seconds_bucket[{RATE}])))", "p99")),
        graph("Heartbeats per Redis round trip (p50 / p99)", "Batching of concurrent heartbeats into one pipeline.",
              "short",
              (f"histogram_quantile(0.5, sum by (le) (rate(progress_redis_write_batch_size_bucket[{RATE}])))",
               "p50"),
              (f"histogram_quantile(0.99, sum by (le) (rate(progress_redis_write_batch_size_bucket[{RATE}])))",
               "p99")),
    ]),
    ("Buffer", [
        graph("Pending", "Members waiting in the pending sets (ProgressPendingBacklogGrowing: > 10 000 and "
              "growing).", "short",
              ("max by (content_type) (progress_pending_entries)", "{{content_type}}"),
              thresholds=[("green", None), ("orange", 10000)]),
        graph("In flight", "Claimed by a flusher, not yet acked; stays high when flushers die mid-batch.", "short",
              ("max by (content_type) (progress_in_flight_entries)", "{{content_type}}")),
        graph("Redis memory, % of maxmemory", "Redis refuses buffer writes when full (noeviction); "
              "ProgressRedisMemoryHigh fires over 80 %. Empty when Redis runs without maxmemory.", "percentunit",
              ("max(progress_redis_used_memory_bytes) / max(progress_redis_maxmemory_bytes > 0)", "used / max"),
              thresholds=[("green", None), ("orange", 0.8), ("red", 0.95)]),
        graph("Redis memory", "used_memory and maxmemory (0: no limit set).", "bytes",
              ("max(progress_redis_used_memory_bytes)", "used"),
              ("max(progress_redis_maxmemory_bytes)", "maxmemory")),
        stat("Degraded mode", "1 while heartbeats go straight to Postgres because Redis is unreachable "
             "(ProgressDegradedMode).", "none",
             ("max(progress_degraded_mode)", "degraded"),
             thresholds=[("green", None), ("red", 1)],
             mappings=[{"type": "value", "options": {"0": {"text": "normal"}, "1": {"text": "DEGRADED"}}}]),
        stat("Redis persistence", "1 while Redis keeps neither an AOF nor RDB saves: a restart would lose every "
             "position not yet flushed (ProgressRedisPersistenceOff). `progress-service status` says more.", "none",
             ('max(progress_redis_persistence{mode="none"})', "no persistence"),
             thresholds=[("green", None), ("red", 1)],
             mappings=[{"type": "value", "options": {"0": {"text": "AOF or RDB"}, "1": {"text": "NONE"}}}]),
        graph("Degraded writes and Redis write errors", "Heartbeats written straight to Postgres, and heartbeats "
              "whose Redis write failed (ProgressRedisWritesFailing).", "reqps",
              (f"sum by (content_type) (rate(progress_degraded_writes_total[{RATE}])) or vector(0)",
               "degraded {{content_type}}"),
              (f"sum by (content_type) (rate(progress_redis_write_errors_total[{RATE}])) or vector(0)",
               "write errors {{content_type}}")),
    ]),
    ("Flush", [
        graph("Rows/s", "Progress rows inserted or moved forward in the monolith's tables.", "rowsps",
              (f"sum by (content_type) (rate(progress_flush_rows_total[{RATE}]))", "{{content_type}}")),
        graph("Completions/s", "Completion events created by the flush.", "ops",
              (f"sum by (content_type) (rate(progress_flush_completions_total[{RATE}]))", "{{content_type}}")),
        graph("Lag p50 / p99", "Flush time minus the receive time of a batch's oldest heartbeat "
              "(ProgressFlushLagHigh: p99 over two flush intervals for 10 min). Offline syncs count their offline "
              "age.", "s",
              (f"histogram_quantile(0.5, sum by (le) (rate(progress_flush_lag_seconds_bucket[{RATE}])))", "p50"),
              (f"histogram_quantile(0.99, sum by (le) (rate(progress_flush_lag_seconds_bucket[{RATE}])))", "p99"),
              ("2 * max(progress_flush_interval_seconds)", "two flush intervals")),
        stat("Age of the last clean flush", "Since a flush cycle last finished with no failed batch, in flush "
             "intervals (PROGRESS_FLUSH_INTERVAL_SECONDS; ProgressFlushLagging: over 2).", "short",
             ("(time() - max(progress_flush_last_success_timestamp_seconds))"
              " / max(progress_flush_interval_seconds)", "intervals"),
             thresholds=[("green", None), ("orange", 2), ("red", 5)]),
        graph("Failures", "Batches the database refused (requeued), cycles ended by a bug, positions expired "
              "unflushed (lost), entries requeued, heartbeats dropped for unknown users or content, entries "
              "left pending because another session held a row they need (the log names it).", "short",
              (f"sum(increase(progress_flush_failed_batches_total[{RATE}])) or vector(0)", "failed batches"),
              (f"sum(increase(progress_flush_cycle_errors_total[{RATE}]))", "cycle errors"),
              (f"sum(increase(progress_flush_expired_total[{RATE}])) or vector(0)", "expired (lost)"),
              (f"sum(increase(progress_flush_requeued_total[{RATE}]))", "requeued"),
              (f"sum(increase(progress_flush_dropped_total[{RATE}])) or vector(0)", "dropped"),
              (f"sum(increase(progress_flush_locked_total[{RATE}])) or vector(0)", "left pending: row locked")),
        graph("Batch time p99", "Time to persist one upsert batch in Postgres.", "s",
              ("histogram_quantile(0.99, sum by (le, content_type) "
               f"(rate(progress_flush_batch_seconds_bucket[{RATE}])))", "{{content_type}}")),
        graph("Backlog drain time", "Pending and in-flight entries over the rate they drain at: the write budget "
              "(PROGRESS_FLUSH_MAX_ROWS_PER_SECOND), or without one a pod's own measured rate "
              "(ProgressFlushDrainSlow: over 600 s for 15 min).", "s",
              ("max(progress_flush_drain_seconds)", "drain time"),
              thresholds=[("green", None), ("orange", 600)]),
        graph("Budget waits", "Seconds per second the flush drains and degraded mode spent waiting for the fleet's "
              "write budget: near the drains' number, the budget is what limits the flush. Local share: batches "
              "kept to budget / PROGRESS_FLEET_MAX_PODS because Redis could not take the fleet's budget.", "s",
              (f"sum(rate(progress_flush_budget_wait_seconds_total[{RATE}]))", "waiting"),
              (f"sum(rate(progress_flush_budget_fallback_total[{RATE}]))", "local share (batches/s)")),
    ]),
    ("Outbox", [
        graph("Owed and parked", "Messages committed and not yet published (owed), and those refused "
              "OUTBOX_MAX_ATTEMPTS times (parked: `progress-service outbox list --parked`).", "short",
              ("max by (outbox) (progress_outbox_owed_messages)", "owed {{outbox}}"),
              ("max by (outbox) (progress_outbox_parked_messages)", "parked {{outbox}}")),
        graph("Oldest owed age", "Age of the oldest row still owed to the broker, per outbox "
              "(ProgressOutboxLagging: over 300 s).", "s",
              ("max by (outbox) (progress_outbox_oldest_unpublished_age_seconds)", "{{outbox}}"),
              thresholds=[("green", None), ("red", 300)]),
        graph("Published/s", "Messages the broker acknowledged, republishes included.", "ops",
              (f"sum by (outbox) (rate(progress_outbox_published_total[{RATE}]))", "{{outbox}}")),
        graph("Republished, retried and parked", "Republished with the same task id after a relay died before "
              "marking; retried: refused, sent again after a backoff; parked: refused OUTBOX_MAX_ATTEMPTS times "
              "(ProgressOutboxMessagesRefused; `progress-service outbox list --parked`).", "short",
              (f"sum by (outbox) (increase(progress_outbox_republished_total[{RATE}]))", "republished {{outbox}}"),
              (f"sum by (outbox) (increase(progress_outbox_retried_total[{RATE}]))", "retried {{outbox}}"),
              (f"sum by (outbox) (increase(progress_outbox_failed_total[{RATE}]))", "parked {{outbox}}")),
        graph("Relay errors and broker outages", "Relay passes ended by a bug (ProgressOutboxRelayErrors) and "
              "batches stopped because the broker was unreachable.", "short",
              (f"sum(increase(progress_outbox_relay_errors_total[{RATE}]))", "relay errors"),
              (f"sum by (outbox) (increase(progress_outbox_broker_unavailable_total[{RATE}]))",
               "broker unavailable {{outbox}}")),
    ]),
    ("Trial emails", [
        graph("Reserved and published", "Trial-journey emails reserved, and published by the outbox relay "
              "(the only publisher); published should track reserved.", "short",
              (f"sum(increase(progress_trial_email_reservations_total[{RATE}]))", "reserved"),
              (f"sum(increase(progress_outbox_published_total{{outbox=\"email\"}}[{RATE}]))", "published")),
        graph("Sweeps by outcome", "Periodic sweeps: done, failed, locked (another pod was sweeping).", "short",
              (f"sum by (outcome) (increase(progress_trial_journey_sweeps_total[{RATE}]))", "{{outcome}}")),
    ]),
    ("Door", [
        graph("Refusals by reason", "Heartbeats refused before any write: unknown_content (404), "
              "body_timeout (408).", "reqps",
              (f"sum by (reason) (rate(progress_refused_total[{RATE}]))", "{{reason}}")),
        graph("Tokens of a previous key", "Requests whose token a previous key verified (JWT_PREVIOUS_SECRETS, "
              "a later PEM block of JWT_PUBLIC_KEY): at 0 for a day, the previous key can go.", "reqps",
              (f"sum(rate(progress_auth_previous_key_total[{RATE}]))", "previous key")),
        graph("Catalog size", "Content ids in the catalog snapshot (8 bytes each in memory).", "short",
              ("max by (content_type) (progress_catalog_known_ids)", "{{content_type}}")),
        stat("Catalog snapshot age", "Since the catalog snapshot was last loaded.", "s",
             ("time() - max(progress_catalog_last_refresh_timestamp_seconds)", "age")),
        graph("Accepted unverified", "Heartbeats for ids not in the snapshot accepted unchecked because their "
              "lookup failed or timed out.", "reqps",
              (f"sum by (content_type) (rate(progress_catalog_unverified_total[{RATE}]))", "{{content_type}}")),
    ]),
]
# fmt: on

WIDTH = {"timeseries": 8, "stat": 4}
HEIGHT = 8


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    for title, row in ROWS:
        panels.append(
            {
                "type": "row",
                "title": title,
                "collapsed": False,
                "panels": [],
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            }
        )
        y += 1
        x = 0
        for panel in row:
            width = WIDTH[panel["type"]]
            if x + width > 24:
                x, y = 0, y + HEIGHT
            panel["gridPos"] = {"h": HEIGHT, "w": width, "x": x, "y": y}
            x += width
        y += HEIGHT
        panels.extend(row)
    for i, panel in enumerate(panels, start=1):
        panel["id"] = i
    return {
        "uid": UID,
        "title": "progress-service",
        "description": "Heartbeat ingestion, the Redis buffer, the flush to Postgres, the outboxes, trial emails "
        "and the door. Alerts: deploy/prometheus/alerts.yml; what to do: docs/runbook.md.",
        "tags": ["progress-service"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "schemaVersion": 39,
        "version": 1,
        "templating": {"list": [DATASOURCE_VARIABLE]},
        "annotations": {"list": []},
        "links": [],
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
