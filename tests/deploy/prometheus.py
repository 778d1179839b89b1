"""Prometheus and promtool from Debian's `prometheus` package, without installing it.

`apt-get download prometheus` then `dpkg-deb -x` into `.cache/prometheus/` under the repository
(gitignored), once; later sessions reuse it. A `prometheus`/`promtool` on PATH (the package
installed for real) is used as it is. `.ci/run` calls this module too:

    .venv/bin/python -m tests.deploy.prometheus promtool     # prints the path of the binary
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "prometheus"
PACKAGE = "prometheus"  # Debian 12: 2.42, with promtool
INSTALL_TIMEOUT_S = 300


class Unavailable(RuntimeError):
    pass


def _run(command: list[str], cwd: Path, deadline: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(
        command,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=max(deadline - time.monotonic(), 1),
    )


def _extract(deadline: float) -> None:
    """Download the .deb into a scratch dir, unpack it, then move the tree into place in one rename."""
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        raise Unavailable("neither prometheus on PATH nor apt-get/dpkg-deb to fetch Debian's package")
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE.parent, prefix="prometheus-") as scratch:
        work = Path(scratch)
        # the first download works when the package lists are fresh; otherwise update them (root), then again
        done = _run(["apt-get", "download", "-q", PACKAGE], work, deadline)
        if done.returncode != 0 and os.geteuid() == 0:
            _run(["apt-get", "update", "-q"], work, deadline)
            done = _run(["apt-get", "download", "-q", PACKAGE], work, deadline)
        debs = sorted(work.glob(f"{PACKAGE}_*.deb"))
        if done.returncode != 0 or not debs:
            raise Unavailable(f"apt-get download {PACKAGE} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        tree = work / "tree"
        unpacked = _run(["dpkg-deb", "-x", str(debs[-1]), str(tree)], work, deadline)
        if unpacked.returncode != 0:
            raise Unavailable(f"dpkg-deb -x failed:\n{unpacked.stderr[-2000:]}")
        if CACHE.exists():  # another session got there first
            return
        tree.rename(CACHE)


def binary(name: str) -> Path:
    """`prometheus` or `promtool`: from PATH, else from the cache, fetched into it if missing."""
    found = shutil.which(name)
    if found:
        return Path(found)
    cached = CACHE / "usr" / "bin" / name
    if not cached.exists():
        _extract(time.monotonic() + INSTALL_TIMEOUT_S)
    if not cached.exists():
        raise Unavailable(f"{cached} is missing after unpacking Debian's {PACKAGE} package")
    return cached


if __name__ == "__main__":
    try:
        print(binary(sys.argv[1] if len(sys.argv) > 1 else "promtool"))
    except Unavailable as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
