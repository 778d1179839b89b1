"""The linters ops would run: hadolint, the Compose specification schema, kubernetes-validate.

All three come with the `test` group and run offline (bundled binary, vendored schemas). What they
accept is their projects' business; what is tested here is that this repository's files pass them.
"""

import subprocess
from pathlib import Path

import pytest

from tests.deploy.files import COMPOSE_FILE, DOCKERFILE, K8S_DIR, VENV_BIN

MANIFESTS = sorted(K8S_DIR.glob("*.yaml")) + sorted(K8S_DIR.glob("split/*.yaml"))
# the oldest Kubernetes the manifests promise to work on, and the newest the tool knows
K8S_VERSIONS = ["1.27.0", None]


def _tool(name: str, *args: str | Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    executable = VENV_BIN / name
    if not executable.exists():
        pytest.fail(f"{name} is missing from {VENV_BIN}: install the test group (the README's test command)")
    return subprocess.run(
        [str(executable), *map(str, args)], input=stdin, capture_output=True, text=True, timeout=120, check=False
    )


def test_dockerfile_passes_hadolint() -> None:
    done = _tool("hadolint", "--failure-threshold", "style", DOCKERFILE)
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_file_matches_the_compose_specification() -> None:
    done = _tool("check-jsonschema", "--builtin-schema", "vendor.compose-spec", COMPOSE_FILE)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("version", K8S_VERSIONS, ids=lambda v: v or "latest")
def test_manifests_validate_against_the_kubernetes_schemas(version: str | None) -> None:
    assert len(MANIFESTS) >= 7
    version_args = ["--kubernetes-version", version] if version else []
    done = _tool("kubernetes-validate", "--strict", *version_args, *MANIFESTS)
    assert done.returncode == 0, done.stdout + done.stderr
