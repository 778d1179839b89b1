"""What the deployment files promise each other: probes, ports, grace period, resources, names."""

import re
from typing import Any

import pytest
import yaml

from service.cli import IN_FLIGHT_TIMEOUT_S
from service.config import Settings
from service.outbox.outboxes import publish_budget_s
from tests.deploy.files import (
    ALERTS_FILE,
    K8S_DIR,
    REPO,
    SERVE_VARIABLES,
    compose,
    dockerfile_stages,
    image,
    k8s,
    service_metrics,
    settings_variables,
)

DEPLOYMENTS = ["deployment.yaml", "split/deployment-flusher.yaml"]
_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m|Mi|Gi)?$")
_SCALE = {None: 1.0, "m": 0.001, "Mi": 2**20, "Gi": 2**30}


def _quantity(value: str | int) -> float:
    match = _QUANTITY.match(str(value))
    assert match, f"unexpected quantity {value!r}"
    return float(match.group(1)) * _SCALE[match.group(2)]


def _container(path: str) -> dict[str, Any]:
    containers = k8s(path)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def _config() -> dict[str, str]:
    data: dict[str, str] = k8s("configmap.yaml")["data"]
    return data


def test_image_is_multi_stage_slim_non_root_and_runs_serve() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2
    assert all("slim" in stage.base for stage in stages)
    final = image()
    assert final.cmd == ["progress-service", "serve"]
    assert final.stop_signal == "SIGTERM"
    assert "/health/live" in " ".join(final.healthcheck)
    uid = final.user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root USER lets Kubernetes check runAsNonRoot"
    assert {"HOST", "PORT", "WORKERS"} <= final.env.keys()
    assert final.expose == [final.env["PORT"]]
    installs = " ".join(run for stage in stages for run in stage.run)
    # from the lockfile, with the production extras only: no test or dev group, no embedded servers
    assert "uv sync --frozen" in installs and "--extra sqs" in installs and "--extra otel" in installs
    assert "--group" not in installs and "--all-groups" not in installs and "embedded" not in installs


def test_deployment_probes_ports_and_lifecycle() -> None:
    container = _container("deployment.yaml")
    (port,) = container["ports"]
    assert (port["name"], port["containerPort"]) == ("http", int(_config()["PORT"]))
    assert container["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "http"}
    # a pod must leave the load balancer before its process stops answering
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert "command" not in container and "args" not in container, "the image's CMD is the one tested"


def _worst_stop_s(env: dict[str, str]) -> float:
    """From SIGTERM to exit at worst, with these variables (the others at their defaults): the drain, the requests
    in flight, the final flush (the lifespan cancels the flusher 5 s after its timeout: service/app.py) and the
    relay's last pass."""

    def setting(name: str) -> float:
        return float(env.get(name, Settings.model_fields[name.lower()].default))

    return (
        setting("SHUTDOWN_DRAIN_SECONDS")
        + IN_FLIGHT_TIMEOUT_S
        + setting("PROGRESS_SHUTDOWN_TIMEOUT_SECONDS")
        + 5
        + publish_budget_s(setting("CELERY_PUBLISH_TIMEOUT_SECONDS"))
    )


@pytest.mark.parametrize("path", DEPLOYMENTS)
def test_grace_period_outlasts_the_prestop_pause_the_drain_and_the_final_flush(path: str) -> None:
    spec = k8s(path)["spec"]["template"]["spec"]
    container = _container(path)
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
    env = {**_config(), **{item["name"]: item["value"] for item in container.get("env", []) if "value" in item}}
    assert spec["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + _worst_stop_s(env)


@pytest.mark.parametrize("path", DEPLOYMENTS)
def test_resources_are_requested_and_limited(path: str) -> None:
    resources = _container(path)["resources"]
    for name in ("cpu", "memory"):
        request, limit = resources["requests"][name], resources["limits"][name]
        assert 0 < _quantity(request) <= _quantity(limit)
    # the benchmark's resident memory (under 150 MB) must fit the request
    assert _quantity(resources["requests"]["memory"]) >= 150 * 10**6


@pytest.mark.parametrize("path", DEPLOYMENTS)
def test_pods_run_as_the_image_user_with_config_and_secret(path: str) -> None:
    spec = k8s(path)["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert str(spec["securityContext"]["runAsUser"]) == image().user.split(":")[0]
    sources = {next(iter(source)): next(iter(source.values()))["name"] for source in _container(path)["envFrom"]}
    assert sources == {
        "configMapRef": k8s("configmap.yaml")["metadata"]["name"],
        "secretRef": k8s("secret.yaml")["metadata"]["name"],
    }


def test_service_pdb_and_hpa_point_at_the_api_pods() -> None:
    deployment = k8s("deployment.yaml")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = k8s("service.yaml")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    flusher_labels = k8s("split/deployment-flusher.yaml")["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= flusher_labels.items(), "flusher pods take no traffic"
    pdb = k8s("pdb.yaml")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    hpa = k8s("hpa.yaml")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert pdb["spec"]["maxUnavailable"] < hpa["spec"]["minReplicas"]


def test_every_variable_set_anywhere_is_one_the_service_reads() -> None:
    known = settings_variables() | SERVE_VARIABLES
    secret = k8s("secret.yaml")["stringData"]
    assert {"REDIS_URL", "DATABASE_URL", "JWT_SECRET"} <= secret.keys()
    assert all(value.count("REPLACE_ME") for value in secret.values()), "placeholders must look like placeholders"
    named = {
        "configmap.yaml": set(_config()),
        "secret.yaml": set(secret),
        **{path: {env["name"] for env in _container(path).get("env", [])} for path in DEPLOYMENTS},
        "docker-compose.yml": set(compose()["services"]["progress"]["environment"]),
        "Dockerfile": set(image().env) - {"PATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"},
    }
    for where, names in named.items():
        assert names <= known, f"{where} sets variables the service does not read: {sorted(names - known)}"


# one number in one place: their default is service/config.py's (and its doc row's) alone, the alerts read the
# interval the pods export; a deployment sets one only to change it
DEFAULT_ONLY = {"PROGRESS_FLUSH_INTERVAL_SECONDS", "PROGRESS_COMPLETION_MARGIN_SECONDS"}


def test_kubernetes_sets_every_variable_but_the_optional_public_key() -> None:
    deployment_env = {env["name"] for env in _container("deployment.yaml")["env"]}
    given = set(_config()) | set(k8s("secret.yaml")["stringData"]) | deployment_env
    assert not given & DEFAULT_ONLY, f"{sorted(given & DEFAULT_ONLY)}: a copy of the default in deploy/k8s"
    # RS256/ES256 only, and during a rotation only: secret.yaml says where
    missing = settings_variables() - given - {"JWT_PUBLIC_KEY", "JWT_PREVIOUS_SECRETS"} - DEFAULT_ONLY
    assert not missing, f"add to deploy/k8s/configmap.yaml (or secret.yaml): {sorted(missing)}"


def test_compose_stack_scales_behind_one_proxy_after_healthy_dependencies() -> None:
    services = compose()["services"]
    assert set(services) == {"progress", "proxy", "postgres", "redis"}
    for name, service in services.items():
        assert service["healthcheck"]["test"], f"{name} has no health check"
    progress = services["progress"]
    assert progress["build"] == "."
    assert "ports" not in progress, "a published port would clash under --scale"
    assert progress["depends_on"] == {
        "postgres": {"condition": "service_healthy"},
        "redis": {"condition": "service_healthy"},
    }
    assert "/health/ready" in " ".join(progress["healthcheck"]["test"])
    assert int(progress["stop_grace_period"].removesuffix("s")) >= _worst_stop_s(progress["environment"])
    assert "./migrations_ref:/docker-entrypoint-initdb.d:ro" in services["postgres"]["volumes"]
    assert "--appendonly" in services["redis"]["command"]
    proxy = services["proxy"]
    assert len(proxy["ports"]) == 1
    assert proxy["depends_on"] == {"progress": {"condition": "service_healthy"}}
    mount = next(volume for volume in proxy["volumes"] if volume.endswith(":/etc/nginx/nginx.conf:ro"))
    nginx_conf = (REPO / mount.split(":")[0]).read_text()
    assert f"http://progress:{progress['environment']['PORT']}" in nginx_conf
    assert "resolver 127.0.0.11" in nginx_conf, "re-resolving the service name is what makes --scale work"


def _sample_names() -> set[str]:
    """Every sample name the service can export: histograms add _bucket, _sum and _count."""
    names = set()
    for name, info in service_metrics().items():
        names.add(name)
        if info.type == "histogram":
            names |= {f"{name}_{suffix}" for suffix in ("bucket", "sum", "count")}
    return names


def test_alert_rules_use_metrics_that_exist() -> None:
    rules = [rule for group in yaml.safe_load(ALERTS_FILE.read_text())["groups"] for rule in group["rules"]]
    assert len(rules) >= 6
    exported = _sample_names()
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical")
        used = set(re.findall(r"\bprogress_[a-z_]+", rule["expr"]))
        assert used <= exported, f"{rule['alert']} uses unknown metrics {sorted(used - exported)}"
    alerts = {rule["alert"] for rule in rules}
    # the list: backlog growing, flush lag, expired values, readiness flapping (orphaned emails: none since
    # the relay is the only publisher)
    assert {
        "ProgressPendingBacklogGrowing",
        "ProgressFlushLagging",
        "ProgressPositionsExpired",
        "ProgressReadinessFlapping",
        "ProgressRedisMemoryHigh",
    } <= alerts


def test_redis_runs_bounded_and_never_evicts_positions() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    command = compose["services"]["redis"]["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert "--maxmemory" in command
    rule = next(
        rule
        for group in yaml.safe_load(ALERTS_FILE.read_text())["groups"]
        for rule in group["rules"]
        if rule["alert"] == "ProgressRedisMemoryHigh"
    )
    assert "progress_redis_used_memory_bytes" in rule["expr"] and "0.8" in rule["expr"]
    assert "maxmemory-policy noeviction" in (K8S_DIR / "README.md").read_text()


def test_k8s_readme_names_every_manifest() -> None:
    readme = (K8S_DIR / "README.md").read_text()
    for path in sorted(K8S_DIR.rglob("*.yaml")):
        assert f"`{path.relative_to(K8S_DIR)}`" in readme
