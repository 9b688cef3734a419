"""`python -m launcher.doctor`: what would break a distributed run on this machine, each finding with its fix."""

from __future__ import annotations

import errno
import fcntl
import shutil
from unittest import mock

from conftest import REPO, run_cli, typed
from launcher.tools.doctor import check_run_dir, check_slurm_layout
from launcher.backends.network import check_network, interfaces


def test_a_host_name_on_loopback_breaks_multi_node_runs_and_the_fix_names_an_interface(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    cfg = typed("trainer.nodes=2")
    [finding] = [f for f in check_network(cfg, host="localhost") if f.problem]
    assert "resolves to 127.0.0.1, a loopback address" in finding.text
    external = [name for name, address in interfaces().items() if address and not address.startswith("127.")]
    assert (f"GLOO_SOCKET_IFNAME={external[0]} NCCL_SOCKET_IFNAME={external[0]}" if external
            else "GLOO_SOCKET_IFNAME=<the interface") in finding.text
    assert check_network(typed("trainer.nodes=1"), host="localhost") == []  # one node: nothing leaves the machine

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # an interface that exists picks the address: no problem
    assert not [f for f in check_network(cfg, host="localhost") if f.problem]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib7")
    problems = [f.text for f in check_network(cfg, host="localhost") if f.problem]
    assert problems[0].startswith("GLOO_SOCKET_IFNAME=ib7: no interface ib7 here")


def test_a_run_directory_without_flock_or_space_is_reported(tmp_path):
    def no_locks(*args):
        raise OSError(errno.ENOSYS, "Function not implemented")

    with mock.patch.object(fcntl, "flock", no_locks):
        [finding] = [f for f in check_run_dir(tmp_path, 0, 3) if f.problem]
    assert "its file system has no flock (Function not implemented; Lustre mounted without -o flock)" in finding.text
    assert not [f for f in check_run_dir(tmp_path, 1 << 20, 3) if f.problem]  # locks, and room for 5 x 1 MB
    each = shutil.disk_usage(tmp_path).free // 4
    [full] = [f for f in check_run_dir(tmp_path, each, 3) if f.problem]
    assert "(3 kept + best + one being written" in full.text and "lower checkpoint.keep_last" in full.text


def test_a_slurm_allocation_that_does_not_fit_the_run_is_reported():
    cfg = typed("trainer.gpus=4", "trainer.nodes=2")
    [wrong] = check_slurm_layout(cfg, {"SLURM_JOB_ID": "7", "SLURM_NTASKS_PER_NODE": "2"})
    assert wrong.problem and "runs 2 task(s) per node, this run 4 process(es) per node" in wrong.text
    [bound] = check_slurm_layout(cfg, {"SLURM_JOB_ID": "7", "SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_PER_TASK": "1"})
    assert bound.problem and "ask for --gpus-per-node=4" in bound.text
    [fine] = check_slurm_layout(cfg, {"SLURM_JOB_ID": "7", "SLURM_NTASKS_PER_NODE": "4"})
    assert not fine.problem
    assert check_slurm_layout(cfg, {}) == []  # outside an allocation


def test_the_doctor_command_lists_its_findings_and_fails_on_a_problem(tmp_path):
    proc = run_cli("launcher.doctor", "trainer.gpus=2", f"hydra.run.dir={tmp_path / 'run'}", cwd=REPO)
    assert proc.returncode == 1  # this machine has no GPU
    assert "doctor: 1 problem(s)" in proc.stdout and "trainer.gpus=2, but 0 GPU(s) visible" in proc.stdout
    assert f"hydra.run.dir={tmp_path / 'run'}: " in proc.stdout and "GB free for" in proc.stdout
    fine = run_cli("launcher.doctor", f"hydra.run.dir={tmp_path / 'run'}", cwd=REPO)
    assert fine.returncode == 0 and "doctor: 0 problem(s)" in fine.stdout


def test_the_doctor_reads_a_projects_own_config_dir_as_the_launcher_does(tmp_path):
    """`--config-dir conf +experiment=...` was an override-parse traceback: the doctor takes the launcher's command."""
    hf = REPO / "tests" / "foreign" / "huggingface"
    proc = run_cli("launcher.doctor", "--config-dir", "conf", "+experiment=hf_bert_classifier", "trainer.gpus=1",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=hf)
    assert "Traceback" not in proc.stderr and "doctor: 1 problem(s)" in proc.stdout  # the experiment composed, then judged
    assert "trainer.gpus=1, but 0 GPU(s) visible" in proc.stdout


def test_a_rendezvous_host_that_does_not_resolve_is_refused_before_start(tmp_path):
    """Before: 155 s of c10d's retries (IPv6 messages, C++ frames) and two Ctrl-C that did nothing for 82 s."""

    proc = run_cli("launcher", "trainer.nodes=2", "launcher.rdzv_endpoint=nosuchhost.invalid:29400",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "launcher.rdzv_endpoint=nosuchhost.invalid:29400: 'nosuchhost.invalid' does not resolve on this machine" \
        in proc.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written
