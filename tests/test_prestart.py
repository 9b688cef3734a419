"""A user's project outside the package (their own data set and experiment) trains as it is. The mistakes in such a
project's data (an empty evaluation set, a batch larger than a replica's share, labels the model cannot score,
samples of different shapes with no collate function, ...) are rows of the catalogue, tests/conformance/test_mistakes.py,
refused before any process starts with the key and the fix."""

from __future__ import annotations

import subprocess
import sys

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


# A project's own launcher.py (and a data folder named train/, as many image sets have): `python -m launcher` and
# `python -m train` would import them before any code of ours runs. The install's site hook (installer/) says so.
LAUNCHER_OF_THEIR_OWN = "open('their-launcher-ran', 'w').write('yes')\n"


def test_a_projects_own_launcher_py_is_never_run_and_the_advice_given_trains(tmp_path):
    write_project(tmp_path, {**FILES, "launcher.py": LAUNCHER_OF_THEIR_OWN, "train/images/0.png": ""})
    command = ["--config-dir", "conf", "+experiment=vectors", *FAST, f"hydra.run.dir={tmp_path / 'run'}"]
    refused = run_cli("launcher", *command, cwd=tmp_path, timeout=60)
    assert refused.returncode == 2 and not (tmp_path / "their-launcher-ran").exists()
    assert f"would run {tmp_path / 'launcher.py'}, which is yours" in refused.stderr
    assert f"`ddp-launch {' '.join(command)}`" in refused.stderr and "python -P -m launcher" in refused.stderr
    assert not (tmp_path / "run").exists()
    refused = run_cli("train", str(tmp_path / "run" / "config.yaml"), cwd=tmp_path, timeout=60)
    assert refused.returncode == 2 and f"would run {tmp_path / 'train'}, which is yours" in refused.stderr
    # The advice: -P keeps the directory from coming first; the project's own modules (vectors.py) still load.
    proc = subprocess.run([sys.executable, "-P", "-m", "launcher", *command], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done: step 2 of 2" in proc.stdout and not (tmp_path / "their-launcher-ran").exists()


@pytest.mark.parametrize("argv, expected", [
    (["python", "-m", "launcher", "a=1"], ("launcher", ["a=1"])),
    (["python", "-X", "importtime", "-u", "-m", "launcher.jobs", "status"], ("launcher.jobs", ["status"])),
    (["python", "-Ximporttime", "-Bmtrain", "c.yaml"], ("train", ["c.yaml"])),
    (["python", "-W", "ignore", "-m", "train"], ("train", [])),
    (["python", "-c", "pass", "-m", "launcher"], None),  # -c's own arguments
    (["python", "script.py", "-m", "launcher"], None),  # the script's
    (["python", "-m"], None),
])
def test_the_site_hook_reads_which_module_a_command_runs(argv, expected):
    import ddp_launcher_guard  # installed beside the packages (installer/backend.py)

    assert ddp_launcher_guard.module_run(argv) == expected


def test_another_checkout_of_this_project_is_not_taken_for_a_users_launcher(tmp_path):
    """A git worktree beside the installed checkout runs its own launcher/, as it did before the hook."""
    import ddp_launcher_guard

    (tmp_path / "launcher").mkdir()
    assert ddp_launcher_guard.shadowing("launcher", str(tmp_path), ours=str(tmp_path / "installed")) == str(tmp_path / "launcher")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "ddp-launcher"\n')
    assert ddp_launcher_guard.shadowing("launcher", str(tmp_path), ours=str(tmp_path / "installed")) is None
