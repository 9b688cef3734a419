"""Bring your own model, data and task: a project outside the package (examples/diabetes: a residual MLP that is
not an nn.Sequential, a data set that reads each sample from its own file, a Huber task), launched from its own
directory, which also holds a train.py, models.py and data.py. Real processes, gloo."""

from __future__ import annotations

import json
import re
import runpy
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO, final_checkpoint, read_metrics, run_cli, run_commands, signalled_launch

EXAMPLE = REPO / "examples" / "diabetes"
# Deterministic runs for the identities: no augmentation noise, no loader workers (they are tested below).
PLAIN = ["--config-dir", "conf", "+experiment=diabetes", "trainer.progress=lines", "trainer.threads=1",
         "data.train.noise=0", "data.num_workers=0", "trainer.eval_every=0", "trainer.max_steps=12"]
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def make_project(directory, eval_samples: int = 88):
    generated = lambda where, names: [n for n in names if n == "__pycache__" or (where == str(EXAMPLE) and n == "data")]  # noqa: E731
    shutil.copytree(EXAMPLE, directory, ignore=generated)
    subprocess.run([sys.executable, "prepare.py", "--eval-samples", str(eval_samples)], cwd=directory, check=True,
                   capture_output=True)
    assert (directory / "train.py").exists() and (directory / "models.py").exists()  # the names that could clash
    return directory


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("byo") / "project")


def launch_in(project, *overrides, timeout: float = 300):
    return run_cli("launcher", *overrides, cwd=project, timeout=timeout)


def test_a_users_model_trains_under_ddp_and_fsdp_with_the_data_parallel_identity(project, tmp_path):
    runs = {
        "one": ["trainer.procs_per_node=1", "data.batch_size=32"],
        "ddp": ["trainer.procs_per_node=2", "data.batch_size=16"],
        "fsdp": ["trainer.procs_per_node=2", "data.batch_size=16", "trainer.strategy=fsdp"],
    }
    for name, overrides in runs.items():
        proc = launch_in(project, *PLAIN, *overrides, f"hydra.run.dir={tmp_path / name}")
        assert proc.returncode == 0, f"{name} failed"
    one, ddp, fsdp = (final_checkpoint(tmp_path / n)["model"] for n in runs)
    assert any(k.startswith("blocks.") for k in one)  # the user's module, under its own names
    for name, expected in one.items():
        torch.testing.assert_close(ddp[name], expected, **TOLERANCE, msg=f"ddp 2 x 16: {name} differs from 1 x 32")
        torch.testing.assert_close(fsdp[name], ddp[name], **TOLERANCE, msg=f"fsdp: {name} differs from ddp")
    initial = read_metrics(tmp_path / "one")
    assert [r for r in initial if r["kind"] == "eval"][-1]["mse"] < 1.0  # it learned (the targets' variance is 1)
    # The project's own lr schedule (schedules.linear_decay, called with this plan's lengths) set the lr.
    plan = json.loads((tmp_path / "one" / "plan.json").read_text())
    factor = runpy.run_path(str(project / "schedules.py"))["linear_decay"](
        warmup_epochs=1, final=0.1, steps_per_epoch=plan["steps_per_epoch"], total_steps=plan["total_steps"])
    logged = {r["step"]: r["lr"] for r in initial if r["kind"] == "train"}
    assert logged and all(lr == pytest.approx(plan["lr"] * factor(step), rel=1e-9) for step, lr in logged.items())
    assert len({round(lr, 12) for lr in logged.values()}) == len(logged)  # it moves


def test_mse_at_world_size_3_equals_one_process_on_101_samples(tmp_path):
    project = make_project(tmp_path / "project", eval_samples=101)
    results = {}
    for world, batch in ((1, 24), (3, 8)):  # the same global batch: the same weights after the step
        run_dir = tmp_path / f"world{world}"
        proc = launch_in(project, *PLAIN, f"trainer.procs_per_node={world}", f"data.batch_size={batch}",
                         "trainer.max_steps=1", "data.eval_batch_size=16", f"hydra.run.dir={run_dir}")
        assert proc.returncode == 0
        [results[world]] = [r for r in read_metrics(run_dir) if r["kind"] == "eval"]
    # 101 samples over 3 ranks (34, 34, 33): a padded sampler would count one twice and move the MSE by ~1%.
    assert results[3]["mse"] == pytest.approx(results[1]["mse"], rel=1e-6)
    assert results[3]["loss"] == pytest.approx(results[1]["loss"], rel=1e-6)


def assert_resume_is_bitwise(project, run: list[str], directory, stop: int, end: int):
    """`end` steps straight, and `stop` steps then a resume to `end`: the same weights, bit for bit."""
    assert launch_in(project, *run, f"trainer.max_steps={end}", f"hydra.run.dir={directory / 'straight'}").returncode == 0
    assert launch_in(project, *run, f"trainer.max_steps={stop}", f"hydra.run.dir={directory / 'split'}").returncode == 0
    stopped = final_checkpoint(directory / "split")
    resumed = launch_in(project, *run, f"trainer.max_steps={end}", f"hydra.run.dir={directory / 'split'}")
    assert resumed.returncode == 0 and f"resumed at step {stop}" in resumed.stdout
    a, b = final_checkpoint(directory / "straight"), final_checkpoint(directory / "split")
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"{name} differs after resume"
    return stopped, resumed


def test_resume_mid_epoch_with_loader_workers_and_augmentation_is_bitwise(project, tmp_path):
    run = ["--config-dir", "conf", "+experiment=diabetes", "trainer.progress=lines", "trainer.threads=1",
           "data.num_workers=2", "data.train.noise=0.1", "model.dropout=0.1", "data.batch_size=16", "trainer.eval_every=0"]
    # 354 samples, 2 ranks x 16: 11 steps per epoch; stopping at 16 leaves epoch 1 half done. Dropout draws from
    # the training's own random stream, which the loader must leave alone.
    assert_resume_is_bitwise(project, run, tmp_path, stop=16, end=22)
    noisy = launch_in(project, *run, "data.train.noise=0.2", "trainer.max_steps=6", f"hydra.run.dir={tmp_path / 'other'}")
    assert noisy.returncode == 0  # and the noise really is applied: other noise, other weights
    assert not torch.equal(final_checkpoint(tmp_path / "other")["model"]["head.weight"],
                           final_checkpoint(tmp_path / "straight")["model"]["head.weight"])


# Limits well inside the test's own timeout (300 s): a hang (a loader worker that never answers, once, in a parallel
# run) is reported with every rank's stacks instead of being killed silently by the test's timeout.
STREAM = ["--config-dir", "conf", "+experiment=diabetes", "data=diabetes_stream", "trainer.progress=lines",
          "trainer.threads=1", "data.num_workers=2", "data.train.noise=0.1", "model.dropout=0.1", "data.batch_size=16",
          "trainer.eval_every=0", "trainer.hang_timeout_s=60", "trainer.timeout_s=60"]


def test_a_stream_resumes_mid_epoch_bitwise_from_its_saved_position(project, tmp_path):
    """An IterableDataset with state_dict/load_state_dict, 2 loader workers per rank, noise drawn in the workers;
    under fsdp, so the positions travel in a sharded checkpoint's step directory (the fast-forward test below
    covers a single file)."""
    run = [*STREAM, "trainer.strategy=fsdp"]
    stopped, resumed = assert_resume_is_bitwise(project, run, tmp_path, stop=16, end=22)
    assert "sharded" in stopped  # read from a step directory
    assert "reading and dropping" not in resumed.stderr  # continued from the saved position, not fast-forwarded
    assert [(p["epoch"], p["batches"]) for p in stopped["data"]] == [(1, 5), (1, 5)]  # each rank's own position
    assert all(p["loader"] is not None for p in stopped["data"])


def test_a_stream_without_a_state_is_fast_forwarded_exactly(project, tmp_path):
    (project / "plain_stream.py").write_text(
        "from data import SampleStream\n\n\n"
        "class PlainStream(SampleStream):  # no position of its own to save: the trainer reads and drops\n"
        "    state_dict = load_state_dict = None\n"
    )
    assert_resume_is_bitwise(project, [*STREAM, "data.train._target_=plain_stream.PlainStream"], tmp_path, stop=16, end=22)


def test_stream_evaluation_is_exact_at_world_size_3_under_fsdp(tmp_path):
    """101 evaluation samples in 3 streams (34, 34, 33) of batches of 11: 4, 4 and 3 batches, so fsdp's lockstep
    repeats one on the last rank, uncounted. lr ~0: the model evaluated is the initial one in both runs."""
    project = make_project(tmp_path / "project", eval_samples=101)
    results = {}
    for world, strategy in ((1, "ddp"), (3, "fsdp")):
        run_dir = tmp_path / f"world{world}"
        proc = launch_in(project, *PLAIN, "data=diabetes_stream", f"trainer.procs_per_node={world}",
                         f"trainer.strategy={strategy}", "optim.lr=1e-12", "data.batch_size=8", "trainer.max_steps=1",
                         "data.eval_batch_size=11", f"hydra.run.dir={run_dir}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        [results[world]] = [r for r in read_metrics(run_dir) if r["kind"] == "eval"]
    assert results[3]["mse"] == pytest.approx(results[1]["mse"], rel=1e-6)
    assert results[3]["loss"] == pytest.approx(results[1]["loss"], rel=1e-6)


BAD_TARGETS = [
    ("+model.widht=16", "model.widht: models.ResidualMLP has no argument 'widht' (did you mean model.width?)"),
    ("~model.in_features", "model: models.ResidualMLP needs 'in_features', which the config does not give: add model.in_features=..."),
    ("task._target_=losses.Hubber", "task._target_=losses.Hubber cannot be imported: losses has no 'Hubber'; did you mean Huber?"),
    ("data.train._target_=datasets.Files", "data.train._target_=datasets.Files cannot be imported: no module 'datasets'"),
    ("+optim.schedule.finl=0.2", "optim.schedule.finl: schedules.linear_decay has no argument 'finl' (did you mean optim.schedule.final?)"),
    ("optim.schedule.final=2", "optim.schedule: optim.schedule.final=2 must lie in [0, 1] (a fraction of the peak lr)."),
]


@pytest.fixture(scope="module")
def bad_targets(project):
    """Each launch of BAD_TARGETS in the project, run in one process (tests/conformance/commands.py): {override:
    result}. A refusal costs its composition and checks, not a Python and torch start each."""
    rows = [{"id": override, "args": [*PLAIN, override, f"hydra.run.dir=refused/{n}"]}
            for n, (override, _) in enumerate(BAD_TARGETS)]
    return run_commands(project, rows)


@pytest.mark.parametrize("override,message", BAD_TARGETS)
def test_a_bad_user_target_is_refused_before_any_worker_starts(bad_targets, override, message):
    result = bad_targets[override]
    assert result["code"] == 2 and not result["started"]
    assert message in result["stderr"]
    assert "plan:" not in result["stdout"]  # no worker ran


def test_the_readmes_smallest_example_trains_as_written(tmp_path):
    """The two files of the smallest project (docs/your-code.md, which the README points to), taken from the page."""
    section = (REPO / "docs" / "your-code.md").read_text()
    blocks = {}
    for block in section.split("```")[1:8:2]:  # the fenced blocks' contents
        body = block.split("\n", 1)[1]
        first = body.splitlines()[0]
        if first.startswith("# my_project/"):
            blocks[first[len("# my_project/"):]] = body.split("\n", 1)[1]  # the file, without the path comment
    assert set(blocks) == {"net.py", "conf/experiment/mine.yaml"}
    for name, body in blocks.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    proc = run_cli("launcher", "--config-dir", "conf", "+experiment=mine", "trainer.progress=lines", "trainer.threads=1",
                   "trainer.epochs=2", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0
    assert "model     net.Net(width=128)" in proc.stdout
    assert [r for r in read_metrics(tmp_path / "run") if r["kind"] == "eval"][-1]["acc"] > 0.5  # it learned (chance: 0.1)


def test_the_project_runs_under_plain_torchrun_from_the_snapshot(project, tmp_path):
    run_dir = tmp_path / "run"
    dry = launch_in(project, *PLAIN, "launcher.dry_run=true", f"hydra.run.dir={run_dir}")
    assert dry.returncode == 0 and "dry run: nothing started" in dry.stdout
    assert (run_dir / "config.yaml").exists() and not (run_dir / "checkpoints").exists()
    # From the project's directory (its own train.py there): python -P keeps the working directory off the path;
    # the project's modules come from the snapshot's import_path.
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--no-python",
                           sys.executable, "-P", "-m", "train", str(run_dir / "config.yaml")],
                          cwd=project, capture_output=True, text=True, timeout=300)
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0
    assert final_checkpoint(run_dir)["step"] == 12 and "blocks.0.norm.weight" in final_checkpoint(run_dir)["model"]
    plan = json.loads((run_dir / "plan.json").read_text())  # planned by the ranks themselves, in torchrun's world
    assert plan["world_size"] == 2 and plan["global_batch"] == final_checkpoint(run_dir)["global_batch"] == 64


def test_an_image_folder_trains_with_loader_workers(tmp_path):
    """data=image_folder on real PNG files (scikit-learn's scans of 0, 1, 2), decoded in 2 workers per process."""
    from test_data import write_image_folder

    write_image_folder(tmp_path / "images" / "train", per_class=40)
    write_image_folder(tmp_path / "images" / "eval", per_class=12)
    proc = run_cli("launcher", "data=image_folder", f"data.root={tmp_path / 'images'}", "data.num_classes=3",
                   "data.channels=1", "data.image_size=16", "data.batch_size=8", "data.num_workers=2", "model.width=8",
                   "optim.lr=0.02", "trainer.epochs=6", "trainer.progress=lines", "trainer.threads=1", f"hydra.run.dir={tmp_path / 'run'}",
                   cwd=tmp_path)
    assert proc.returncode == 0
    assert "ImageFolder" in proc.stdout and "2 loader worker(s) per process" in proc.stdout
    [*_, last] = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "eval"]
    assert last["acc"] > 0.6  # 3 classes: chance is 1/3


def test_a_stop_signal_with_loader_workers_saves_at_a_step_boundary(project, tmp_path):
    """The launcher's agent stops a rank by signalling its whole process group, its loader workers included, and
    torch's workers exit on a SIGTERM that is not their rank's: a rank stopping to save lost its workers, then itself
    at its next batch ("DataLoader worker exited unexpectedly"), and every step since its last checkpoint."""
    run_dir = tmp_path / "run"
    proc, out, err = signalled_launch([*STREAM, "trainer.epochs=1000", "trainer.max_steps=20000",
                                       "trainer.stop_check_s=0.05"], run_dir, cwd=project, after_step=20)
    assert proc.returncode == 128 + signal.SIGTERM
    # Announced by a rank that had the signal when the ranks agreed to stop: rank 0 or, where the agent's SIGTERM
    # reached rank 1 first (a loaded machine; CI, 2026-11-27), rank 1 alone
    assert re.search(r"\[rank \d\] SIGTERM: saving a checkpoint at the next step boundary", err), err[-4000:]
    assert "DataLoader worker" not in err, err[-4000:]
    saved = final_checkpoint(run_dir)
    assert saved["step"] >= 20 and f"stopped at step {saved['step']} with a checkpoint" in out
    per_epoch = json.loads((run_dir / "plan.json").read_text())["steps_per_epoch"]
    for position in saved["data"]:  # each rank's stream position, from its workers (none at an epoch's boundary)
        assert position["batches"] == (saved["step"] - 1) % per_epoch + 1
        assert (position["loader"] is not None) == (position["batches"] < per_epoch)


STUCK_STREAM = '''import os
import threading

from data import SampleStream


class StuckStream(SampleStream):
    """On rank 1 the loader workers stop answering after 40 samples each: a stream that never makes progress."""

    def __iter__(self):
        for count, sample in enumerate(super().__iter__()):
            if self.rank == 1 and self.repeat and count == 40:
                threading.Event().wait()
            yield sample
'''


@pytest.mark.alone
def test_a_stream_whose_loader_workers_stop_answering_is_reported_as_a_hang_with_its_stack(project, tmp_path):
    """Issue 35, item 11: a loader that makes no progress is a hang named by rank, with where the rank waits (the
    DataLoader's queue), never a silent wait until a test or a job's time limit."""
    (project / "stuck_stream.py").write_text(STUCK_STREAM)
    run_dir = tmp_path / "run"
    proc = launch_in(project, *STREAM, "data.train._target_=stuck_stream.StuckStream", "trainer.hang_timeout_s=3",
                     "trainer.max_steps=40", f"hydra.run.dir={run_dir}", timeout=180)
    assert proc.returncode == 1
    assert "[rank 1] no progress for" in proc.stderr and "rank 1 failed, exit code 70" in proc.stderr
    assert "a hang (its report is in RUN_DIR/hang/)" in proc.stderr and "To enable traceback" not in proc.stderr
    [incident] = [p for p in (run_dir / "hang").iterdir() if p.is_dir()]
    assert "streams.py" in json.loads((incident / "rank1.json").read_text())["where"]  # waiting for its batches
    stacks = (incident / "summary.txt").read_text()
    assert "behind: rank 1" in stacks and "dataloader.py" in stacks  # inside the loader, waiting on its workers
