"""A user's project outside the package (their own data set and experiment) trains as it is. The mistakes in such a
project's data (an empty evaluation set, a batch larger than a replica's share, labels the model cannot score,
samples of different shapes with no collate function, ...) are rows of the catalogue, tests/conformance/test_mistakes.py,
refused before any process starts with the key and the fix."""

from __future__ import annotations

import pytest
from conftest import FAST, run_cli
from user_project import FILES, write_project


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    project = tmp_path_factory.mktemp("vectors")
    write_project(project, FILES)
    return project


def test_the_same_project_trains_when_nothing_is_wrong(project, tmp_path):
    proc = run_cli("launcher", "--config-dir", "conf", "+experiment=vectors", *FAST,
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=project, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done: step 2 of 2" in proc.stdout
    # What the experiment takes from the default job (the digits preset) without saying so, said at start.
    [inherited] = [line for line in proc.stdout.splitlines() if line.startswith("inherits")]
    assert "trainer.epochs=15, trainer.grad_clip=1.0, optim.lr=0.1, optim.schedule.warmup_epochs=1" in inherited
    assert "procs_per_node" not in inherited  # the experiment sets it
