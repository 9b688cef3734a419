"""launcher=ray against a real Ray cluster of two nodes on this machine (ray-cluster/test-cluster.sh; CI starts it):
a run through the Jobs API equals the same world run locally, its status, a held directory, a graceful cancel, a
lost node, a sweep, and bad input refused before anything is submitted."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import CREDENTIALS, FAULTS_DIR, IDENTITY, REPO, cluster_started, final_checkpoint, logged_steps, run_cli, shared_lock
from conftest import wait_for

pytestmark = pytest.mark.ray_cluster  # CI stops the cluster after the last such test (tests/ci_clusters.py)

ADDRESS = os.environ.get("RAY_ADDRESS", "http://127.0.0.2:8265")
# IDENTITY (tests/conftest.py) on 2 nodes x 1 process, batch 16 each: the world of the `two_process_ddp` reference.
JOB = [*IDENTITY, "launcher=ray", f"launcher.address={ADDRESS}", "trainer.nodes=2", "trainer.procs_per_node=1",
       "data.batch_size=16"]


def slowed(delay_ms: int) -> list[str]:
    """Rank 0's batches come `delay_ms` late (tests/faults): a run long enough to act on while it trains."""
    return [f"+launcher.env.PYTHONPATH={FAULTS_DIR}", "+launcher.env.FAULT=slow_data", "+launcher.env.FAULT_RANK=0",
            f"+launcher.env.FAULT_DELAY_MS={delay_ms}"]


def cluster_up() -> bool:
    try:
        from ray.util.state import list_nodes

        return sum(n.state == "ALIVE" for n in list_nodes(address=ADDRESS, timeout=10)) >= 2
    except Exception:  # noqa: BLE001 - no Ray installed, or nothing answers
        return False


@pytest.fixture(scope="module")
def cluster():
    cluster_started("ray")
    if not cluster_up():
        if os.environ.get("REQUIRE_RAY"):
            pytest.fail(f"REQUIRE_RAY is set but no two-node Ray cluster answers at {ADDRESS} (ray-cluster/test-cluster.sh start)")
        pytest.skip("no Ray test cluster: start one with `ray-cluster/test-cluster.sh start` (CI does)")
    with shared_lock("ray-cluster", exclusive=True):  # its 2 nodes serve one test module at a time
        yield


def launch(tmp_path: Path, *overrides: str, timeout: float = 300):
    return run_cli("launcher", *overrides, cwd=tmp_path, timeout=timeout, env={"RAY_ADDRESS": ADDRESS})


def jobs(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_cli("launcher.jobs", *args, cwd=cwd, timeout=60, env={"RAY_ADDRESS": ADDRESS})


def job_state(job_id: str) -> str:
    from launcher.backends.ray import job_status

    return job_status(job_id, ADDRESS)


def submitted(stdout: str) -> list[str]:
    return [line.split()[3] for line in stdout.splitlines() if line.startswith("submitted Ray job")]


def assert_same_weights(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert a["step"] == b["step"]
    for name, tensor in b["model"].items():
        assert torch.allclose(a["model"][name], tensor, rtol=0, atol=atol), name


SHADOW = "import sys\nprint('the project\\'s own {name} ran', file=sys.stderr)\nsys.exit(3)\n"


def test_a_two_node_run_through_ray_equals_the_same_world_run_locally(cluster, bucket, tmp_path, two_process_ddp):
    """Launched from a project with its own train.py and launcher.py (uploaded with the job, first on Ray's
    PYTHONPATH): our trainer runs, theirs never does (they replaced ours: the job failed three times). Its
    checkpoints go to an S3 store too, reached by the nodes through a credentials file the job names, never with
    keys in the job's environment (Ray's job list shows it to whoever may list jobs)."""
    for name in ("train.py", "launcher.py"):
        (tmp_path / name).write_text(SHADOW.format(name=name))
    credentials = tmp_path / "aws-credentials"  # as on a cluster's shared file system
    credentials.write_text(f"[default]\naws_access_key_id = {CREDENTIALS['AWS_ACCESS_KEY_ID']}\n"
                           f"aws_secret_access_key = {CREDENTIALS['AWS_SECRET_ACCESS_KEY']}\n")
    run_dir, url = tmp_path / "run", f"{bucket}/ray"
    ddp_launch = Path(sys.executable).parent / "ddp-launch"  # python -m launcher here would run their launcher.py
    proc = subprocess.run([str(ddp_launch), *JOB, "launcher.wait=true", "checkpoint.every_steps=8",
                           f"checkpoint.store={url}", f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RAY_ADDRESS": ADDRESS, "AWS_SHARED_CREDENTIALS_FILE": str(credentials)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (job_id,) = submitted(proc.stdout)
    assert f"Ray job {job_id} ended: SUCCEEDED; the run is finished" in proc.stdout
    assert_same_weights(final_checkpoint(run_dir), final_checkpoint(two_process_ddp))
    from launcher.backends.ray import client
    from train.checkpoint.store import Store

    assert [r.step for r in Store(url).committed()] == [8, 16, 24]
    job_env = client(ADDRESS).get_job_info(job_id).runtime_env["env_vars"]
    assert job_env["AWS_SHARED_CREDENTIALS_FILE"] == str(credentials)
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & job_env.keys()
    # The ranks met at node 0's IP, as Ray knows it (a KubeRay pod's FQDN resolves nowhere), not at a looked-up name
    assert json.loads((run_dir / "plan.json").read_text())["master_addr"] in ("127.0.0.2", "127.0.0.3")
    status = jobs("status", str(run_dir), cwd=REPO)  # not beside their launcher.py
    assert "run: free (no lease)" in status.stdout and f"{job_id}  SUCCEEDED" in status.stdout
    logs = jobs("logs", str(run_dir), "--lines", "200", cwd=REPO)  # not beside their launcher.py
    # attempt 0 unless the first rendezvous timed out under load (a fresh-clone run saw it): a restart resumes
    assert re.search(r"attempt \d: every node finished", logs.stdout) and "rendezvous at 127.0.0." in logs.stdout
    assert "the project's own" not in logs.stdout


def test_a_ray_job_holds_its_directory_and_a_cancel_stops_it_with_a_checkpoint(cluster, tmp_path):
    run_dir = tmp_path / "run"
    job = [*JOB, "trainer.max_steps=200", "trainer.epochs=20", *slowed(150), f"hydra.run.dir={run_dir}"]
    proc = launch(tmp_path, *job)
    assert proc.returncode == 0
    (job_id,) = submitted(proc.stdout)
    wait_for(lambda: len(logged_steps(run_dir)) >= 1, 120, "the first logged step")
    status = jobs("status", str(run_dir), cwd=tmp_path)
    assert f"run: held by Ray job {job_id} (RUNNING)" in status.stdout
    again = launch(tmp_path, *job)
    assert again.returncode == 2 and f"belongs to Ray job {job_id} (RUNNING)" in again.stderr
    assert jobs("cancel", str(run_dir), cwd=tmp_path).returncode == 0
    wait_for(lambda: job_state(job_id) == "STOPPED", 120, "the job to stop")
    stopped = final_checkpoint(run_dir)
    assert 0 < stopped["step"] < 200  # the ranks agreed on a step, saved it and stopped
    assert '"status": "stopped"' in (run_dir / "status.json").read_text()
    assert "run: free (no lease)" in jobs("status", str(run_dir), cwd=tmp_path).stdout


# A lost node (the cluster's kill-worker): the conformance matrix's cell ray-ddp-lost (tests/conformance).


def test_replica_groups_one_per_node_a_killed_one_restarts_on_its_node_and_heals(cluster, tmp_path):
    """trainer.fault_tolerance=replicas through Ray: each node's actor runs its group under an agent, the first node
    the Lighthouse. Group 1 is killed at step 10, restarted on its node alone (not the whole job) and heals from
    group 0; the job succeeds with both groups' weights identical. Group 0 holds its quorum of step 40 until group 1
    is about to ask for its first (tests/faults: HEAL_MARKER): under load a restart took longer than group 0's
    remaining steps, and group 1 found the run ended ("nothing left to do") instead of healing."""
    run_dir = tmp_path / "run"
    kill = [f"+launcher.env.PYTHONPATH={FAULTS_DIR}", "+launcher.env.FAULT=kill", "+launcher.env.FAULT_GROUP=1",
            "+launcher.env.FAULT_RANK=0", "+launcher.env.FAULT_STEP=10", "+launcher.env.STEP_DELAY_MS=100",
            f"+launcher.env.HEAL_MARKER={tmp_path / 'group-1-back'}", "+launcher.env.HEAL_BEFORE_STEP=40"]
    proc = launch(tmp_path, *JOB, *kill, "trainer.fault_tolerance=replicas", "launcher.max_restarts=1",
                  "trainer.epochs=4", "trainer.max_steps=64", "launcher.wait=true", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr
    (job_id,) = submitted(proc.stdout)
    assert f"Ray job {job_id} ended: SUCCEEDED" in proc.stdout
    logs = jobs("logs", str(run_dir), "--lines", "400", cwd=tmp_path).stdout
    # What went wrong in a failing run, first (CI shows the tail of a long message): the attempts' and ranks' words
    said = "\n".join(line for line in dict.fromkeys(logs.splitlines())
                     if any(w in line for w in ("attempt", "ended with", "failed", "rror", "restart", "Traceback")))
    assert "restarting the workers (restart 1 of 1)" in logs and "restarting every node" not in logs, said
    # (Ray may show a line of an actor twice: the driver's copy and the log monitor's; distinct lines are counted)
    assert len({line for line in logs.splitlines() if "healed from a live replica group: at step" in line}) == 1
    for group in (0, 1):
        assert f"replica group {group}: weights identical to the other groups' at step 64 (2 taking part)" in logs


def test_a_failure_that_repeats_with_no_progress_is_not_restarted_again(cluster, tmp_path):
    """A rank's own error again in the next attempt, with no step logged past the attempt before's (a user's bug, a
    bad sample): a restart from the same checkpoint would meet it again. Ray's default launcher.max_restarts=3 took
    109 s to fail such a run (issue 61); it now ends after the first restart shows the error repeats, saying why."""
    run_dir = tmp_path / "run"
    broken = [f"+launcher.env.PYTHONPATH={FAULTS_DIR}", "+launcher.env.FAULT=config", "+launcher.env.FAULT_RANK=0"]
    one_node = [o for o in JOB if not o.startswith("trainer.nodes=")] + ["trainer.nodes=1"]  # the driver's decision
    proc = launch(tmp_path, *one_node, *broken, "launcher.max_restarts=3", "launcher.wait=true", f"hydra.run.dir={run_dir}")
    assert proc.returncode != 0
    assert "injected config error on rank 0" in proc.stdout  # the job's output, shown as it came (launcher.wait=true)
    logs = jobs("logs", str(run_dir), "--lines", "400", cwd=tmp_path).stdout
    assert "restarting every node from the last checkpoint (1 of launcher.max_restarts=3)" in logs, logs[-3000:]
    assert "(2 of launcher.max_restarts=3)" not in logs, logs[-3000:]
    assert "attempt 1 failed as attempt 0 did, with the same error after its start: not restarted again" in logs
    said = json.loads((run_dir / "status.json").read_text())
    assert said["status"] == "failed" and "injected config error on rank 0" in said["error"], said
    assert "a restart would repeat it" in said["error"], said


def test_a_sweep_is_submitted_at_once_and_bad_input_is_refused_before_submission(cluster, tmp_path):
    # One node each: the two points run side by side on the cluster's two nodes, not one after the other
    one_node = [o if o != "trainer.nodes=2" else "trainer.nodes=1" for o in JOB]
    sweep = launch(tmp_path, "-m", *one_node, "optim.lr=0.05,0.1", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert sweep.returncode == 0
    job_ids = submitted(sweep.stdout)
    assert len(job_ids) == 2  # both submitted by one command that did not wait for either
    wait_for(lambda: all(job_state(j) == "SUCCEEDED" for j in job_ids), 240, "both points to finish")
    points = sorted(p.parent for p in (tmp_path / "sweep").glob("*/config.yaml"))
    assert len(points) == 2 and all(final_checkpoint(p)["step"] == 24 for p in points)

    def refused(*overrides: str) -> str:
        run_dir = tmp_path / f"refused-{len(list(tmp_path.glob('refused-*')))}"
        proc = launch(tmp_path, *JOB, *overrides, f"hydra.run.dir={run_dir}")
        assert proc.returncode == 2 and "submitted" not in proc.stdout
        assert not (run_dir / "ray").exists()  # nothing was submitted
        return proc.stderr

    assert "trainer.nodes=3 with {'CPU': 1.0} per node" in refused("trainer.nodes=3")
    assert "has 2 node(s) that can hold that" in refused("trainer.nodes=3")
    assert "no Ray cluster answers at http://127.0.0.9:8265" in refused("launcher.address=http://127.0.0.9:8265")
    with open(tmp_path / "big.bin", "wb") as big:  # sparse: 600 MiB to Ray's packaging, nothing on the disk
        big.truncate(600 * 2**20)
    message = refused()
    assert "largest: big.bin 600 MiB" in message and "launcher.excludes=[big.bin]" in message


def test_a_study_runs_two_node_trials_as_ray_jobs_two_at_once(cluster, tmp_path):
    """hydra/sweeper=optuna with launcher=ray and launcher.wait=true: two trials, each a two-node Ray job, at once
    (hydra.sweeper.n_jobs=2 through Hydra's joblib launcher): both jobs train at the same time on the cluster's two
    nodes, every trial is scored and the best one named with its command."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    sweep_dir = tmp_path / "sweep"
    proc = launch(tmp_path, "-m", *[o for o in JOB if not o.startswith("optim.lr=")], "launcher.wait=true",
                  "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.seed=0", "hydra.sweeper.n_jobs=2",
                  "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "optim.lr=tag(log, interval(0.01, 0.5))",
                  f"hydra.sweep.dir={sweep_dir}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = optuna.load_study(study_name="study", storage=JournalStorage(JournalFileBackend(str(sweep_dir / "study.journal"))))
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 2
    points = sorted((p.parent.parent for p in sweep_dir.glob("*/ray/jobs.jsonl")), key=lambda p: p.stat().st_mtime)
    assert len(points) == 2  # each trial a Ray job of its own
    assert not list(sweep_dir.glob("*/work/sweep"))  # no trial uploaded the sweep (the others' run directories)
    assert all(json.loads((p / "plan.json").read_text())["world_size"] == 2 for p in points)

    def ran(point: Path) -> tuple[int, int]:
        """When the Ray job of a trial started and ended (the Jobs API's record, ms)."""
        from launcher.backends.ray import client

        [record] = [json.loads(line) for line in (point / "ray" / "jobs.jsonl").read_text().splitlines()]
        info = client(ADDRESS).get_job_info(record["job_id"])
        return info.start_time, info.end_time

    (start0, end0), (start1, end1) = ran(points[0]), ran(points[1])
    assert start0 < end1 and start1 < end0, "the two jobs ran at the same time"
    assert f"best trial {study.best_trial.number}:" in proc.stdout and (sweep_dir / "best_trial.yaml").exists()


def test_an_unchanged_torchrun_script_runs_as_a_two_node_ray_job(cluster, tmp_path):
    """program=script through the Jobs API: the user's own loop, one rank per node, its own arguments, from the
    uploaded project (beside its own train.py and models.py, which must not run), and status.json from its end. What
    the script writes by a relative path lands in the run directory's copy of the project (RUN_DIR/work): before, it
    stayed in Ray's copy, cached by content, where the user never saw it and the next run of the same files found it."""
    shutil.copy(REPO / "tests" / "foreign" / "own_loop" / "my_loop.py", tmp_path / "my_loop.py")
    for name in ("train.py", "models.py"):
        (tmp_path / name).write_text(SHADOW.format(name=name))
    run_dir = tmp_path / "runs" / "mine"
    proc = launch(tmp_path, "launcher=ray", f"launcher.address={ADDRESS}", "trainer.nodes=2", "trainer.procs_per_node=1",
                  "program=script", "program.script=my_loop.py", "program.args=[--epochs,2,--out,mine.pt]",
                  f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [job_id] = submitted(proc.stdout)
    wait_for(lambda: job_state(job_id) in ("SUCCEEDED", "FAILED", "STOPPED"), 240, "the job to end")
    logs = jobs("logs", str(run_dir), cwd=tmp_path)
    assert job_state(job_id) == "SUCCEEDED", logs.stdout[-3000:]
    assert "epoch 1 loss" in logs.stdout and "world 2 local_rank 0" in logs.stdout
    assert "own train.py ran" not in logs.stdout + logs.stderr
    assert f"the ranks run in {run_dir / 'work'}" in proc.stdout
    saved = run_dir / "work" / "mine.pt"
    assert set(torch.load(saved, weights_only=True)) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert (run_dir / "work" / "my_loop.py").read_text() == (tmp_path / "my_loop.py").read_text()
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"


def test_a_script_using_torchft_runs_as_replica_groups_one_per_node_and_a_killed_group_heals(cluster, tmp_path):
    """program=script with trainer.fault_tolerance=replicas through the Jobs API: each node's agent runs its replica
    group (as the trainer's groups run). Group 1's rank dies at step 5: its group alone restarts and heals."""
    shutil.copy(REPO / "tests" / "foreign" / "own_loop" / "ft_loop.py", tmp_path / "ft_loop.py")
    run_dir = tmp_path / "runs" / "ft"
    proc = launch(tmp_path, "launcher=ray", f"launcher.address={ADDRESS}", "trainer.nodes=2", "trainer.procs_per_node=1",
                  "program=script", "program.script=ft_loop.py", "program.args=[--die-at,5]",
                  "trainer.fault_tolerance=replicas", "trainer.replica_groups=2", "launcher.max_restarts=1",
                  f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    [job_id] = submitted(proc.stdout)
    wait_for(lambda: job_state(job_id) in ("SUCCEEDED", "FAILED", "STOPPED"), 240, "the job to end")
    logs = jobs("logs", str(run_dir), "--lines", "2000", cwd=tmp_path).stdout  # torchft's lines while a group heals
    assert job_state(job_id) == "SUCCEEDED", logs[-3000:]
    assert "replica group 1 rejoins the others" in logs
    # (Ray's driver log may hold a node's line twice)
    done = sorted(set(re.findall(r"group (\d) done at step (\d+): weights (-?[\d.]+)", logs)))
    assert [(group, step) for group, step, _ in done] == [("0", "20"), ("1", "20")], logs[-3000:]
    assert done[0][2] == done[1][2]  # the same weights
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"


def test_the_logs_of_a_ray_run_whose_cluster_is_down_say_so_and_where_else_to_look(tmp_path):
    """No cluster needed: a run directory that recorded a job at an address where nothing answers (a cluster torn
    down after the run). Before: Ray's ConnectionError traceback."""
    from launcher.backends.ray import record_job

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record_job(run_dir, "raysubmit_gone", "http://127.0.0.9:8265")
    proc = run_cli("launcher.jobs", "logs", str(run_dir), cwd=tmp_path, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "error: the log of Ray job raysubmit_gone is kept by the cluster at http://127.0.0.9:8265, which does not " \
           "answer" in proc.stderr
    assert f"{run_dir}/metrics.jsonl" in proc.stderr
