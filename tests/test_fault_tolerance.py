"""trainer.fault_tolerance=replicas: replica groups under torchft (real processes, gloo, torchft's real Lighthouse).
A killed group restarts alone and heals from the live one, which never goes back a step; a group that never returns
leaves the others to finish; a whole-job restart still resumes from the disk checkpoint; and what cannot hold is
refused before start."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket

import pytest
import torch

from conftest import FAULTS_DIR, IDENTITY, final_checkpoint, read_metrics, slowed_steps
from train.checkpoint import committed
from test_multinode import NEEDS_NAMESPACES, hosts_file, node, nodes

GROUPS = [*IDENTITY, "trainer.procs_per_node=2", "data.batch_size=16", "trainer.fault_tolerance=replicas"]


def killed(group: int, step: int, delay_ms: int = 100) -> dict:
    """Group `group`'s rank 0 SIGKILLs itself at its step `step`; every step takes `delay_ms` longer (tests/faults)."""
    return {"PYTHONPATH": str(FAULTS_DIR), "FAULT": "kill", "FAULT_GROUP": str(group), "FAULT_RANK": "0",
            "FAULT_STEP": str(step), "STEP_DELAY_MS": str(delay_ms)}


def train_steps(run_dir) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"]


def test_two_replica_groups_train_as_ddp_does_while_both_take_part(tmp_path, launch, two_process_ddp):
    proc = launch(*GROUPS, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0
    assert "fault tolerance: 2 replica groups of 1 (torchft; a step needs 1)" in proc.stdout
    ours, ddp = final_checkpoint(tmp_path / "run"), final_checkpoint(two_process_ddp)
    assert ours["step"] == ddp["step"] == 24
    for name, tensor in ddp["model"].items():  # the groups' mean gradient is the global batch's, as under ddp
        assert torch.allclose(ours["model"][name], tensor, rtol=0, atol=1e-6), name
    assert all(r["participants"] == 2 for r in read_metrics(tmp_path / "run") if r["kind"] == "train")


def test_a_group_busy_longer_than_the_exchange_timeout_is_waited_for_in_the_quorum(tmp_path, launch):
    """Group 1 is alive but busy (a save, an evaluation, a restart's start) for 5 s before the quorum of its 5th
    step, longer than trainer.timeout_s=2: group 0 waits in its quorum as the Lighthouse does (it waits up to
    STRAGGLER_WAIT_S for a group that heartbeats). Before, the Manager gave up after trainer.timeout_s
    ("Timeout expired") while the Lighthouse was still forming that quorum: the conformance matrix's
    local-replicas-freeze saw it when its restarted group asked while the other was evaluating."""
    run_dir = tmp_path / "run"
    proc = launch(*GROUPS, "trainer.timeout_s=2", f"hydra.run.dir={run_dir}",
                  env={"PYTHONPATH": str(FAULTS_DIR), "QUORUM_DELAY_MS": "5000", "QUORUM_DELAY_GROUP": "1",
                       "QUORUM_DELAY_AT": "5"})
    assert "[fault] group 1 busy before its quorum" in proc.stderr
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Timeout expired" not in proc.stderr and "restarting" not in proc.stderr  # nobody failed
    assert [r for r in read_metrics(run_dir) if r["kind"] == "train"][-1]["step"] == 24
    for group in (0, 1):  # both there at the end, neither failed nor left behind
        assert f"replica group {group}: weights identical to the other groups' at step 24 (2 taking part)" in proc.stdout


# Ctrl-C to the terminal's process group: the conformance matrix's cell local-replicas-stop (tests/conformance).


def test_a_killed_group_restarts_heals_from_the_live_one_and_both_end_identical(tmp_path, launch):
    run_dir = tmp_path / "run"
    proc = launch(*GROUPS, "trainer.epochs=4", "trainer.max_steps=64", "trainer.log_every=2", "launcher.max_restarts=1",
                  f"hydra.run.dir={run_dir}", env={**killed(group=1, step=10), "TRACE_START": "1",
                                                   "HEAL_MARKER": str(tmp_path / "group-1-back"), "HEAL_BEFORE_STEP": "40"})
    assert proc.returncode == 0
    # Each group's ranks, the restarted ones too, are fresh interpreters that its agent started, as torchrun starts
    # them: nothing imported before the rank's own code (tests/faults: TRACE_START).
    started = re.findall(r"\[start rank \d attempt (\d)\] .* preloaded (\w+) parent's module (\S+)", proc.stderr)
    assert sorted(started) == [("0", "False", "launcher.backends.replicas")] * 2 + [("1", "False", "launcher.backends.replicas")]
    steps = train_steps(run_dir)  # logged by group 0, which was never stopped
    assert steps == sorted(set(steps)) and steps[-1] == 64  # it never went back a step
    # Group 0 takes steps alone while group 1 restarts, and holds its quorum of step 40 until group 1 asks for one
    # (tests/faults: HEAL_MARKER; a restart under load took longer than group 0's remaining steps): both take part
    # at the end.
    assert [r["participants"] for r in read_metrics(run_dir) if r["kind"] == "train"][-1] == 2
    assert "restarting the workers (restart 1 of 1); replica group 1 rejoins the others and takes a live group's " \
           "weights" in proc.stderr + proc.stdout  # not "resumes from the newest checkpoint": it heals
    healed = [line for line in proc.stderr.splitlines() if "healed from a live replica group: at step" in line]
    assert len(healed) == 1
    healed_at = int(healed[0].split()[-1])
    # Group 1 died at the start of its step 10, with 9 committed (its step 10 was dropped by every group): it came
    # back at the live step, 9 or later, so nothing it had done was redone.
    assert 9 <= healed_at
    assert "Unable to reset NCCL flight recorder" not in proc.stderr  # torchft's noise at each heal: gloo here
    for group in (0, 1):  # each on a line of its own (two groups' lines once ran together), prefixed with its rank
        assert f"[group{group} rank0]:replica group {group}: weights identical to the other groups' at step 64 " \
               f"(2 taking part)" in proc.stdout.splitlines()


def test_fsdp_groups_of_two_processes_heal_shard_by_shard_and_end_identical(tmp_path, launch):
    """2 groups x 2 processes, each group's model sharded over its 2 (fsdp): rank r of the killed group heals its
    shards, and its optimizer state's, from rank r of the live one. A step needs both groups (min_replicas=2): the
    live one waits for the other's return (it cannot finish first, however slow the restart is under load)."""
    run_dir = tmp_path / "run"
    proc = launch(*GROUPS, "trainer.procs_per_node=4", "data.batch_size=8", "trainer.strategy=fsdp",
                  "trainer.min_replicas=2", "trainer.max_steps=24", "trainer.log_every=2", "launcher.max_restarts=1",
                  f"hydra.run.dir={run_dir}", env=killed(group=1, step=6))
    assert proc.returncode == 0, proc.stderr
    assert "fault tolerance: 2 replica groups of 2 (torchft; a step needs 2)" in proc.stdout
    steps = train_steps(run_dir)
    assert steps == sorted(set(steps)) and steps[-1] == 24
    healed = [int(line.split()[-1]) for line in proc.stderr.splitlines() if "healed from a live replica group" in line]
    assert len(healed) == 2 and healed[0] == healed[1] >= 5  # both ranks of group 1, at the live step
    # Equal at the end only if the heal sent the optimizer's shards too: group 1 restarted with no checkpoint, and
    # fresh (empty) momentum buffers would have made its updates, and its weights, differ from then on.
    for group in (0, 1):
        assert f"replica group {group}: weights identical to the other groups' at step 24 (2 taking part)" in proc.stdout


def back(tmp_path) -> dict[str, str]:
    """Group 0 waits before its last evaluation until the restarted group 1 is about to ask for its first quorum
    (tests/faults: END_WAIT_MARKER and HEAL_MARKER, one file; never held at a step before): no 15 s guess of how long
    a restart takes under load."""
    marker = str(tmp_path / "group-1-back")
    return {"END_WAIT_MARKER": marker, "HEAL_MARKER": marker, "HEAL_BEFORE_STEP": str(10**9)}


def test_a_group_back_as_the_others_end_heals_in_their_last_quorum_and_checks_its_weights_there(tmp_path, launch):
    """Group 1 dies after its last step and is back (from no checkpoint) while group 0, done, is slow to end (it waits
    before its last evaluation until group 1 is about to ask for its first quorum; tests/faults): group
    1's first quorum is group 0's last one (its weight check), in which group 1 heals straight to the end. Group 1
    then checks its weights in that same quorum; in a new one, which group 0 (waiting in its check's all-reduce)
    never joins, both waited until trainer.timeout_s (a 300 s hang seen under load)."""
    run_dir = tmp_path / "run"
    proc = launch(*GROUPS, "launcher.max_restarts=1", "trainer.timeout_s=60", f"hydra.run.dir={run_dir}",
                  env={**killed(group=1, step=0), "FAULT": "kill_at_end", **back(tmp_path)}, timeout=180)
    assert proc.returncode == 0, proc.stderr
    healed = [int(line.split()[-1]) for line in proc.stderr.splitlines() if "healed from a live replica group" in line]
    assert healed == [24]  # straight to the end, in group 0's last quorum
    for group in (0, 1):
        assert f"replica group {group}: weights identical to the other groups' at step 24 (2 taking part)" in proc.stdout


def test_a_group_back_after_the_others_ended_the_run_leaves_their_checkpoints_and_status(tmp_path, launch):
    """Group 1 dies at step 20 and resumes from the checkpoint of step 16; group 0 ends the run (step 24, its final
    checkpoint and status) before group 1 joins a quorum (tests/faults: RESTART_AFTER_END, END_WAIT_MARKER). Alone in
    its first quorum, group 1 trained on from step 16 to 24 and wrote its own step 24 over group 0's final checkpoint,
    its step lines into metrics.jsonl and its status (no evaluation) over the run's: a history that never was. It
    now takes the newest checkpoint, finds the run ended there, and writes nothing."""
    run_dir = tmp_path / "run"
    # group 0 evaluates and writes step 24 only once group 1 has resumed (from step 16, the newest then)
    proc = launch(*GROUPS, "launcher.max_restarts=1", f"hydra.run.dir={run_dir}", timeout=180,
                  env={**killed(group=1, step=20), "RESTART_AFTER_END": str(run_dir),
                       "END_WAIT_MARKER": str(run_dir / "restarted")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    at_end = json.loads((run_dir / "checkpoints-at-end.json").read_text())  # as group 0 left them
    assert "step_00000024.pt" in at_end
    assert {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in (run_dir / "checkpoints").iterdir() if path.is_file()} == at_end
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "finished" and status["step"] == 24, status
    assert any(key.startswith("eval_") for key in status), status  # group 0's, with its evaluation
    logged = train_steps(run_dir)
    assert logged == sorted(set(logged)) and logged[-1] == 24, logged
    assert "replica group 1: the other groups finished the run at step 24 while this group restarted: nothing left " \
           "to do" in proc.stdout, proc.stdout[-3000:]


@NEEDS_NAMESPACES
def two_nodes(tmp_path, overrides: list[str], env: dict) -> tuple[list[int], str, str]:
    """The same launch on nodes n1 and n2 (tests/test_multinode.py: namespaces, a hosts file), n1 the rendezvous
    host: their exit codes and their logs."""
    hosts = hosts_file(tmp_path)
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    overrides = [*overrides, f"launcher.rdzv_endpoint=n1:{port}", "launcher.rdzv_timeout_s=120"]
    logs = {name: tmp_path / f"{name}.log" for name in ("n1", "n2")}
    with nodes([]) as procs:
        for name in ("n1", "n2"):
            with open(logs[name], "w") as log:
                procs.append(node(name, hosts, overrides, tmp_path, log, env={**os.environ, **env}))
        codes = [p.wait(timeout=240) for p in procs]
    n1, n2 = logs["n1"].read_text(), logs["n2"].read_text()
    print(f"--- n1\n{n1}\n--- n2\n{n2}")
    return codes, n1, n2


def test_two_nodes_a_group_each_the_killed_one_heals_from_the_first_nodes(tmp_path):
    """Two launchers acting as nodes n1 and n2 (tests/test_multinode.py), a replica group on each: n1 hosts the
    Lighthouse and the groups' store on launcher.rdzv_endpoint; group 1, on n2, is killed, restarts there alone and
    heals from group 0 over the network, while group 0 never stops."""
    run_dir = tmp_path / "run"
    codes, n1, n2 = two_nodes(tmp_path, [*GROUPS, "trainer.nodes=2", "trainer.procs_per_node=1", "trainer.epochs=4",
                                         "trainer.max_steps=64", "trainer.log_every=2", "launcher.max_restarts=1",
                                         f"hydra.run.dir={run_dir}"],
                                 # group 0 holds its quorum of step 40 until group 1 is back (tests/faults: a restart
                                 # under load took longer than group 0's remaining steps, and nothing healed)
                                 {**killed(group=1, step=10), "HEAL_MARKER": str(tmp_path / "group-1-back"),
                                  "HEAL_BEFORE_STEP": "40"})
    assert codes == [0, 0]
    steps = train_steps(run_dir)  # logged by group 0, on n1
    assert steps == sorted(set(steps)) and steps[-1] == 64
    assert "restarting the workers (restart 1 of 1)" in n2 and "restarting" not in n1
    assert n2.count("healed from a live replica group: at step") == 1
    assert "replica group 0: weights identical to the other groups' at step 64 (2 taking part)" in n1
    assert "replica group 1: weights identical to the other groups' at step 64 (2 taking part)" in n2


def test_two_nodes_when_the_first_nodes_group_is_gone_the_other_finishes_and_the_first_node_waits(tmp_path):
    """Group 0, on n1 (the node of the Lighthouse), is killed for good: n1 waits for n2's group while it trains, by
    every group's sign of life (metrics.jsonl, group 0's alone, stopped growing: n1 gave up after
    trainer.hang_timeout_s and its Lighthouse went with it); group 1 writes the checkpoints and the end."""
    run_dir = tmp_path / "run"
    codes, n1, n2 = two_nodes(tmp_path, [*GROUPS, "trainer.nodes=2", "trainer.procs_per_node=1", "trainer.epochs=4",
                                         "trainer.max_steps=48", "trainer.log_every=2", "trainer.hang_timeout_s=6",
                                         "launcher.max_restarts=0", f"hydra.run.dir={run_dir}"],
                              killed(group=0, step=4, delay_ms=300))  # ~13 s of group 1 alone after the kill
    assert codes == [0, 0]
    assert "replica group(s) [0] failed for good; waiting for the other nodes' groups" in n1
    assert "replica group 1: weights identical to the other groups' at step 48 (1 taking part)" in n2
    assert final_checkpoint(run_dir)["step"] == 48
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"


def test_a_group_0_that_never_returns_leaves_the_other_to_finish_and_to_write_the_checkpoints(tmp_path, launch):
    """Group 0 wrote the run's checkpoints and status alone: gone for good at step 5, the other group trained to the
    end and the run finished with no checkpoint of it. The first group of each step's quorum writes."""
    run_dir = tmp_path / "run"
    proc = launch(*GROUPS, "launcher.max_restarts=0", "checkpoint.every_steps=4", f"hydra.run.dir={run_dir}",
                  env=killed(group=0, step=5))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "replica group(s) [0] failed for good; the others finished the run" in proc.stderr
    steps = [c.step for c in committed(run_dir / "checkpoints")]
    assert steps[-1] == 24 and final_checkpoint(run_dir)["step"] == 24, steps
    commits = [c.commit for c in committed(run_dir / "checkpoints")]
    assert commits == sorted(commits) and len(set(commits)) == len(commits)  # group 1's numbered after group 0's
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
    # The record goes on with the run: metrics.jsonl's step lines were group 0's alone and stopped at its failure.
    logged = [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert logged == sorted(set(logged)) and logged[-1] == 24, logged  # each log step once, to the end
    assert [r["participants"] for r in read_metrics(run_dir) if r["kind"] == "train"][-1] == 1
    assert "step 24/24 " in proc.stdout, proc.stdout[-1500:]  # the console line too, from the live group


def test_three_groups_check_their_weights_identical_exactly(tmp_path, launch):
    """The end-of-run check compared each parameter's sum with its average over the groups: three equal float64 sums
    averaged come back an ulp apart about one time in eleven, so identical groups printed "DIFFERENT"."""
    proc = launch(*IDENTITY, "trainer.procs_per_node=3", "data.batch_size=16", "trainer.fault_tolerance=replicas",
                  "trainer.replica_groups=3", "trainer.max_steps=8", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for group in (0, 1, 2):
        assert f"replica group {group}: weights identical to the other groups' at step 8 (3 taking part)" in proc.stdout, \
            proc.stdout[-2000:]


def test_a_whole_job_restart_resumes_both_groups_from_the_disk_checkpoint(tmp_path, launch):
    run_dir = tmp_path / "run"
    first = launch(*GROUPS, "trainer.max_steps=12", "checkpoint.every_steps=4", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0 and final_checkpoint(run_dir)["step"] == 12
    again = launch(*GROUPS, "trainer.max_steps=24", f"hydra.run.dir={run_dir}")
    assert again.returncode == 0
    assert "resumed at step 12" in again.stdout and final_checkpoint(run_dir)["step"] == 24
    assert "replica group 1: weights identical to the other groups' at step 24 (2 taking part)" in again.stdout


def test_a_closed_terminal_stops_every_group_with_its_checkpoint(tmp_path):
    """SIGHUP to the launcher (its terminal or ssh session closed): every group's agent stops its ranks, which save,
    as for SIGTERM. Before, the launcher died by SIGHUP's default action and its groups' agents with it, unsaved."""
    import signal

    from conftest import signalled_launch

    run_dir = tmp_path / "run"
    proc, out, err = signalled_launch([*GROUPS, "trainer.max_steps=400"], run_dir, tmp_path, sig=signal.SIGHUP,
                                      env=slowed_steps(50))
    assert proc.returncode == 128 + signal.SIGHUP, err[-3000:]
    saved = final_checkpoint(run_dir)
    assert 3 <= saved["step"] < 400 and f"stopped at step {saved['step']} with a checkpoint" in out
    assert json.loads((run_dir / "status.json").read_text())["status"] == "stopped"


def test_a_replica_groups_gpus_are_taken_from_those_its_node_was_given():
    """launcher/backends/replicas.py overwrote CUDA_VISIBLE_DEVICES with 0..n-1: a Ray actor or a SLURM task given GPUs 4-7
    put its groups on GPUs 0-3, another job's."""
    from launcher.backends.replicas import group_devices

    assert group_devices(None, 1, 2) == "2,3"  # nothing narrowed: the node's own numbering
    assert group_devices("4,5,6,7", 0, 2) == "4,5" and group_devices("4,5,6,7", 1, 2) == "6,7"
    assert group_devices("GPU-a1,GPU-b2", 1, 1) == "GPU-b2"  # UUIDs, as some schedulers set them
    with pytest.raises(SystemExit, match="needs GPUs 2..3 of the 2 this process was given"):
        group_devices("4,5", 1, 2)


def test_a_node_back_after_a_loss_takes_its_own_place_and_so_its_own_groups(monkeypatch):
    """Each node but the first counted itself in at the meeting store, so n2, lost and started again, came back as
    node 2 of 2 and ran replica group 2 of a run of groups 0 and 1 ("Invalid rank 2", the matrix's
    nodes-replicas-lost). A node's place is kept by its host name."""
    from torch.distributed import TCPStore

    from launcher.backends.lighthouse import take_place

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for host, place in (("n2", 1), ("n3", 2), ("n2", 1)):  # n2 again, after a loss
        monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
        assert take_place(store, 3) == place
    monkeypatch.setattr(socket, "gethostname", lambda: "n4")
    with pytest.raises(RuntimeError, match="n4 joins a run of trainer.nodes=3 whose 3 nodes have all been here"):
        take_place(store, 3)
