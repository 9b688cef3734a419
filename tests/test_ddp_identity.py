"""The data-parallel identity the product rests on, and exact resume, through the real CLI with real processes.

- 2 processes with batch B (or B/2 with 2 accumulation steps) reach the weights of 1 process with batch 2B.
- Training 2N steps straight equals training N, stopping, and resuming for N more: bitwise, on CPU.
"""

from __future__ import annotations

import pytest
import torch

from conftest import IDENTITY, RESUME, final_checkpoint, read_metrics
from train.models.vision import mlp

@pytest.mark.parametrize("batch,accumulate", [(16, 1), (8, 2)])
def test_two_processes_match_one_process_with_the_global_batch(launch, tmp_path, one_process_batch_32, two_process_ddp,
                                                               batch, accumulate):
    if accumulate == 1:  # IDENTITY on 2 x 16: the shared reference run that other files compare with (conftest.py)
        run_dir = two_process_ddp
    else:
        run_dir = tmp_path / "run"
        proc = launch(*IDENTITY, "trainer.procs_per_node=2", f"data.batch_size={batch}", f"trainer.accumulate={accumulate}",
                      f"hydra.run.dir={run_dir}")
        assert proc.returncode == 0
    ddp = final_checkpoint(run_dir)
    single = one_process_batch_32
    assert ddp["step"] == single["step"] == 24
    assert ddp["global_batch"] == single["global_batch"] == 32
    for name, expected in single["model"].items():
        torch.testing.assert_close(ddp["model"][name], expected, rtol=1e-5, atol=1e-6, msg=f"{name} differs")

    # Not vacuous: training moved the weights far beyond the tolerance from where they started.
    torch.manual_seed(0)
    initial = mlp(channels=1, image_size=16, num_classes=10, hidden=[64, 32]).state_dict()
    assert max((initial[k] - ddp["model"][k]).abs().max().item() for k in initial) > 1e-2


def test_resume_is_bitwise_exact(launch, tmp_path, straight_run):
    # 11 steps per epoch; stopping at 16 leaves the first half in the middle of epoch 2.
    first = launch(*RESUME, "trainer.max_steps=16", f"hydra.run.dir={tmp_path / 'split'}")
    assert first.returncode == 0
    half = final_checkpoint(tmp_path / "split")
    assert (half["step"], half["epoch"], half["step_in_epoch"]) == (16, 1, 5)
    second = launch(*RESUME, "trainer.max_steps=32", f"hydra.run.dir={tmp_path / 'split'}")
    assert second.returncode == 0
    assert "resumed at step 16" in second.stdout

    a, b = final_checkpoint(straight_run), final_checkpoint(tmp_path / "split")
    assert a["step"] == b["step"] == 32
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"{name} differs after resume"
    for pid, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][pid][key]), f"optimizer state {pid}.{key} differs"
    for rank in range(2):
        assert torch.equal(a["rng"][rank]["torch"], b["rng"][rank]["torch"])

    # The logs continue where they stopped: no step repeated or lost, and the same numbers as straight through.
    straight_log, split_log = read_metrics(straight_run), read_metrics(tmp_path / "split")
    train_steps = [r["step"] for r in split_log if r["kind"] == "train"]
    assert train_steps == sorted(set(train_steps)) == list(range(3, 33, 3))
    straight_evals = [(r["step"], r["loss"]) for r in straight_log if r["kind"] == "eval"]
    split_evals = [(r["step"], r["loss"]) for r in split_log if r["kind"] == "eval" and r["step"] != 16]
    assert split_evals == straight_evals  # epoch-end evaluations at 11, 22 and the final one at 32
