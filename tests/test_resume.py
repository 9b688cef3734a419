"""Resume continues exactly what the uninterrupted run would do (or says what changed); slow checkpoint I/O is not
a hang; a stop signal is only a flag. Real processes, faults from tests/faults/sitecustomize.py."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import FAST, REPO, fault_env, final_checkpoint, read_metrics
from train.checkpoint import load, step_file_name

# 512 samples, 2 processes x 16: 16 steps per epoch.
SMALL = [*FAST, "data=synthetic", "data.num_samples=512", "data.batch_size=16", "model=mlp", "model.hidden=[32]",
         "trainer.procs_per_node=2", "optim.lr=0.05", "trainer.epochs=3"]


# The same 16 steps per epoch on one process accumulating 2 micro-batches: where epochs and the schedule, not the
# world, are under test.
ONE = [*SMALL, "trainer.procs_per_node=1", "trainer.accumulate=2"]


def evals(run_dir) -> dict[int, float]:
    return {r["step"]: r["acc"] for r in read_metrics(run_dir) if r["kind"] == "eval"}


def test_a_stop_on_the_last_step_of_an_epoch_still_evaluates_that_epoch(launch, tmp_path):
    run = [*SMALL, "trainer.max_steps=24", "trainer.stop_check_s=0.001", "checkpoint.every_steps=8"]
    straight = launch(*run, f"hydra.run.dir={tmp_path / 'straight'}")
    assert straight.returncode == 0
    split = tmp_path / "split"
    # SIGTERM during step 16: steps longer than stop_check_s are checked at once, so the ranks agree at the end of
    # step 16, the last step of epoch 1.
    stopped = launch(*run, f"hydra.run.dir={split}", env=fault_env("term", rank=0, step=16))
    assert stopped.returncode == 0 and "stopped at step 16 with a checkpoint" in stopped.stdout
    assert list(evals(split)) == [16]  # evaluated before stopping, not skipped for good
    saved = load(split / "checkpoints" / step_file_name(16))
    # every_steps=8 lands on the epoch end too: the file carries this evaluation, and best.pt is that file.
    assert saved["best_metric"] == evals(split)[16] and saved["eval_step"] == 16
    assert load(split / "checkpoints" / "best.pt")["step"] == 16

    resumed = launch(*run, f"hydra.run.dir={split}")
    assert resumed.returncode == 0 and "resumed at step 16" in resumed.stdout
    assert evals(split) == evals(tmp_path / "straight")  # the same evaluations at the same steps, the same numbers


def test_resumed_at_an_epoch_end_whose_evaluation_never_ran_it_evaluates_first(launch, tmp_path):
    run_dir = tmp_path / "run"
    assert launch(*ONE, "trainer.max_steps=16", "trainer.eval_every=0", f"hydra.run.dir={run_dir}").returncode == 0
    path = run_dir / "checkpoints" / step_file_name(16)
    assert load(path)["eval_step"] == 16  # the end of a run is evaluated; make it look like a skipped epoch end:
    state = load(path)
    state["eval_step"] = -1
    from train.checkpoint import CheckpointManager
    from train.config import CheckpointConfig

    CheckpointManager(path.parent, CheckpointConfig(), is_writer=True).save(state, 16)
    resumed = launch(*ONE, "trainer.max_steps=20", f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0
    assert [s for s in evals(run_dir)] == [16, 20]  # epoch 1 evaluated on resume, before training on


def test_a_changed_number_of_epochs_on_resume_is_reported_and_followed(launch, tmp_path):
    from train.optim import WarmupSchedule

    run_dir = tmp_path / "run"
    run = [*ONE, "optim.schedule.warmup_epochs=0", f"hydra.run.dir={run_dir}"]  # a cosine from the first step
    assert launch(*run, "trainer.epochs=2", "trainer.max_steps=10").returncode == 0
    resumed = launch(*run, "trainer.epochs=4", "trainer.max_steps=12", "trainer.log_every=1")
    assert resumed.returncode == 0
    assert "the lr schedule changed since the checkpoint (trainer.epochs: 2 -> 4)" in resumed.stderr
    lr_after_12 = [r["lr"] for r in read_metrics(run_dir) if r["kind"] == "train" and r["step"] == 12][0]
    four_epochs, two_epochs = (WarmupSchedule(steps_per_epoch=16, total_steps=total) for total in (64, 32))
    assert math.isclose(lr_after_12, 0.05 * four_epochs(12), rel_tol=1e-12)
    assert not math.isclose(lr_after_12, 0.05 * two_epochs(12))


@pytest.mark.alone
def test_checkpoint_io_slower_than_every_limit_is_not_a_hang(launch, tmp_path):
    """Each save and load takes ~3.8 s (~75 kB at 50 ms per kB) against 3 s limits for hangs and collectives."""
    run_dir = tmp_path / "run"
    limits = ["trainer.hang_timeout_s=3", "trainer.timeout_s=3", "trainer.eval_every=0", f"hydra.run.dir={run_dir}"]
    slow = {"FAULT_DELAY_MS": "50"}
    first = launch(*SMALL, *limits, "trainer.max_steps=5", env={**fault_env("slow_io", rank=0), **slow})
    assert first.returncode == 0, "a slow save on rank 0 was taken for a hang"
    # Resume with every rank slow: rank 0 reads and hashes while rank 1 waits for its choice, then rank 1 reads
    # while rank 0 waits for it, then rank 0 saves while rank 1 waits.
    resumed = launch(*SMALL, *limits, "trainer.max_steps=10", env={**fault_env("slow_io", rank=0), "FAULT_RANK": "all", **slow})
    assert resumed.returncode == 0, "slow checkpoint reads were taken for a hang"
    assert "resumed at step 5" in resumed.stdout and "no progress" not in resumed.stderr
    # The file is hashed once per node, by its first rank; every rank then maps it (no copy per process).
    assert "[io rank 0] verifying step_00000005.pt" in resumed.stderr and "[io rank 1] verifying" not in resumed.stderr
    assert final_checkpoint(run_dir)["step"] == 10


@pytest.mark.alone
def test_a_step_directory_committed_slower_than_every_limit_is_not_a_hang(launch, tmp_path):
    """Under fsdp (sharded checkpoints) rank 0 takes 4.5 s to commit while rank 1 waits in the save's last
    collective, on the training group itself (gloo), whose limit is 3 s outside such waits."""
    run_dir = tmp_path / "run"
    limits = ["trainer.hang_timeout_s=3", "trainer.timeout_s=3", "trainer.eval_every=0", f"hydra.run.dir={run_dir}"]
    run = [*SMALL, "trainer.strategy=fsdp", "checkpoint.format=dcp", *limits]
    slow = launch(*run, "trainer.max_steps=3", env={**fault_env("slow_commit", rank=0), "FAULT_DELAY_MS": "4500"})
    assert slow.returncode == 0, "waiting for rank 0's commit was taken for a hang"
    assert (run_dir / "checkpoints" / "step_00000003" / "manifest.json").is_file()


HANDLER = textwrap.dedent(
    """
    import os, signal, sys
    import torch.distributed as dist
    from train.dist import control_group
    from train.stopping import StopRequest

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    stop = StopRequest(["SIGUSR1"], 0.001, group=control_group("gloo"))

    class NoWrites:
        def write(self, text):
            raise RuntimeError("the signal handler wrote to stderr")
        def flush(self):
            pass

    real, sys.stderr = sys.stderr, NoWrites()
    os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs here, inside whatever the program was doing
    sys.stderr = real
    print("flag", stop.received == signal.SIGUSR1, flush=True)
    print("agreed", stop.agreed(1), flush=True)
    stop.close()
    dist.destroy_process_group()
    from train.dist import exit_without_finalizing
    exit_without_finalizing(0)  # as a rank ends: a gloo thread can abort the interpreter's finalization (its docstring)
    """
)


def test_the_stop_signal_handler_only_sets_a_flag_and_the_loop_reports_it():
    proc = subprocess.run([sys.executable, "-c", HANDLER], cwd=REPO, capture_output=True, text=True, timeout=60)
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0
    assert "flag True" in proc.stdout and "agreed True" in proc.stdout
    assert "SIGUSR1: saving a checkpoint at the next step boundary" in proc.stderr  # printed by the loop, later


COPIES = textwrap.dedent(
    """
    import os, signal
    import torch.distributed as dist
    from train.stopping import SAME_DELIVERY_S, StopRequest

    now = [100.0]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    stop = StopRequest(["SIGUSR1"], 0.001, group=dist.group.WORLD, clock=lambda: now[0])
    for _ in range(3):  # the rank itself, its relay passing it on, its agent passing it on: one stop
        os.kill(os.getpid(), signal.SIGUSR1)
    print("one stop", stop.received == signal.SIGUSR1, flush=True)
    now[0] += SAME_DELIVERY_S + 0.5  # a person's second Ctrl-C: stop at once
    os.kill(os.getpid(), signal.SIGUSR1)
    print("still alive", flush=True)
    """
)


def test_copies_of_one_stop_signal_are_one_stop_and_a_later_one_stops_at_once():
    """On SLURM a step's signal reaches a rank itself, through its relay and through its agent within milliseconds:
    taken as a second signal, the replica groups died (exit 143) without their stop's checkpoint."""
    proc = subprocess.run([sys.executable, "-c", COPIES], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "one stop True" in proc.stdout, proc.stderr[-2000:]
    assert "still alive" not in proc.stdout and proc.returncode == -signal.SIGUSR1


class Clock:
    """Simulated time: the loop below advances it by one step's duration per step."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("step_s", [0.002, 0.5, 30.0])
def test_a_stop_is_agreed_within_seconds_of_the_signal_whatever_the_step_time(step_s):
    """Counted in steps (every 10), a stop with 30 s steps was agreed 110-330 s after the signal: past SLURM's
    120 s warning. Counted in seconds: within check_s plus two steps, with few checks on fast steps."""
    import signal

    import torch.distributed as dist

    from train.stopping import StopRequest

    check_s, clock, calls = 5.0, Clock(), []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        stop = StopRequest([], check_s, group=dist.group.WORLD, clock=clock)
        real = dist.all_reduce
        dist.all_reduce = lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)
        signalled_at = 600.0  # seconds into the run
        step = 0
        while True:
            step += 1
            clock.now += step_s
            if stop.received is None and clock.now >= signalled_at:
                stop.received = signal.SIGUSR1  # what the handler does
                signal_time = clock.now - step_s / 2  # in the middle of this step
            if stop.agreed(step):
                break
        dist.all_reduce = real
    finally:
        dist.destroy_process_group()
    assert clock.now - signal_time <= check_s + 2 * step_s
    assert len(calls) <= signalled_at / check_s + 3 if step_s < check_s else len(calls) == step
