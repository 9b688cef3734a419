"""Stable run directories: the same command always names the same directory; watch-only overrides do not."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.run_dir.directory import MAX_TAG, run_tag


def test_no_overrides_is_the_default_run():
    assert run_tag([]) == "default"
    assert run_tag(["+experiment=lenet", "hydra.run.dir=x"]) == "default"


def test_overrides_that_change_the_result_name_the_run_in_a_stable_order():
    a = run_tag(["optim.lr=0.1", "data.batch_size=64"])
    assert a == run_tag(["data.batch_size=64", "optim.lr=0.1"]) == "data.batch_size=64,optim.lr=0.1"


def test_watch_only_overrides_keep_the_same_run_so_it_resumes():
    base = run_tag(["optim.lr=0.1"])
    assert run_tag(["optim.lr=0.1", "trainer.max_steps=500", "trainer.progress=lines", "launcher.max_restarts=3"]) == base
    assert run_tag(["optim.lr=0.1", "checkpoint.keep_last=1"]) == base


def test_the_weights_a_run_starts_from_name_another_run():
    """checkpoint.init_from after the default run was refused as "another run" in the default's directory (docs
    said checkpoint.* keeps the directory): another start is another run, in a directory of its own."""
    assert run_tag(["checkpoint.init_from=/w/model.pt"]) == "checkpoint.init_from=_w_model.pt"
    assert run_tag(["checkpoint.init_from=/w/model.pt", "checkpoint.keep_last=2"]) == "checkpoint.init_from=_w_model.pt"


def test_another_data_root_is_another_run():
    """Data read from elsewhere is other data: its run must not resume the checkpoints trained on the first."""
    assert run_tag(["data=tokens", "data.root=data/openwebtext"]) != run_tag(["data=tokens", "data.root=data/mine"])


def test_names_are_safe_and_bounded():
    assert "/" not in run_tag(["model.hidden=[64, 32]", "data.name=a/b"])
    long = run_tag([f"model.hidden=[{','.join(['512'] * 80)}]"])
    assert len(long) == MAX_TAG
    assert long != run_tag([f"model.hidden=[{','.join(['512'] * 81)}]"])  # the hash keeps them apart


def _write_snapshots(run_dir: str, value: int, times: int, errors) -> None:
    from omegaconf import OmegaConf

    from launcher.main import write_snapshot
    from train.observe.status import write_status

    cfg = OmegaConf.create({"writer": value, "padding": "x" * 20000})
    try:
        for _ in range(times):
            write_snapshot(cfg, Path(run_dir))
            write_status(Path(run_dir), "running", writer=value, padding="y" * 20000)
    except Exception as error:  # noqa: BLE001 - reported to the test
        errors.put(repr(error))


def _check_writable(folder: str, times: int, errors) -> None:
    from launcher.run_dir.directory import check_writable

    for _ in range(times):
        try:
            check_writable(Path(folder) / "run", "hydra.run.dir")
        except SystemExit as refused:
            errors.put(refused.code)
            return


def test_launchers_of_several_nodes_check_one_run_directory_at_once_without_refusing_each_other(tmp_path, capfd):
    """Two nodes' launchers started at once: each probed the shared run directory with a file of one name, and one
    removed it under the other, which was refused ("is not a writable directory (No such file or directory)"; the
    matrix's nodes-replicas-kill, once, the other node then waiting rdzv_timeout_s for it)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    errors = context.Queue()
    checkers = [context.Process(target=_check_writable, args=(str(tmp_path), 500, errors)) for _ in range(2)]
    for c in checkers:
        c.start()
    for c in checkers:
        c.join()
    assert [errors.get() for _ in range(errors.qsize())] == [], capfd.readouterr().err
    assert list((tmp_path / "run").iterdir()) == []  # no probe left behind


def test_launchers_of_several_nodes_write_one_snapshot_and_status_without_collisions(tmp_path):
    """The launchers of a multi-node local run write config.yaml (and status.json) into one shared directory at
    once: each write is whole and none fails (one temporary name per file raised FileNotFoundError, or renamed a
    half-written file into place)."""
    import json
    import multiprocessing

    from omegaconf import OmegaConf

    context = multiprocessing.get_context("fork")
    errors = context.Queue()
    writers = [context.Process(target=_write_snapshots, args=(str(tmp_path), v, 100, errors)) for v in (1, 2)]
    for w in writers:
        w.start()
    torn = 0
    while any(w.is_alive() for w in writers):
        for name in ("config.yaml", "status.json"):
            try:
                text = (tmp_path / name).read_text()
            except FileNotFoundError:
                continue
            whole = OmegaConf.create(text).get("padding") == "x" * 20000 if name == "config.yaml" else \
                json.loads(text)["padding"] == "y" * 20000
            torn += not whole
    for w in writers:
        w.join()
    failures = [errors.get() for _ in range(errors.qsize())]
    assert failures == [] and torn == 0
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_control_character_in_an_override_is_refused_before_a_directory_is_made(launch, tmp_path):
    """A newline in `name` (or any override) would name the run directory and split SLURM's #SBATCH --output= line."""
    result = launch("launcher.dry_run=true", 'name="two\nlines"')
    assert result.returncode == 2
    assert "holds a control character" in result.stderr and "name=" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_directory_of_the_users_own_files_is_refused_before_anything_is_written_in_it(launch, tmp_path):
    """hydra.run.dir over a project's own config.yaml, plan.json and metrics.jsonl replaced them, exit 0."""
    mine = tmp_path / "my_project"
    mine.mkdir()
    own = {"config.yaml": "my: own config\n", "plan.json": "{\"mine\": 1}\n", "metrics.jsonl": "{\"loss\": 1}\n"}
    for name, text in own.items():
        (mine / name).write_text(text)
    result = launch("trainer.max_steps=2", f"hydra.run.dir={mine}")
    assert result.returncode == 2 and "plan:" not in result.stdout
    assert f"hydra.run.dir={mine} holds files that are not a run of this launcher" in result.stderr
    assert {p.name: p.read_text() for p in mine.iterdir()} == own  # nothing added, nothing replaced


def test_a_refused_launch_leaves_an_earlier_run_as_it_was_and_nothing_where_it_made_a_directory(launch, tmp_path):
    """A finished run, then the same command with a bad value: refused, and status.json still says finished (it said
    failed, and `jobs status` printed the refusal as the run's failure). A refused launch into a new directory
    left .hydra/, the lock and a "failed" status behind."""
    run_dir = tmp_path / "runs" / "done"
    first = launch("data=synthetic", "model=mlp", "trainer.max_steps=2", "trainer.threads=1", "trainer.procs_per_node=1",
                   f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-2000:]
    status = (run_dir / "status.json").read_text()
    assert '"finished"' in status
    again = launch("data=synthetic", "model=mlp", "trainer.max_steps=2", "trainer.threads=1", "trainer.procs_per_node=1",
                   "checkpoint.keep_last=0", f"hydra.run.dir={run_dir}")
    assert again.returncode == 2 and "checkpoint.keep_last" in again.stderr
    assert (run_dir / "status.json").read_text() == status
    fresh = tmp_path / "runs" / "new" / "point"
    refused = launch("trainer.max_steps=2", "checkpoint.keep_last=0", f"hydra.run.dir={fresh}")
    assert refused.returncode == 2 and "checkpoint.keep_last" in refused.stderr
    assert not (tmp_path / "runs" / "new").exists()


def test_jobs_status_of_a_path_that_is_no_run_directory_says_so(tmp_path, capsys):
    """`python -m launcher.jobs status runs/nope` (a typo) said "not started" and "free (no lease)", exit 0."""
    from launcher.tools.jobs import main

    assert main(["status", str(tmp_path / "nope")]) == 2
    assert "does not exist: give a run directory" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("x")
    assert main(["status", str(tmp_path / "a-file")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_the_tools_refuse_a_path_that_is_not_what_they_read_with_the_fix(tmp_path, capsys):
    """Issue 61 (B): `launcher.sweep` on a missing folder, `export --out` a directory and `python -m train` on a
    missing config ended in raw tracebacks."""
    import subprocess
    import sys

    from launcher.tools.export import main as export
    from launcher.tools.sweep import main as sweep

    assert sweep([str(tmp_path / "nope")]) == 2
    assert "is not a directory: give the sweep directory of a multirun" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        export([str(tmp_path), "--out", str(tmp_path)])
    assert exited.value.code == 2 and f"--out {tmp_path} is a directory: give a file name in it" in capsys.readouterr().err
    rank = subprocess.run([sys.executable, "-m", "train", str(tmp_path / "config.yaml")], capture_output=True,
                          text=True, timeout=120)
    assert rank.returncode == 2 and "no such file; give the config.yaml of a run directory" in rank.stderr
