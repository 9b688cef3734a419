"""Which GPU and how many threads a rank takes, from what the process may use (unit tests of train.dist)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

import train.dist as dist_module
from train.dist import DistEnv, default_threads, local_device_index

NODE = DistEnv(rank=5, local_rank=1, world_size=8, local_world_size=4)


def test_every_process_sees_every_gpu_of_its_node():
    assert local_device_index(NODE, visible=4) == 1
    assert local_device_index(NODE, visible=8) == 1


def test_a_task_given_only_its_own_gpu_takes_the_first_visible_one():
    """SLURM --gpus-per-task / --gpu-bind: cuda:LOCAL_RANK would not exist (or be another task's GPU)."""
    assert local_device_index(NODE, visible=1) == 0


def test_an_ambiguous_binding_is_refused_with_the_fix():
    with pytest.raises(RuntimeError, match="sees 2 GPUs for 4 processes.*--gpus-per-task"):
        local_device_index(NODE, visible=2)


@pytest.fixture
def machine(monkeypatch):
    """A 16-core machine; returns a function setting this process's affinity and environment."""
    for key in ("SLURM_STEP_ID", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(dist_module.os, "cpu_count", lambda: 16)

    def set_up(affinity: int, **env: str):
        monkeypatch.setattr(dist_module, "available_cores", lambda: affinity)
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return set_up


def test_local_processes_share_the_machine(machine):
    machine(affinity=16)
    assert default_threads(NODE) == 4


def test_under_slurm_the_cpus_per_task_are_the_tasks_own(machine):
    machine(affinity=16, SLURM_STEP_ID="0", SLURM_CPUS_PER_TASK="4")  # no binding: the affinity is the node
    assert default_threads(NODE) == 4
    machine(affinity=4, SLURM_STEP_ID="0", SLURM_CPUS_PER_TASK="4")  # task binding: already per task, not / 4
    assert default_threads(NODE) == 4


def test_under_slurm_a_bound_task_without_cpus_per_task_uses_its_affinity(machine):
    machine(affinity=3, SLURM_STEP_ID="0")
    assert default_threads(NODE) == 3


PATIENCE = """
from datetime import timedelta
import torch.distributed as dist
from train.dist import CONTROL_TIMEOUT, control_group, own_group, patient, timeout_of

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=5))
training = dist.group.WORLD
assert control_group("gloo") is training  # no second gloo group (and no second event-loop thread) on CPU
with patient(training):
    assert timeout_of(training) == CONTROL_TIMEOUT
    with patient(None):  # nested, and None for the training group
        assert timeout_of(training) == CONTROL_TIMEOUT
    assert timeout_of(training) == CONTROL_TIMEOUT
assert timeout_of(training) == timedelta(seconds=5)
try:
    with patient(training):
        raise OSError("a failed read")
except OSError:
    pass
assert timeout_of(training) == timedelta(seconds=5)
background = own_group()
assert timeout_of(background) == CONTROL_TIMEOUT
with patient(background):
    assert timeout_of(training) == timedelta(seconds=5)
dist.destroy_process_group()
print("ok")
"""


def test_waits_on_io_are_patient_only_while_they_last():
    """train.dist.patient: the training group's collective limit is lifted inside (a wait on another rank's I/O)
    and is back afterwards, also when the wait fails."""
    proc = subprocess.run([sys.executable, "-c", PATIENCE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_fp32_on_gpus_uses_tf32_unless_turned_off_and_never_on_the_cpu():
    import torch

    from train.step import set_matmul_precision, uses_tf32

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert uses_tf32("32", True, gpu) and not uses_tf32("32", False, gpu)
    assert not uses_tf32("bf16", True, gpu) and not uses_tf32("32", True, cpu)
    try:
        set_matmul_precision("32", True, gpu)  # what a GPU rank sets (only flags: no GPU needed to set them)
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
        set_matmul_precision("32", False, gpu)
        assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
    finally:
        set_matmul_precision("32", True, cpu)
    assert torch.get_float32_matmul_precision() == "highest"
