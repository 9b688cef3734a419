"""Fault tolerance with real processes: killed ranks, signals to the launcher, hangs, bad ranks, taken ports, and
resuming at another world size. Faults are injected by tests/faults/sitecustomize.py (real SIGKILLs, real hangs)."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import torch

import tracker_records
from conftest import (FAST, IDENTITY, REPO, STRAIGHT, final_checkpoint, fault_env, kill_leftovers, logged_steps, process_named, read_metrics, run_cli,
                      signalled_launch, slowed_steps, wait_for)
from train.observe.status import read_status
from train.checkpoint import committed

# Every piece of resumable state is in play (AdamW, dropout, augmentation, accumulation, clipping).
# A stop is agreed within stop_check_s of the signal: these runs last a second.
FAULTY = STRAIGHT  # RESUME to step 32, a checkpoint every 4 steps, 2 restarts, a stop check every 0.05 s


@pytest.fixture(scope="module")
def uninterrupted(straight_run):
    """The final checkpoint of FAULTY run straight through (shared with tests/test_ddp_identity.py)."""
    return final_checkpoint(straight_run)


def assert_same_weights(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"{name} differs"


# The second run also feeds W&B (offline) and MLflow (a local SQLite store) through the restart.
TRACKERS = ["+logger=[wandb,mlflow]", "loggers.wandb.mode=offline"]


# (seed 0, a rank killed without the trackers: the conformance matrix's cell local-ddp-kill, from outside)
@pytest.mark.parametrize("seed", [1])
def test_a_killed_rank_is_restarted_and_the_run_ends_as_if_nothing_happened(launch, tmp_path, uninterrupted, seed):
    rng = random.Random(seed)
    rank, step = rng.randrange(2), rng.randint(2, 30)
    run_dir = tmp_path / "run"
    trackers = [*TRACKERS, f"loggers.mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"] if seed == 1 else []
    proc = launch(*FAULTY, *trackers, f"hydra.run.dir={run_dir}", env=fault_env("kill", rank, step))
    assert proc.returncode == 0
    assert f"rank {rank} failed, killed by SIGKILL" in proc.stderr  # the cause, before the restart
    assert "restarting the workers (restart 1 of 2)" in proc.stderr
    assert_same_weights(final_checkpoint(run_dir), uninterrupted)

    records = read_metrics(run_dir)
    train_steps = [r["step"] for r in records if r["kind"] == "train"]
    assert train_steps == sorted(set(train_steps))  # the replayed steps were not logged twice
    last_train = [r for r in records if r["kind"] == "train"][-1]
    assert last_train["step"] == 30 and last_train["restarts"] == 1  # the count is in the metrics
    if trackers:
        resumed = int(re.search(r"resumed at step (\d+)", proc.stdout).group(1))
        assert_trackers_hold_the_run(run_dir, records, resumed, step)


def assert_trackers_hold_the_run(run_dir, records: list[dict], resumed: int, killed: int) -> None:
    """W&B and MLflow, read back from their own stores, hold every step of metrics.jsonl once, through the restart.
    Steps the killed attempt logged after its checkpoint keep that attempt's values there (they cannot be erased);
    metrics.jsonl has the replayed ones, whose averaging window started at the checkpoint."""
    plan = json.loads((run_dir / "plan.json").read_text())
    mlflow_state = json.loads((run_dir / "trackers" / "mlflow.json").read_text())
    client, mlflow_run = tracker_records.mlflow_run(mlflow_state["tracking_uri"], mlflow_state["run_id"])
    wandb = tracker_records.wandb_run(run_dir)
    assert len(list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))) == 2  # one W&B run, continued
    for kind, key in (("train", "loss"), ("train", "lr"), ("eval", "acc"), ("eval", "loss")):
        expected = [(r["step"], r[key]) for r in records if r["kind"] == kind]
        for curve in (tracker_records.mlflow_curve(client, mlflow_state["run_id"], f"{kind}/{key}"),
                      tracker_records.wandb_curve(wandb, f"{kind}/{key}")):
            assert [s for s, _ in curve] == [s for s, _ in expected], f"{kind}/{key}: steps differ"
            for (s, value), (_, want) in zip(curve, expected):
                if not resumed < s < killed:
                    assert value == pytest.approx(want, rel=1e-6), f"{kind}/{key} at step {s}"
    # The same hyperparameters (config and plan) and identity in both; notes as text.
    assert mlflow_run.data.params["optim.lr"] == "0.003" and wandb["config"]["optim.lr"] == 0.003
    assert mlflow_run.data.params["plan.global_batch"] == str(plan["global_batch"]) == str(wandb["config"]["plan.global_batch"])
    assert mlflow_run.data.tags["identity"] == wandb["config"]["identity"]
    assert f"resumed at step {resumed}" in mlflow_run.data.tags["note.resume"]
    assert "optimizer MB" in mlflow_run.data.tags["note.memory"]
    assert not any(tag.startswith(("checkpoint/", "memory/")) or tag.endswith("epoch") for tag in mlflow_run.data.metrics)


# SIGHUP: the terminal or ssh session closed; SIGUSR2: a scheduler's warning before the time limit (srun --signal=USR2@120:
# it killed the launcher and the run unsaved, exit 140, before)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2])
def test_a_signal_to_the_launcher_saves_at_a_step_boundary_and_the_rerun_finishes_exactly(launch, tmp_path, uninterrupted, sig):
    run_dir = tmp_path / "run"
    proc, out, err = signalled_launch(FAULTY, run_dir, cwd=tmp_path, sig=sig)
    assert proc.returncode == 128 + sig
    # The workers stop on SIGTERM: a SIGHUP reaches them as one instead of killing them unsaved. A rank says so when it
    # takes the signal before the step boundary where the ranks agree to stop; under load rank 0 (the console's) may
    # learn of the stop there first, from rank 1's signal: then only rank 1's log file says it (CI, 2026-11-29).
    said = err + "".join(log.read_text() for log in run_dir.glob("logs/*/attempt_0/*/stderr.log"))
    assert re.search(r"\[rank \d\] SIGTERM: saving a checkpoint at the next step boundary", said), said[-3000:]
    assert f"{sig.name}: the workers save a checkpoint at the next step boundary" in err
    assert "Run the same command again" in err
    saved = final_checkpoint(run_dir)
    # sent once step 3 was logged: the boundary after step 3 may still be ahead of the ranks (seen under CI's load)
    assert 3 <= saved["step"] < 32
    assert f"stopped at step {saved['step']} with a checkpoint" in out
    assert read_status(run_dir)["status"] == "stopped"
    if sig != signal.SIGTERM:
        return  # from here on the same as after SIGTERM

    rerun = launch(*FAULTY, f"hydra.run.dir={run_dir}")
    assert rerun.returncode == 0 and f"resumed at step {saved['step']}" in rerun.stdout
    assert_same_weights(final_checkpoint(run_dir), uninterrupted)


def test_a_rank_failing_while_a_signal_stops_the_run_is_reported_not_called_a_clean_stop(tmp_path):
    """A SIGTERM to the launcher, and rank 1's stop fails (its save: no space left): the launcher said "the workers
    were stopped ... resume from the last checkpoint" as if all went well, and the status said nothing."""
    run_dir = tmp_path / "run"
    proc, out, err = signalled_launch(FAULTY, run_dir, cwd=tmp_path, env=fault_env("fail_on_stop", rank=1))
    assert proc.returncode == 128 + signal.SIGTERM  # a signal still stops a whole sweep
    assert "error: stopped by SIGTERM, and meanwhile training failed" in err
    assert "rank 1 failed, exit code 1" in err and "no space left on device for the stop's checkpoint (rank 1)" in err
    assert "the workers were stopped" not in err
    status = read_status(run_dir)
    assert status["status"] == "failed" and "rank 1 failed, exit code 1" in status["error"]


def test_a_stop_while_the_group_restarts_does_not_report_the_failure_that_restarted_it_again():
    """The agent's state between two attempts: the failed attempt's processes, already reported and restarted."""
    from types import SimpleNamespace

    from torch.distributed.elastic.multiprocessing.api import RunProcsResult
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from launcher.backends.agent import Agent

    failed = RunProcsResult(failures={1: ProcessFailure(local_rank=1, pid=7, exitcode=1, error_file="/nonexistent")})
    agent = object.__new__(Agent)  # only what a stop reads
    agent._pcontext = SimpleNamespace(wait=lambda timeout: failed)
    agent._worker_group = SimpleNamespace(workers=[SimpleNamespace(global_rank=4), SimpleNamespace(global_rank=5)])
    assert list(agent.failures_while_stopping()) == [5]  # a rank that failed as the signal came: by global rank
    agent.reported = agent._pcontext  # the monitor saw it first: reported, and the group restarts
    assert agent.failures_while_stopping() == {}


@pytest.mark.alone
def test_a_hanging_rank_is_reported_by_rank_and_the_group_restarts(launch, tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*FAST, *IDENTITY[1:], "trainer.procs_per_node=2", "data.batch_size=16", "launcher.max_restarts=1",
                 "trainer.hang_timeout_s=3", "trainer.timeout_s=60", f"hydra.run.dir={run_dir}"]
    proc = launch(*overrides, env=fault_env("hang", rank=1, step=5), timeout=180)
    assert proc.returncode == 0  # the restarted group finished the run
    assert "[rank 1] no progress for" in proc.stderr and "limit trainer.hang_timeout_s=3" in proc.stderr
    assert "faulty_train_step" in proc.stderr  # where it hung, from the stack dump
    # each line of it says whose it is (every rank of a hung collective dumps at once, into the same stderr)
    assert re.search(r'^(?:\[rank1\]:)?\[rank 1\]   File ".*", line \d+ in faulty_train_step$', proc.stderr, re.MULTILINE)
    assert "rank 1 failed, exit code 70" in proc.stderr
    assert final_checkpoint(run_dir)["step"] == 24

    # Both ranks wrote where they were; the summary names the rank the other waits for, and its stack.
    [incident] = [p for p in (run_dir / "hang").iterdir() if p.is_dir()]
    reports = {r: json.loads((incident / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert reports[1]["step"] == 4 and "faulty_train_step" in reports[1]["where"]
    assert reports[1]["collectives"]["world"] < reports[0]["collectives"]["world"]  # rank 0 went on into step 5's all-reduce
    summary = (incident / "summary.txt").read_text()
    assert "2 of 2 ranks answered" in summary and "behind: rank 1 (" in summary
    assert "stacks of rank 1:" in summary and "faulty_train_step" in summary.split("stacks of rank 1:")[1]
    assert "hang report:" in proc.stderr


@pytest.mark.alone
def test_a_collective_timeout_leaves_a_hang_report_that_names_the_rank_behind(launch, tmp_path):
    """Rank 0's all-reduce times out (trainer.timeout_s=3) while rank 1 is stuck before it; rank 1, asked through
    the rendezvous store, answers with where it is (and later reports its own hang: trainer.hang_timeout_s=6)."""
    run_dir = tmp_path / "run"
    proc = launch(*FAST, *IDENTITY[1:], "trainer.procs_per_node=2", "data.batch_size=16", "trainer.hang_timeout_s=6",
                  "trainer.timeout_s=3", f"hydra.run.dir={run_dir}", env=fault_env("hang", rank=1, step=3), timeout=180)
    assert proc.returncode == 1
    [summary] = (run_dir / "hang").glob("*-rank0/summary.txt")  # the incident rank 0 opened
    text = summary.read_text()
    assert "2 of 2 ranks answered" in text and "behind: rank 1 (" in text and "faulty_train_step" in text
    assert "a collective timed out" in json.loads((summary.parent / "rank0.json").read_text())["reason"]


def test_a_rank_that_fails_at_start_up_ends_the_job_with_its_error(launch, tmp_path):
    proc = launch(*FAST, *IDENTITY[1:], "trainer.procs_per_node=2", "data.batch_size=16", f"hydra.run.dir={tmp_path / 'run'}",
                  env=fault_env("config", rank=1), timeout=120)
    assert proc.returncode == 1
    assert "error: training failed" in proc.stderr
    assert "ValueError: injected config error on rank 1" in proc.stderr  # the failing rank's own traceback
    assert "rank 1 failed, exit code 1" in proc.stderr
    assert proc.stderr.count("Traceback (most recent call last)") == 1  # once, not once per rank and again in a report


BOOM = """
import torch
from torch import nn


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(256, 10))
        self.calls = 0

    def forward(self, x):
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls == 3:
                raise ValueError("boom at the third step")
        return self.body(x)
"""


def rank_failure(folder, rank: int, text: str, at: int) -> dict:
    """What a node's agent holds of its rank `rank` failing with `text` at time `at` (its error file)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = folder / f"error{rank}.json"
    error_file.write_text(json.dumps({"message": {"message": text, "extraInfo": {"py_callstack": "", "timestamp": str(at)}}}))
    return {rank: ProcessFailure(0, 100 + rank, 1, str(error_file))}


CAUSE = (1, "ValueError: the user's model broke")
PEER_LOST = (0, "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:41600")


def test_status_keeps_the_rank_that_failed_by_itself_whichever_nodes_agent_writes_first(tmp_path):
    """Each node's agent writes its own ranks' failure: node 0's rank 0 only lost its peer (gloo's "Connection
    closed by peer") when node 1's rank 1 raised, and wrote last on Ray, hiding the user's error (the matrix's
    ray-fsdp-fail)."""
    from launcher.backends.local import note_failure
    from train.observe.status import read_status

    cause, lost = rank_failure(tmp_path, *CAUSE, at=1000), rank_failure(tmp_path, *PEER_LOST, at=1000)
    for order in ((cause, lost), (lost, cause)):
        run_dir = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
        run_dir.mkdir()
        for failures in order:
            note_failure(run_dir, failures)
        assert read_status(run_dir)["error"] == "rank 1 failed, exit code 1: ValueError: the user's model broke"


HOLD_STATUS = """import sys
from pathlib import Path
from train.observe.status import status_held, write_status
with status_held(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.readline()
    write_status(Path(sys.argv[1]), "failed", error=sys.argv[2], first_failed=[False, 1000])
"""


def test_nodes_reporting_at_once_do_not_both_read_status_before_either_writes(tmp_path):
    """Two nodes' launchers reported their ranks' failures in the same moment: node 0 read status.json, node 1 wrote
    its rank's own error, node 0 wrote its rank's lost peer over it (the matrix's nodes-fsdp-fail). A report reads
    and writes with the file held: node 0's waits for node 1's, then sees it and keeps it."""
    import threading

    from launcher.backends.local import note_failure
    from train.observe.status import read_status

    cause = "rank 1 failed, exit code 1: ValueError: the user's model broke"
    other_node = subprocess.Popen([sys.executable, "-c", HOLD_STATUS, str(tmp_path), cause], cwd=REPO,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other_node.stdout.readline().strip() == "held"
        report = threading.Thread(target=note_failure, args=(tmp_path, rank_failure(tmp_path, *PEER_LOST, at=1000)))
        report.start()
        report.join(timeout=2)
        assert report.is_alive() and not (tmp_path / "status.json").exists()  # before: written at once
        other_node.communicate("go\n", timeout=30)
        report.join(timeout=30)
    finally:
        other_node.kill()
    assert other_node.returncode == 0
    assert read_status(tmp_path)["error"] == cause


def test_a_failure_is_reported_on_a_file_system_without_record_locks(tmp_path, monkeypatch, capsys):
    """Lustre mounted without flock refuses lockf (ENOLCK): every failure report raised there, and the run's status
    never said why it failed. Now it is written unlocked, said once."""
    import errno
    import fcntl

    from launcher.backends.local import record_failure
    from train.observe.status import read_status

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    record_failure(tmp_path, "rank 1 failed, exit code 1: ValueError: broke", (False, 1.0))
    record_failure(tmp_path, "rank 0 failed, exit code 1: lost its peer", (True, 2.0))
    assert read_status(tmp_path)["error"] == "rank 1 failed, exit code 1: ValueError: broke"
    assert capsys.readouterr().err.count("this file system has no record locks") <= 1


def test_a_node_whose_groups_all_failed_before_any_sign_of_life_stops_waiting_for_the_others(tmp_path):
    """Replica groups on several nodes, all failed before their first log step: RUN_DIR/.alive was never written,
    and the node's launcher waited for the other nodes' groups forever. The quiet time now counts from the wait's
    start."""
    import threading

    from launcher.backends.local import others_finish

    waiting = threading.Thread(target=others_finish, args=(tmp_path, 0.5), daemon=True)
    waiting.start()
    waiting.join(timeout=30)
    assert not waiting.is_alive()


def test_a_node_whose_groups_failed_stops_waiting_once_the_other_nodes_ended(tmp_path):
    """Two nodes' meeting places (the first hosts the Lighthouse and the store). A script's groups write no status:
    the first node's group finished and its launcher waited for the second node to end (its Lighthouse serves until
    then), while the second, its group failed for good, waited for the first node's groups by their sign of life,
    RUN_DIR/.alive, fresh from a moment ago: both held the SLURM job until the quiet time (trainer.hang_timeout_s)
    ran out (seen: a job RUNNING past its test's 180 s). It ends once the other nodes' launchers have ended."""
    import threading
    from types import SimpleNamespace

    from conftest import free_port
    from launcher.backends.lighthouse import meeting_place
    from launcher.backends.local import others_finish

    cfg = SimpleNamespace(trainer=SimpleNamespace(nodes=2, min_replicas=1),
                          launcher=SimpleNamespace(rdzv_endpoint=f"127.0.0.1:{free_port('127.0.0.1')}", rdzv_timeout_s=60))
    (tmp_path / ".alive").touch()
    first_in, first_ended = threading.Event(), threading.Event()

    def first_node():
        with meeting_place(cfg, first=True, place=0):
            first_in.set()  # its groups finished at once; leaving, it waits for the second node to end
        first_ended.set()

    threading.Thread(target=first_node, daemon=True).start()
    assert first_in.wait(30)
    waited = []
    with meeting_place(cfg, first=False, place=1) as meeting:
        second = threading.Thread(target=lambda: waited.append(others_finish(tmp_path, 600, meeting.others_ended)),
                                  daemon=True)
        second.start()
        second.join(timeout=30)
        assert waited, "the second node still waits for a first node that has ended"
    assert first_ended.wait(30)  # and the first node's wait ends with the second's


def test_ranks_that_fail_alike_print_one_traceback_and_a_line_each(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "boom.py").write_text(BOOM)
    proc = run_cli("launcher", *FAST, "trainer.procs_per_node=3", "~model", "+model._target_=boom.Boom",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=project)
    assert proc.returncode == 1
    assert proc.stderr.count("Traceback (most recent call last)") == 1
    assert proc.stderr.count('raise ValueError("boom at the third step")') == 1
    first = int(proc.stderr.split("error: training failed.\nrank ")[1].split()[0])
    others = sorted({0, 1, 2} - {first})
    assert all(f"rank {r} failed, exit code 1: the same error" in proc.stderr for r in others)


def test_a_rendezvous_port_in_use_is_refused_before_start(launch, tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        proc = launch("trainer.nodes=2", f"launcher.rdzv_endpoint=localhost:{port}", f"hydra.run.dir={tmp_path / 'run'}", timeout=60)
    assert proc.returncode == 2
    assert f"launcher.rdzv_endpoint=localhost:{port}: port {port} is already in use" in proc.stderr


def test_a_process_taking_the_port_the_agent_picked_does_not_stop_the_ranks_meeting(launch, tmp_path):
    """torch's agent picks a free MASTER_PORT and lets it go; rank 0 bound it seconds later, and a process that bound
    it in between (here: a fault in rank 0 before it starts) made rank 0 fail with EADDRINUSE (seen in CI). Rank 0
    now serves the attempt's store on a port the system gives it, and says where in the rendezvous store: the port
    the agent picked can be taken and the ranks meet all the same."""
    proc = launch(*FAST, *IDENTITY[1:], "trainer.procs_per_node=2", "data.batch_size=16", "trainer.max_steps=2",
                  f"hydra.run.dir={tmp_path / 'run'}", env=fault_env("take_port", rank=0), timeout=120)
    assert "[fault] took MASTER_PORT" in proc.stdout  # nothing holds the agent's pick: the fault took it
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def half_run(tmp_path_factory):
    """IDENTITY on 2 processes stopped at step 12 of 24 (read-only: a test resumes a copy of it)."""
    tmp = tmp_path_factory.mktemp("half")
    proc = run_cli("launcher", *IDENTITY, "trainer.procs_per_node=2", "data.batch_size=16", "trainer.max_steps=12",
                   f"hydra.run.dir={tmp / 'run'}", cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "run"


def test_resume_at_another_world_size_continues_from_the_same_sample(launch, tmp_path, half_run, two_process_ddp):
    split = tmp_path / "split"
    shutil.copytree(half_run, split)
    # Resumed on one process with the same global batch (32): the same samples in the same order.
    second = launch(*IDENTITY, "trainer.procs_per_node=1", "data.batch_size=32", f"hydra.run.dir={split}")
    assert second.returncode == 0
    assert "resuming a checkpoint of world size 2 (global batch 32) at world size 1 (global batch 32)" in second.stderr
    assert "resumed at step 12" in second.stdout
    a, b = final_checkpoint(two_process_ddp), final_checkpoint(split)  # the same run straight through
    assert a["step"] == b["step"] == 24
    for name in a["model"]:
        torch.testing.assert_close(b["model"][name], a["model"][name], rtol=1e-5, atol=1e-6)


def test_resume_with_another_global_batch_maps_the_position_by_sample(launch, tmp_path, half_run):
    run_dir = tmp_path / "run"
    shutil.copytree(half_run, run_dir)
    # 12 steps x 32 samples = 384 samples into epoch 0; with a global batch of 16 that is step 24.
    proc = launch(*IDENTITY, "trainer.procs_per_node=1", "data.batch_size=16", "trainer.max_steps=30", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0 and "resumed at step 24" in proc.stdout
    assert final_checkpoint(run_dir)["step"] == 30


ABORTS_AT_EXIT = """
import atexit
import os

from torch import nn

if "RANK" not in os.environ:  # the launcher's process: its finalization aborts, as a torch C++ thread can make it
    atexit.register(os.abort)


def model(**_):
    return nn.Sequential(nn.Flatten(), nn.Linear(256, 10))
"""


def test_a_launcher_whose_interpreter_would_abort_at_exit_still_ends_with_the_runs_exit_code(tmp_path, launch):
    """The launcher ends as a rank does, without the interpreter's finalization, where a C++ thread of torch's (the
    rendezvous store a script's ranks share) was seen to abort it after a clean SIGTERM stop: exit -6 instead of
    143, "terminate called without an active exception". Here the user's module makes finalization abort."""
    (tmp_path / "aborts_at_exit.py").write_text(ABORTS_AT_EXIT)
    proc = launch(*FAST, "model._target_=aborts_at_exit.model", "trainer.max_steps=1", "trainer.eval_every=0",
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert final_checkpoint(tmp_path / "run")["step"] == 1


def test_a_second_ctrl_c_stops_the_workers_at_once(tmp_path):
    """Rank 0 hangs, so the first SIGINT's graceful stop cannot finish; the second one must not wait for it."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "launcher", *FAST, *IDENTITY[1:], "trainer.procs_per_node=2", "data.batch_size=16",
               "trainer.hang_timeout_s=0", "launcher.shutdown_timeout_s=600", "checkpoint.every_steps=4",
               f"hydra.run.dir={run_dir}"]
    stderr_path = tmp_path / "stderr"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env={**os.environ, **fault_env("hang", rank=0, step=10)})
        try:
            # Step 8 logged is not step 8 saved: wait for its checkpoint's commit, the state the status must name
            wait_for(lambda: [c.step for c in committed(run_dir / "checkpoints")][-1:] == [8], timeout=120,
                     what="the checkpoint of step 8 before the hang")
            proc.send_signal(signal.SIGINT)
            wait_for(lambda: "SIGINT: the workers save a checkpoint" in stderr_path.read_text(), timeout=30,
                     what="the launcher to pass the first SIGINT on")
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=60)  # far below the 600 s the workers would otherwise get
        finally:
            kill_leftovers(proc, run_dir)
    err = stderr_path.read_text()
    print(out, err)
    assert "SIGINT again: stopping the workers now" in err
    assert proc.returncode == 128 + signal.SIGINT
    workers = subprocess.run(["pgrep", "-f", f"train {run_dir}/config.yaml"], capture_output=True, text=True)
    assert workers.stdout == ""  # no orphaned worker left behind
    # No rank could say where it stopped: the status names the newest checkpoint, where the same command resumes
    assert read_status(run_dir) | {"time": 0} == {"status": "stopped", "step": 8, "time": 0}
    assert final_checkpoint(run_dir)["step"] == 8


def test_a_second_launch_into_a_running_run_dir_is_refused(launch, tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "launcher", *FAST, *IDENTITY[1:], "trainer.procs_per_node=2", "data.batch_size=16",
               "trainer.max_steps=-1", "trainer.epochs=100000", f"hydra.run.dir={run_dir}"]  # runs until killed
    with subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, **slowed_steps()}) as first:
        try:
            wait_for(lambda: bool(logged_steps(run_dir)), timeout=120, what="the first run to train")
            second = launch(*FAST, *IDENTITY[1:], "trainer.procs_per_node=2", "data.batch_size=16", f"hydra.run.dir={run_dir}")
        finally:
            kill_leftovers(first, run_dir)
    assert second.returncode == 2
    assert f"hydra.run.dir={run_dir} is in use by another launcher (pid {first.pid} on " in second.stderr
    assert "plan:" not in second.stdout  # no worker of the second launch started


@pytest.mark.alone
def test_a_rank_that_compiles_slower_than_the_collective_timeout_is_waited_for(launch, tmp_path):
    """Under trainer.compile the first step (and the first evaluation) compile, for minutes, and ranks finish apart:
    rank 1 here takes 6 s longer than rank 0, against 3 s limits for collectives and hangs."""
    env = {**fault_env("slow_compile", rank=1, step=1), "FAULT_DELAY_MS": "6000"}
    proc = launch(*FAST, *IDENTITY[1:], "trainer.procs_per_node=2", "data.batch_size=16", "trainer.compile=true",
                  "trainer.max_steps=4", "trainer.timeout_s=3", "trainer.hang_timeout_s=3", f"hydra.run.dir={tmp_path / 'run'}",
                  env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final_checkpoint(tmp_path / "run")["step"] == 4


SLOW_MODEL = '''
import os
import time

import torch.nn as nn


class SlowToBuild(nn.Module):
    """Takes `seconds` to build in a training worker (not in the launcher's check): computing, or blocked."""

    def __init__(self, seconds: float, computing: bool):
        super().__init__()
        end = time.monotonic() + (seconds if "RANK" in os.environ else 0)
        while computing and time.monotonic() < end:
            sum(range(10000))
        if not computing:
            time.sleep(seconds if "RANK" in os.environ else 0)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(256, 10))

    def forward(self, x):
        return self.net(x)
'''


@pytest.mark.parametrize("computing", [True, False])
def test_a_start_up_longer_than_the_hang_limit_is_no_hang_while_it_computes(launch, tmp_path, computing):
    """A model whose build takes 6 s with trainer.hang_timeout_s=2: it exited 70 "no progress" (nothing beat
    before the first step). A phase that computes progresses; one that is blocked is still a hang, named by phase."""
    (tmp_path / "slow_model.py").write_text(SLOW_MODEL)
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "slow.yaml").write_text(
        f"_target_: slow_model.SlowToBuild\nseconds: 6\ncomputing: {str(computing).lower()}\n")
    proc = launch("--config-dir", "conf", "model=slow", *FAST, "trainer.hang_timeout_s=2", "trainer.max_steps=2",
                  f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    if computing:
        assert proc.returncode == 0, proc.stderr[-2000:]
        timeline = re.search(r"start-up: ([\d.]+) s on rank 0 \(preparing the data [\d.]+ s, building the model "
                             r"([\d.]+) s, .*the first step [\d.]+ s\)", proc.stdout)
        assert timeline and float(timeline.group(2)) >= 6 and "no progress" not in proc.stderr
        [record] = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "startup"]
        assert record["rank0_building_the_model_s"] >= 6
    else:
        assert proc.returncode == 1
        assert re.search(r"no progress for \d+ s \(starting: building the model after step 0; limit "
                         r"trainer.hang_timeout_s=2\)", proc.stderr)
        assert "exit code 70" in proc.stderr and "slow_model.py" in proc.stderr


def test_the_agent_extensions_apply_on_the_tested_torch():
    from launcher.backends.agent import extensions_supported

    assert extensions_supported()


def test_the_agents_report_of_a_frozen_rank_names_its_global_rank(monkeypatch, tmp_path):
    """A node's agent reports a rank stopped past the hang limit: its failure was keyed by the local rank, where
    torch's own monitor keys failures by the global one, so node 1's rank 2 was reported as rank 0."""
    from types import SimpleNamespace

    from launcher.backends import agent

    frozen_pid = 4242
    monkeypatch.setattr(agent, "stopped_below", lambda root: {frozen_pid: "train rank 3"})
    watcher = agent.Agent.__new__(agent.Agent)
    watcher.frozen_after_s, watcher.hang_dir, watcher.looked_at, watcher.stopped_since = 0.0, tmp_path, 0.0, {}
    watcher._pcontext = None  # no workers of its own to end
    group = SimpleNamespace(workers=[SimpleNamespace(local_rank=0, global_rank=2, id=4241),
                                     SimpleNamespace(local_rank=1, global_rank=3, id=frozen_pid)])
    result = watcher.frozen(group)
    assert list(result.failures) == [3] and result.failures[3].local_rank == 1
    assert agent.failure_headline(result.failures).startswith("rank 3 failed")


def test_a_torch_installed_without_its_sources_runs_torchs_own_agent_instead_of_failing(monkeypatch):
    """The check of the private parts the agent extends read torch's source outside its guard: an install with
    bytecode only (inspect.getsource: OSError) failed every launch."""
    import inspect

    from launcher.backends import agent

    def no_source(obj):
        raise OSError("could not get source code")

    monkeypatch.setattr(inspect, "getsource", no_source)
    assert agent.extensions_supported() is False


@pytest.mark.alone
@pytest.mark.parametrize("frozen", [1])  # rank 0, whose store the reports are asked through: the matrix's freeze cells
def test_a_frozen_rank_is_reported_and_the_group_restarts(tmp_path, frozen):
    """A rank stopped from outside (SIGSTOP, found by its process name: a rank stuck in a kernel or on a dead mount
    looks the same) is named by the others' hang report within trainer.hang_timeout_s and a bound, and the group is
    restarted, though rank 0 serves the store that the reports are asked through, and a stopped process holds a
    SIGTERM pending for ever."""
    run_dir, stderr_path = tmp_path / "run", tmp_path / "stderr.txt"
    command = [sys.executable, "-m", "launcher", *FAST, *IDENTITY[1:], "trainer.procs_per_node=2", "data.batch_size=16",
               "trainer.max_steps=-1", "trainer.epochs=100000", "launcher.max_restarts=1", "trainer.hang_timeout_s=3",
               "trainer.timeout_s=60", f"hydra.run.dir={run_dir}"]  # runs until stopped
    with open(stderr_path, "w") as stderr, subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                                                            stderr=stderr, text=True) as proc:
        try:
            wait_for(lambda: bool(logged_steps(run_dir)), timeout=120, what="the first logged steps")
            pid = process_named(f"train rank {frozen}", under=proc.pid)
            assert pid, f"no process named 'train rank {frozen}' under the launcher"
            os.kill(pid, signal.SIGSTOP)
            # 3 s without progress, up to 5 s for a store that does not answer, the others' answers: far below 60
            wait_for(lambda: any((run_dir / "hang").glob("*/summary.txt")), timeout=60, what="a hang report")
            wait_for(lambda: "restarting the workers (restart 1 of 1)" in stderr_path.read_text(), timeout=60,
                     what="the group's restart")
            wait_for(lambda: process_named(f"train rank {frozen}", under=proc.pid) not in (None, pid), timeout=60,
                     what="the restarted rank")
            wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=30, what="the frozen rank's end")
            logged = len(logged_steps(run_dir))
            wait_for(lambda: len(logged_steps(run_dir)) > logged, timeout=60, what="the restarted group to train")
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=120)
        finally:
            kill_leftovers(proc, run_dir)
    print(stderr_path.read_text())
    # The incident the live rank opened (the woken rank may open one of its own as it dies: it saw no progress)
    [summary] = (run_dir / "hang").glob(f"*-rank{1 - frozen}/summary.txt")
    text = summary.read_text()
    assert "1 of 2 ranks answered" in text and f"no report from rank {frozen}" in text
    assert read_status(run_dir)["status"] == "stopped"  # the restarted group stopped as asked, with a checkpoint
    assert final_checkpoint(run_dir)["step"] == read_status(run_dir)["step"]
    # The other rank, blocked with the frozen one (woken, it holds the collective), was ended within the agent's
    # grace: torch's process context stopped a failed group itself, waiting 30 s for each rank that did not end.
    assert "Unable to shutdown process" not in stderr_path.read_text()


def test_numa_binding_reaches_torchs_agent_as_its_public_option():
    """launcher.numa_binding is torchrun's --numa-binding: LaunchConfig.numa_options, which torch's agent applies to
    each GPU rank's start (a CPU rank is not bound)."""
    from torch.numa.binding import AffinityMode

    from pathlib import Path

    from conftest import typed
    from launcher.backends.local import launch_config

    cfg = typed("launcher.numa_binding=node")
    options = launch_config(cfg, Path("/tmp/run")).numa_options
    assert options.affinity_mode == AffinityMode.NODE and options.should_fall_back_if_binding_fails
    assert launch_config(typed(), Path("/tmp/run")).numa_options is None


def test_a_nodes_finished_script_does_not_write_over_another_nodes_failure(tmp_path):
    """Script mode, several nodes: every node's launcher writes status.json at its end; the last to end wrote
    "finished" over the failure another node had recorded."""
    import time

    from launcher.backends.local import note_finished, record_failure
    from train.observe.status import read_status, write_status

    started = time.time()
    record_failure(tmp_path, "rank 3 failed, exit code 1: ValueError: broke", (False, started))
    note_finished(tmp_path, started)
    assert read_status(tmp_path)["status"] == "failed"
    write_status(tmp_path, "failed", error="an earlier launch's")  # before this launch: this one's word stands
    note_finished(tmp_path, time.time() + 1)
    assert read_status(tmp_path)["status"] == "finished"
