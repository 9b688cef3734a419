"""A user's project outside the package (their own data set and experiment) trains as it is. The mistakes in such a
project's data (an empty evaluation set, a batch larger than a replica's share, labels the model cannot score,
samples of different shapes with no collate function, ...) are rows of the catalogue, tests/conformance/test_mistakes.py,
refused before any process starts with the key and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


# A project's own launcher.py and train.py (and a data folder named train/, as many image sets have). Python's `-m`
# runs a module of the working directory first: `ddp-launch` and `python -P -m launcher` run ours there, and nothing
# of ours runs at an interpreter's start to second-guess the user's `python -m train` (docs/launching.md).
LAUNCHER_OF_THEIR_OWN = "open('their-launcher-ran', 'w').write('yes')\n"
TRAIN_OF_THEIR_OWN = "open('their-train-ran', 'w').write('yes')\n"


def test_beside_a_projects_own_launcher_py_ddp_launch_and_python_P_run_ours_and_never_theirs(tmp_path):
    write_project(tmp_path, {**FILES, "launcher.py": LAUNCHER_OF_THEIR_OWN, "train.py": TRAIN_OF_THEIR_OWN,
                             "data/train/images/0.png": ""})
    command = ["--config-dir", "conf", "+experiment=vectors", *FAST]
    ddp_launch = Path(sys.executable).parent / "ddp-launch"
    for name, argv in (("a", [str(ddp_launch)]), ("b", [sys.executable, "-P", "-m", "launcher"])):
        proc = subprocess.run([*argv, *command, f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "done: step 2 of 2" in proc.stdout  # the project's own modules (vectors.py) still load
    assert not (tmp_path / "their-launcher-ran").exists() and not (tmp_path / "their-train-ran").exists()


def test_a_projects_own_train_py_runs_as_python_runs_it_with_nothing_of_ours_at_start(tmp_path):
    """An install of this package ran a site hook at every Python start, which refused `python -m train` in any
    project with its own train.py (exit 2, telling the user to run our trainer)."""
    write_project(tmp_path, {"train.py": TRAIN_OF_THEIR_OWN})
    proc = subprocess.run([sys.executable, "-m", "train"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "their-train-ran").read_text() == "yes"
    ours = "{'launcher', 'train', 'ddp_loop', 'ddp_launcher_guard'}"
    site = subprocess.run([sys.executable, "-c", f"import sys; print(sorted(m for m in sys.modules if m.split('.')[0] "
                           f"in {ours}))"], cwd=tmp_path, capture_output=True, text=True)
    assert site.stdout.strip() == "[]"  # nothing of this package imported at an interpreter's start
