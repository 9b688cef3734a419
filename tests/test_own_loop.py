"""program=script: a researcher's own torchrun-style loop (tests/foreign/own_loop), launched unchanged with the
launcher's guarantees: the env:// world, its own arguments, status.json, the failing rank's own traceback, a stop
passed on (with the optional ddp_loop API: a checkpoint at a step boundary, exit 0 of the ranks, a resume), and bad
input refused before start."""

from __future__ import annotations

import csv
import json
import re
import shutil
import signal

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import REPO, run_cli, signalled_launch

OWN = REPO / "tests" / "foreign" / "own_loop"


def project(tmp_path):
    """The user's project: their script beside their own train.py and launcher.py (which must not be run)."""
    for name in ("my_loop.py", "api_loop.py", "ft_loop.py"):
        shutil.copy(OWN / name, tmp_path / name)
    for name in ("train.py", "models.py"):
        (tmp_path / name).write_text("raise SystemExit('the project\\'s own module was imported')\n")
    return tmp_path


def test_an_unchanged_torchrun_script_runs_on_two_processes_with_its_own_arguments(tmp_path):
    here = project(tmp_path)
    run_dir = here / "runs" / "mine"
    proc = run_cli("launcher", "program=script", "program.script=my_loop.py",
                   "program.args=[--epochs,2,--out,mine.pt,--lr,0.05]", "trainer.procs_per_node=2",
                   f"hydra.run.dir={run_dir}", cwd=here)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "epoch 1 loss" in proc.stdout and "world 2 local_rank 0" in proc.stdout
    assert f"program   python -u {here / 'my_loop.py'} --epochs 2 --out mine.pt --lr 0.05" in proc.stdout
    assert set(torch.load(here / "mine.pt", weights_only=True)) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
    assert (run_dir / "config.yaml").is_file()  # the resolved config, as for the trainer


def test_a_crashing_script_reports_its_own_traceback_and_the_run_is_marked_failed(tmp_path):
    here = project(tmp_path)
    run_dir = here / "runs" / "crash"
    proc = run_cli("launcher", "program=script", "program.script=my_loop.py", "program.args=[--crash-at-epoch,1]",
                   "trainer.procs_per_node=2", f"hydra.run.dir={run_dir}", cwd=here)
    assert proc.returncode == 1
    assert "rank 1 failed" in proc.stderr and "ValueError: my loop broke at epoch 1 on rank 1" in proc.stderr
    assert "my_loop.py" in proc.stderr  # its frames, not torch's placeholder
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and "my loop broke at epoch 1" in status["error"]


def test_a_script_using_the_api_stops_on_sigterm_with_its_checkpoint_and_resumes(tmp_path):
    here = project(tmp_path)
    run_dir = here / "runs" / "api"
    run = ["program=script", "program.script=api_loop.py", "program.args=[--steps,400,--step-delay-ms,30]",
           "trainer.procs_per_node=2"]
    proc, out, err = signalled_launch(run, run_dir, here, sig=signal.SIGTERM, after_step=5)
    assert proc.returncode == 143, err[-3000:]
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert 5 <= saved["step"] < 400 and f"saved step {saved['step']}" in out
    assert json.loads((run_dir / "status.json").read_text())["status"] == "stopped", (run_dir / "status.json").read_text() + err[-3000:]
    resumed = run_cli("launcher", *run[:2], "program.args=[--steps,40]", *run[3:], f"hydra.run.dir={run_dir}", cwd=here)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed at step {saved['step']}" in resumed.stdout
    # What the script reported is in the run's trackers too (TensorBoard by default), each step once, as
    # metrics.jsonl has it (the resumed launch's repeats of a step drawn once); before, only metrics.jsonl held it.
    reported: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        reported.setdefault(record["step"], record["loss"])
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    drawn = {event.step: event.value for event in events.Scalars("train/loss")}
    assert sorted(drawn) == sorted(reported) and max(drawn) == 40, (sorted(drawn), sorted(reported))
    assert all(abs(drawn[step] - reported[step]) <= 1e-6 * max(1.0, abs(reported[step])) for step in drawn)


def test_a_script_using_torchft_itself_runs_as_replica_groups_and_a_killed_group_restarts_alone_and_heals(tmp_path):
    """trainer.fault_tolerance=replicas under program=script (refused before): each group its own agent, the
    Lighthouse at TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID, and the group's store at MASTER_ADDR:MASTER_PORT as torchrun
    gives it (the agent's: torchft's Manager only connects to one). Group 1's rank is killed at step 5: its group
    alone restarts, heals from group 0 (torchft), and both end at step 20 with the same weights."""
    here = project(tmp_path)
    proc = run_cli("launcher", "program=script", "program.script=ft_loop.py", "program.args=[--die-at,5]",
                   "trainer.fault_tolerance=replicas", "trainer.replica_groups=2", "trainer.procs_per_node=2",
                   "launcher.max_restarts=1", f"hydra.run.dir={here / 'run'}", cwd=here, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restarting the workers (restart 1 of 1); replica group 1 rejoins the others" in proc.stderr
    # (the two groups' prints share the console and may run together on one line: print writes the newline apart)
    done = sorted(re.findall(r"group (\d) done at step (\d+): weights (-?[\d.]+)", proc.stdout))
    assert [(group, step) for group, step, _ in done] == [("0", "20"), ("1", "20")], proc.stdout
    assert done[0][2] == done[1][2]  # the same weights
    assert json.loads((here / "run" / "status.json").read_text())["status"] == "finished"


HANGS = """
import threading

import torch.distributed as dist

dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} started", flush=True)


def stuck_here():
    threading.Event().wait()  # the hang: rank 1 never reaches the barrier


if dist.get_rank() == 1:
    stuck_here()
dist.barrier()
"""


def run_two_ranks(here, name: str, text: str, *overrides: str):
    """The script `text` as here/NAME.py on two ranks, trainer.hang_timeout_s=3 unless overridden; the ended launch and
    its run directory."""
    (here / f"{name}.py").write_text(text)
    run_dir = here / "runs" / name
    proc = run_cli("launcher", "program=script", f"program.script={name}.py", "trainer.procs_per_node=2",
                   "trainer.hang_timeout_s=3", *overrides, f"hydra.run.dir={run_dir}", cwd=here, timeout=180)
    return proc, run_dir


def test_a_script_whose_ranks_all_go_silent_is_reported_with_every_ranks_stacks(tmp_path):
    """No rank printed or reported for trainer.hang_timeout_s: every rank writes its stacks into RUN_DIR/hang/ (rank 1
    where it is stuck, rank 0 in the barrier that waits for it) and, as asked (program.on_hang=end), exits 70; the
    run fails with the reason."""
    here = project(tmp_path)
    (here / "hangs.py").write_text(HANGS)
    run_dir = here / "runs" / "hangs"
    proc = run_cli("launcher", "program=script", "program.script=hangs.py", "trainer.procs_per_node=2",
                   "trainer.hang_timeout_s=4", "program.on_hang=end", f"hydra.run.dir={run_dir}", cwd=here, timeout=120)
    assert proc.returncode != 0
    assert "hang: no rank printed, reported or saved for 4 s (trainer.hang_timeout_s)" in proc.stderr, proc.stderr[-3000:]
    [incident] = (run_dir / "hang").iterdir()
    summary = (incident / "summary.txt").read_text()
    assert "no rank printed, reported or saved for 4 s" in summary and "ended (exit 70)" in summary
    stacks = {r: (incident / f"rank{r}.txt").read_text() for r in (0, 1)}
    assert "stuck_here" in stacks[1] and "hangs.py" in stacks[1]
    assert "barrier" in stacks[0] and "stuck_here" not in stacks[0]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and "exit code 70: HangDetected: no rank printed" in status["error"], status


# Rank 1 goes silent until the hang is reported, then goes on: a script without ddp_loop's API is reported, and its
# ranks are not ended (program.on_hang=auto), so it can still finish.
SILENT_UNTIL_REPORTED = """
import glob
import os
import time

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    while not glob.glob(os.path.join(os.environ["LAUNCHER_RUN_DIR"], "hang", "*", "summary.txt")):
        time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
"""


def test_a_silent_script_without_the_api_is_reported_and_not_ended(tmp_path):
    proc, run_dir = run_two_ranks(project(tmp_path), "silent", SILENT_UNTIL_REPORTED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [incident] = (run_dir / "hang").iterdir()
    assert sorted(p.name for p in incident.glob("rank*.txt")) == ["rank0.txt", "rank1.txt"]
    assert "not ended: program.on_hang=auto" in (incident / "summary.txt").read_text()
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"


# Rank 0 saves for longer than the hang limit without printing, inside ddp_loop.saving(); rank 1 waits for it in a
# barrier. Before, the watch ended both ranks mid-save and the previous good checkpoint was left unreadable.
SAVES_SLOWLY = """
import os
import time

import torch
import torch.distributed as dist

import ddp_loop

dist.init_process_group("gloo")
ddp_loop.report(1, loss=1.0)
if dist.get_rank() == 0:
    with ddp_loop.saving(), open(ddp_loop.checkpoint_dir() / "last.bin", "wb") as out:
        for _ in range(12):  # 6 s, twice trainer.hang_timeout_s, in silence
            out.write(os.urandom(1 << 16))
            time.sleep(0.5)
dist.barrier()
dist.destroy_process_group()
"""


def test_a_rank_saving_for_longer_than_the_hang_limit_is_never_ended(tmp_path):
    proc, run_dir = run_two_ranks(project(tmp_path), "saves", SAVES_SLOWLY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "checkpoints" / "last.bin").stat().st_size == 12 << 16
    assert not (run_dir / "hang").exists() and "hang:" not in proc.stderr


# A tracker of the user's own whose close takes 6 s, twice trainer.hang_timeout_s (a W&B run's upload at its finish).
SLOW_TRACKER = """
import time
from pathlib import Path


class SlowClose:
    holds_through = -1

    def __init__(self, run):
        self.out = Path(run.run_dir) / "slow_tracker.txt"
        self.steps = []

    def scalars(self, values, step):
        self.steps.append(step)

    def text(self, tag, text, step):
        pass

    def close(self):
        time.sleep(6)  # the upload at the tracker's finish
        self.out.write_text(" ".join(map(str, self.steps)))
"""

REPORTS = """
import torch.distributed as dist

import ddp_loop

dist.init_process_group("gloo")
for step in (1, 2, 3):
    dist.barrier()
    ddp_loop.report(step, loss=1.0 / step)
dist.destroy_process_group()
"""


def test_a_tracker_slower_to_close_than_the_hang_limit_ends_no_finished_run(tmp_path):
    """Rank 0's exit waits for the trackers to draw the last records and close; the hang watch, still on while the
    exit handlers run, took that wait for a hang and ended the finished run (exit 70, failed), the tracker's close
    cut short. The wait is now a save window (ddp_loop.saving)."""
    here = project(tmp_path)
    (here / "slow_tracker.py").write_text(SLOW_TRACKER)
    proc, run_dir = run_two_ranks(here, "reports", REPORTS, "+loggers.slow._target_=slow_tracker.SlowClose")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hang:" not in proc.stderr and not (run_dir / "hang").exists()
    assert (run_dir / "slow_tracker.txt").read_text() == "1 2 3"  # closed, with every report drawn
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"


# Rank 0 is frozen (SIGSTOP) at step 3 of a script that reports: rank 1 waits for it in a collective.
FREEZES = """
import os
import signal

import torch
import torch.distributed as dist

import ddp_loop

dist.init_process_group("gloo")
for step in range(1, 100):
    total = torch.ones(1)
    dist.all_reduce(total)
    ddp_loop.report(step, loss=1.0 / step)
    if step == 3 and dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
dist.destroy_process_group()
"""


def test_a_frozen_rank_of_a_script_is_named_in_the_runs_error(tmp_path):
    """The healthy rank's hang exit was the run's whole error ("rank 1 failed, exit code 70"): the frozen rank, which
    wrote no stacks, is now named in it, and in the incident's summary, which the healthy rank writes (rank 0 alone
    wrote it: a frozen rank 0 left none; so did a rank 0 whose barrier broke as rank 1 exited, a CI failure)."""
    proc, run_dir = run_two_ranks(project(tmp_path), "freezes", FREEZES, "launcher.shutdown_timeout_s=5")
    assert proc.returncode == 1, proc.stderr[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert "HangDetected" in status["error"] and "rank(s) [0] wrote no stacks" in status["error"], status
    [incident] = (run_dir / "hang").iterdir()
    assert "rank(s) [0] wrote no stacks" in (incident / "summary.txt").read_text()
    assert [p.name for p in incident.iterdir() if p.name.startswith(".")] == []  # no part of a summary left


ENDS = """
import atexit
import os
import sys
import threading

import torch
import torch.distributed as dist

import keeps  # a library of the user's: a thread pool and an archive held by the module, never closed

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")  # never destroyed: left to the exit, as many scripts do
total = torch.ones(4)
dist.all_reduce(total)
keeps.POOL.submit(lambda: open(f"pool{rank}.txt", "w").write("ran"))
keeps.ARCHIVE.write("line\\n" * 1000)
log = open(f"left_open{rank}.txt", "w")  # never closed: Python's exit flushes it
log.write("written, never flushed")
atexit.register(lambda: open(f"atexit{rank}.txt", "w").write("ran"))
go = threading.Event()


def writer():
    go.wait()
    with open(f"thread{rank}.txt", "w") as out:
        out.writelines(f"{i}\\n" for i in range(1000))


threading.Thread(target=writer).start()  # not a daemon: the exit waits for it
go.set()
sys.exit(int(sys.argv[1]))
"""
KEEPS = """
import gzip
import os
from concurrent.futures import ThreadPoolExecutor

POOL = ThreadPoolExecutor(2)  # ended by threading's exit hook (threading._register_atexit), not by the script
ARCHIVE = gzip.open(f"archive{os.environ['RANK']}.gz", "wt")  # its end marker is written when it is finalized
"""


def test_a_script_that_ends_by_itself_ends_as_python_ends_it_with_its_exit_code(tmp_path):
    """Each rank of a script ends as `python SCRIPT` ends: threading's exit hooks (a library's thread pool), its
    non-daemon threads, its atexit handlers, its objects finalized (a module's gzip file gets its end marker), its
    files flushed; sys.exit(N) is its exit code. Before, ddp_loop imitated the exit and skipped the interpreter's
    finalization (where a gloo thread could abort the rank): a library's ThreadPoolExecutor hung the rank, and the
    module's gzip file was left without its end marker (EOFError on read). Now the process group the script left is
    destroyed after its exit handlers, before the finalization (ddp_loop._end_process_groups)."""
    import gzip

    for code, world in ((0, 2), (3, 1)):  # (the exit code's way to the run's status: one rank shows it)
        here = tmp_path / f"exit{code}"
        here.mkdir()
        (here / "ends.py").write_text(ENDS)
        (here / "keeps.py").write_text(KEEPS)
        proc = run_cli("launcher", "program=script", "program.script=ends.py", f"program.args=[{code}]",
                       f"trainer.procs_per_node={world}", "trainer.hang_timeout_s=60", f"hydra.run.dir={here / 'run'}",
                       cwd=here, timeout=180)
        assert proc.returncode == (1 if code else 0), proc.stderr[-2000:]
        for rank in range(world):
            assert (here / f"left_open{rank}.txt").read_text() == "written, never flushed"
            assert (here / f"atexit{rank}.txt").read_text() == "ran" and (here / f"pool{rank}.txt").read_text() == "ran"
            assert len((here / f"thread{rank}.txt").read_text().splitlines()) == 1000
            with gzip.open(here / f"archive{rank}.gz", "rt") as archive:
                assert archive.read() == "line\n" * 1000
        status = json.loads((here / "run" / "status.json").read_text())
        assert status["status"] == ("failed" if code else "finished")
        if code:
            assert "exit code 3" in status["error"]
        assert "hang:" not in proc.stderr


def test_a_script_runs_again_when_the_same_command_is_run_again(tmp_path):
    """A finished script's second launch (edited since, or one that trains from scratch) printed "already finished
    with this config; nothing to do" and ran nothing: the launcher cannot know what a script's "finished" means."""
    (tmp_path / "count.py").write_text("open('runs.txt', 'a').write('ran\\n')\n")
    command = ["launcher", "program=script", "program.script=count.py", "trainer.procs_per_node=1",
               f"hydra.run.dir={tmp_path / 'run'}"]
    for _ in range(2):
        proc = run_cli(*command, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "runs.txt").read_text() == "ran\n" * 2 and "already finished" not in proc.stdout


def test_a_scripts_arguments_reach_it_as_typed(tmp_path):
    """Hydra typed each element of program.args: `--x true --y 1e-3 --s 1_000` reached the script as `--x True --y
    0.001 --s 1000`, and `null` was refused; torchrun passes them as typed."""
    (tmp_path / "argv.py").write_text("import json, sys\nopen('argv.json', 'w').write(json.dumps(sys.argv[1:]))\n")
    proc = run_cli("launcher", "program=script", "program.script=argv.py", "trainer.procs_per_node=1",
                   "program.args=[--x,true,--y,1e-3,--s,1_000,--n,null,--q,'a,b',--e,\"--k=1\"]",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "argv.json").read_text()) == [
        "--x", "true", "--y", "1e-3", "--s", "1_000", "--n", "null", "--q", "a,b", "--e", "--k=1"]


def test_a_sweep_over_the_scripts_arguments_summarises_what_it_reported_and_only_its_own_points(tmp_path):
    """-m over program.args: one point per argument list, the summary's `reported` column holds each point's last
    ddp_loop.report; an earlier sweep into the same folder (two points, both failed) is neither shown nor counted."""
    here = project(tmp_path)
    sweep = f"hydra.sweep.dir={here / 'sweep'}"
    one = "trainer.procs_per_node=1"  # (the sweep's figures, not the world, are under test: the cheapest world)
    failed = run_cli("launcher", "-m", "program=script", "program.script=my_loop.py", one,
                     "program.args=[--bogus,1],[--bogus,2]", sweep, cwd=here)
    assert failed.returncode == 1 and "2 of 2 point(s) failed" in failed.stderr
    ok = run_cli("launcher", "-m", "program=script", "program.script=api_loop.py", one, "~loggers.tensorboard",
                 "program.args=[--steps,6,--lr,0.05],[--steps,6,--lr,0.2]", sweep, cwd=here)  # (no tracker: cheaper)
    print(ok.stdout, ok.stderr)
    assert ok.returncode == 0, ok.stderr[-3000:]
    rows = {r["point"]: r for r in csv.DictReader(open(here / "sweep" / "summary.csv"))}
    assert len(rows) == 2 and not any("bogus" in point for point in rows)  # this sweep's own points only
    assert all(r["status"] == "finished" for r in rows.values())
    reported = [r["reported"] for r in rows.values()]
    assert all(r.startswith("loss ") and r.endswith("(step 6)") for r in reported)
    assert reported[0] != reported[1]  # each point's own figures (another lr)
