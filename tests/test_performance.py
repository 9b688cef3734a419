"""Performance features that change what is logged or how gradients travel, checked with real processes:
per-rank timing that names a straggling rank, DDP options that keep the data-parallel identity, and gradient
compression that is really applied. Throughput itself is measured by benchmarks/, never asserted here.
"""

from __future__ import annotations

import re

import pytest
import torch

from conftest import IDENTITY, fault_env, final_checkpoint, read_metrics

STALL_MS = 60


@pytest.mark.alone
def test_a_data_stall_on_one_rank_is_logged_by_rank(launch, tmp_path):
    env = {**fault_env("slow_data", rank=1), "FAULT_DELAY_MS": str(STALL_MS)}
    proc = launch(*IDENTITY, "trainer.procs_per_node=2", "data.batch_size=16", "trainer.max_steps=12",
                  "trainer.log_every=4", f"hydra.run.dir={tmp_path / 'run'}", env=env)
    assert proc.returncode == 0
    train = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [4, 8, 12]
    for r in train:
        assert r["data_time_slowest_rank"] == 1
        assert r["data_time_max_s"] >= STALL_MS / 1000  # rank 1 waited at least the injected delay per batch
        assert r["data_time_min_s"] < STALL_MS / 1000 / 2  # rank 0 did not
        assert r["data_time_min_s"] <= r["data_time_s"] <= r["data_time_max_s"]
        # Gradient synchronisation makes the healthy rank wait for the stalled one: every rank's step slows.
        assert r["step_time_min_s"] >= STALL_MS / 1000 * 0.9
    assert re.search(r"slowest data: rank 1 [\d.]+ ms \(median [\d.]+ ms\)", proc.stdout)  # a figure beside its median


@pytest.mark.parametrize("options", [["trainer.bucket_cap_mb=1", "trainer.static_graph=true"], ["trainer.compile=true"]])
def test_ddp_options_that_must_not_change_the_weights(launch, tmp_path, two_process_ddp, options):
    proc = launch(*IDENTITY, "trainer.procs_per_node=2", "data.batch_size=16", *options, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0
    weights = final_checkpoint(tmp_path / "run")["model"]
    reference = final_checkpoint(two_process_ddp)["model"]
    assert weights.keys() == reference.keys()  # the checkpoint holds the plain model, no compile/DDP prefixes
    for name, expected in reference.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-5, atol=1e-6, msg=f"{name} differs")


def test_bf16_gradient_compression_is_applied_and_stays_close(launch, tmp_path, two_process_ddp):
    proc = launch(*IDENTITY, "trainer.procs_per_node=2", "data.batch_size=16", "trainer.grad_compression=bf16",
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0
    weights = final_checkpoint(tmp_path / "run")["model"]
    reference = final_checkpoint(two_process_ddp)["model"]
    diff = max((weights[k] - v).abs().max().item() for k, v in reference.items())
    # bf16 keeps 8 bits of mantissa: the all-reduced gradients are rounded (so the weights differ), but only a little.
    assert 1e-6 < diff < 1e-2


def test_channels_last_is_chosen_for_conv_models_on_gpus_only():
    from train.config import TrainerConfig
    from train.models import vision as models
    from train.parallel.strategy import memory_format

    cnn = models.cnn(channels=1, image_size=16, num_classes=10, width=4)
    mlp = models.mlp(channels=1, image_size=16, num_classes=10, hidden=[8])
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")  # device objects: no GPU needed to decide
    auto = TrainerConfig()
    assert memory_format(auto, cnn, cuda) == torch.channels_last
    assert memory_format(auto, mlp, cuda) == torch.contiguous_format
    assert memory_format(auto, cnn, cpu) == torch.contiguous_format
    assert memory_format(TrainerConfig(memory_format="channels_last"), cnn, cpu) == torch.channels_last


@pytest.mark.alone
def test_a_slow_forward_on_one_rank_is_named_although_every_step_slows(launch, tmp_path):
    """What a slow GPU looks like: its forward takes longer, and the all-reduce makes every rank's step wait for it.
    Step times cannot tell the ranks apart; the forward time (CUDA events on GPUs, host time here) does."""
    env = {**fault_env("slow_forward", rank=1), "FAULT_DELAY_MS": str(STALL_MS)}
    proc = launch(*IDENTITY, "trainer.procs_per_node=2", "data.batch_size=16", "trainer.max_steps=12",
                  "trainer.log_every=4", f"hydra.run.dir={tmp_path / 'run'}", env=env)
    assert proc.returncode == 0
    for r in [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]:
        assert r["forward_time_slowest_rank"] == 1
        assert r["forward_time_max_s"] >= STALL_MS / 1000 > 2 * r["forward_time_min_s"]
        assert r["step_time_min_s"] >= STALL_MS / 1000 * 0.9  # the healthy rank's steps are as slow
    assert "slowest forward: rank 1" in proc.stdout
