"""The test clusters .ci/run starts (SLURM, Ray) in the background beside the install: CI_CLUSTERS names the folder of
each start's log and exit status. A test waits for its cluster's start (`cluster_started`).

The Ray cluster is stopped once the last test marked `ray_cluster` has run: idle, its daemons (two raylets, the GCS,
the dashboard and its agents, the log monitors) take ~4 s of CPU a minute, ~7% of one of CI's two cores, which the
rest of the suite then had to share with them to its end (measured 2026-11-29). The files that hold such tests are
handed out first (tests/conftest.py pytest_collection_modifyitems), so that it stops early. A test that asks for the
cluster after that fails, naming the mark it lacks. Only in CI: a cluster started by hand is left as it is.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

RAY_MARK = "ray_cluster"
STOP_RAY = [str(Path(__file__).resolve().parent.parent / "ray-cluster" / "test-cluster.sh"), "stop"]


def ci_folder() -> Path | None:
    folder = os.environ.get("CI_CLUSTERS")
    return Path(folder) if folder else None


def cluster_started(name: str) -> None:
    """Where .ci/run still starts test cluster `name` in the background (beside the install), wait for that start
    to end; fail, with its log, if it failed, or if the cluster was stopped as no test marked for it remained."""
    from conftest import wait_for

    folder = ci_folder()
    if folder is None:
        return
    status, log = folder / f"{name}.status", folder / f"{name}.log"
    wait_for(status.exists, timeout=900, what=f"the {name} test cluster's start ({log})", poll=1)
    if status.read_text().strip() != "0":
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
        pytest.fail(f"the {name} test cluster did not start (exit {status.read_text().strip()}; {log}):\n{tail}")
    if (folder / f"{name}.stopped").exists():
        pytest.fail(f"the {name} test cluster was stopped after the last test marked @pytest.mark.{RAY_MARK}: mark "
                    f"this test (or its module: pytestmark) so that it runs before the cluster stops")


def ray_tests(items: list[pytest.Item]) -> set[str]:
    """The ids of the collected tests that use the Ray cluster and will run."""
    return {item.nodeid for item in items if item.get_closest_marker(RAY_MARK) and not item.get_closest_marker("skip")}


def _done_file(folder: Path, nodeid: str) -> Path:
    return folder / "ray.done" / hashlib.sha1(nodeid.encode()).hexdigest()


def ray_test_done(nodeid: str, ray_nodeids: set[str]) -> None:
    """After each test: once every test of `ray_nodeids` has run, on whichever worker, stop the Ray cluster (once:
    the worker that creates ray.stopped does). Every worker collects the same tests, so each knows the whole set."""
    folder = ci_folder()
    if folder is None or nodeid not in ray_nodeids:
        return
    done = _done_file(folder, nodeid)
    done.parent.mkdir(exist_ok=True)
    done.touch()
    if not all(_done_file(folder, other).exists() for other in ray_nodeids):
        return
    try:
        os.close(os.open(folder / "ray.stopped", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    subprocess.run(STOP_RAY, capture_output=True, timeout=300)
