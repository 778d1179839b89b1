"""Programs from Debian's packages without installing them: Prometheus and promtool, HAProxy, libfaketime.

`apt-get download` of the package (and of the packages of the shared libraries it links that a bare host may lack),
then `dpkg-deb -x` of each into `.cache/<package>/` under the repository (gitignored), once, by one process at a time
(a file lock: the suite's workers may ask at once); later sessions reuse it. A program on PATH (the package installed
for real) is used as it is. A program that needs the unpacked libraries is started through a wrapper next to the
tree, `.cache/<package>/run/<program>`, which puts them on LD_LIBRARY_PATH and execs it (same process, same
signals). `.ci/run` calls this module too:

    .venv/bin/python -m tests.debian prometheus promtool     # prints the path of the program
"""

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache"
INSTALL_TIMEOUT_S = 300


@dataclass(frozen=True)
class Package:
    name: str
    programs: str  # where its programs are in the tree: usr/bin, usr/sbin
    libraries: tuple[str, ...] = ()  # packages of libraries it links that Debian's base image does not have

    @property
    def tree(self) -> Path:
        return CACHE / self.name


PROMETHEUS = Package("prometheus", "usr/bin")  # Debian 12: 2.42, with promtool; static Go programs
HAPROXY = Package(  # Debian 12: 2.6
    "haproxy", "usr/sbin", libraries=("liblua5.3-0", "libopentracing-c-wrapper0", "libopentracing1")
)
# not a program: the library a process is started with (LD_PRELOAD) to run on a shifted clock (FAKETIME=+1h)
LIBFAKETIME = Package("libfaketime", "usr/lib/x86_64-linux-gnu/faketime")  # Debian 12: 0.9.10
PACKAGES = {package.name: package for package in (PROMETHEUS, HAPROXY, LIBFAKETIME)}


class Unavailable(RuntimeError):
    pass


def program(package: Package, name: str) -> Path:
    """`name` of `package`: from PATH, else from the cache, fetched into it if missing."""
    found = shutil.which(name) or shutil.which(name, path=f"/{package.programs}")
    if found:
        return Path(found)
    unpacked = _launcher(package.tree, package, name)
    if not unpacked.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with open(CACHE / f"{package.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed, or when the process dies
            if not package.tree.exists():  # the process that held the lock may have unpacked it
                _extract(package, time.monotonic() + INSTALL_TIMEOUT_S)
    if not unpacked.exists():
        raise Unavailable(f"{unpacked} is missing after unpacking Debian's {package.name} package")
    return unpacked


def _launcher(tree: Path, package: Package, name: str) -> Path:
    return tree / "run" / name if package.libraries else tree / package.programs / name


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


def _extract(package: Package, deadline: float) -> None:
    """Download the .debs into a scratch dir, unpack them into one tree, then move it into place in one rename."""
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        raise Unavailable(f"neither {package.name} on PATH nor apt-get/dpkg-deb to fetch Debian's package")
    names = [package.name, *package.libraries]
    with tempfile.TemporaryDirectory(dir=CACHE, prefix=f"{package.name}-") as scratch:
        work = Path(scratch)
        # the first download works when the package lists are fresh; otherwise update them (root), then again
        done = _run(["apt-get", "download", "-q", *names], work, deadline)
        if done.returncode != 0 and os.geteuid() == 0:
            _run(["apt-get", "update", "-q"], work, deadline)
            done = _run(["apt-get", "download", "-q", *names], work, deadline)
        debs = [sorted(work.glob(f"{name}_*.deb")) for name in names]
        if done.returncode != 0 or not all(debs):
            raise Unavailable(
                f"apt-get download {' '.join(names)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            )
        tree = work / "tree"
        for deb in (found[-1] for found in debs):
            unpacked = _run(["dpkg-deb", "-x", str(deb), str(tree)], work, deadline)
            if unpacked.returncode != 0:
                raise Unavailable(f"dpkg-deb -x {deb.name} failed:\n{unpacked.stderr[-2000:]}")
        if package.libraries:
            _write_launchers(tree, package)
        tree.rename(package.tree)  # in one step: a tree in place is a whole one


def _write_launchers(tree: Path, package: Package) -> None:
    """A shell wrapper per program: the unpacked libraries first on LD_LIBRARY_PATH, then exec (paths once in place)."""
    libraries = ":".join(
        str(package.tree / path.relative_to(tree)) for path in sorted(tree.glob("usr/lib/*-linux-gnu"))
    )
    (tree / "run").mkdir()
    for path in sorted((tree / package.programs).iterdir()):
        launcher = tree / "run" / path.name
        launcher.write_text(
            "#!/bin/sh\n"
            f'LD_LIBRARY_PATH="{libraries}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" '
            f'exec "{package.tree / package.programs / path.name}" "$@"\n'
        )
        launcher.chmod(0o755)


if __name__ == "__main__":
    try:
        print(program(PACKAGES[sys.argv[1]], sys.argv[2]))
    except (Unavailable, KeyError, IndexError) as exc:
        print(f"usage: python -m tests.debian {'|'.join(PACKAGES)} PROGRAM ({exc})", file=sys.stderr)
        sys.exit(1)
