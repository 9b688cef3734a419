"""An elastic world (trainer.min_nodes): every optimizer step reads the same samples at any world size, so the global
batch, the lr schedule and the data order are those of the run at trainer.nodes (train/data/order.py)."""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DistributedSampler

from conftest import FAST, REPO, checkpoint_at, final_checkpoint, run_cli
from test_counting import MASKED

from train.checkpoint import committed
from train.checkpoint.file import sidecar
from train.config import TrainConfig
from train.data.order import GlobalOrder
from train.plan import make_plan


@pytest.mark.parametrize("size,replicas,batch,accumulate", [(40, 2, 5, 1), (1797, 4, 8, 1), (1797, 4, 8, 3),
                                                              (37, 3, 4, 2), (10, 8, 1, 1), (5, 8, 1, 1)])
def test_at_its_own_world_the_order_is_distributed_samplers(size, replicas, batch, accumulate):
    for rank, epoch in itertools.product(range(replicas), (0, 3)):
        sampler = DistributedSampler(range(size), num_replicas=replicas, rank=rank, shuffle=True, seed=7)
        sampler.set_epoch(epoch)
        expected = list(sampler)
        order = GlobalOrder(size, 7, replicas, batch, accumulate, rank, replicas)
        got = list(order.micro_batches(epoch))
        assert order.accumulate == accumulate
        assert len(got) == len(expected) // batch // accumulate * accumulate == order.batches_per_epoch
        assert got == [expected[b * batch:(b + 1) * batch] for b in range(len(got))]
        assert list(order.micro_batches(epoch, start=2)) == got[2:]


@pytest.mark.parametrize("worlds", [(4, 3, 4), (4, 1, 2, 4), (4, 5, 7)])
def test_a_world_that_changes_at_step_boundaries_reads_each_steps_samples_once(worlds):
    # 4 replicas of 8 x 3 accumulation: a global batch of 96. The world changes every 4 steps.
    size, reference, batch, accumulate = 1000, 4, 8, 3
    fixed = [GlobalOrder(size, 0, reference, batch, accumulate, r, reference) for r in range(reference)]
    steps = fixed[0].steps
    by_step_fixed = [sorted(sum((list(o.micro_batches(1))[s * accumulate:(s + 1) * accumulate] for o in fixed), []),
                            key=lambda b: b) for s in range(steps)]
    seen: list[int] = []
    for step in range(steps):
        world = worlds[min(step // 4, len(worlds) - 1)]
        orders = [GlobalOrder(size, 0, reference, batch, accumulate, r, world) for r in range(world)]
        assert orders[0].steps == steps and orders[0].global_batch == reference * batch * accumulate
        here = []
        for order in orders:
            micro = list(order.micro_batches(1, start=step * order.accumulate))[:order.accumulate]
            assert all(0 < len(m) <= batch for m in micro)  # no rank holds more than the batch it was sized for
            here += sum(micro, [])
        assert sorted(here) == sorted(sum(by_step_fixed[step], [])), f"step {step} at world {world}"
        seen += here
    assert len(seen) == len(set(seen)) == steps * reference * batch * accumulate  # none twice, none skipped


def config(**trainer) -> TrainConfig:
    cfg = TrainConfig()
    cfg.data.batch_size = 8
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    return cfg


def test_an_elastic_plan_keeps_the_global_batch_and_schedule_of_its_full_world():
    full = make_plan(config(nodes=4, accumulate=2), 4, 1797)
    for world, accumulate, uneven in ((4, 2, False), (3, 3, True), (2, 4, False), (1, 8, False), (8, 1, False)):
        plan = make_plan(config(nodes=4, min_nodes=1, accumulate=2), world, 1797)
        assert (plan.global_batch, plan.steps_per_epoch, plan.total_steps, plan.lr) == \
            (full.global_batch, full.steps_per_epoch, full.total_steps, full.lr) == (64, 28, 280, full.lr)
        assert (plan.world_size, plan.accumulate, plan.uneven_shares) == (world, accumulate, uneven)
    fixed = make_plan(config(nodes=4, accumulate=2), 3, 1797)  # not elastic: the world's own batch, as before
    assert (fixed.global_batch, fixed.accumulate) == (48, 2)


# ------------------------------------------------------------------ a world that changes, real processes, gloo

HF = REPO / "tests" / "foreign" / "huggingface"
FAMILIES = {  # (the run's words, its working directory): samples, masked tokens of our GPT and of a Hugging Face model
    "mlp": (["data=synthetic", "data.num_samples=512", "model=mlp", "model.hidden=[64,32]", "optim.lr=0.05"], REPO),
    "gpt-masked": ([*MASKED["language_modeling"], "optim.lr=0.01"], HF),
    # SGD: the key part of an attention's c_attn.bias has no gradient in exact arithmetic (softmax ignores a shift of
    # the scores), only rounding noise, which AdamW scales up to whole lr-sized steps: 1e-4 apart after 6 steps
    # whatever the world (so do 2 x 8 and 1 x 16). SGD keeps the comparison to summation order.
    "hf-gpt2-masked": ([*MASKED["model_loss"], "optim=sgd", "optim.lr=0.1"], HF),
}


def elastic_copy(fixed: Path, run_dir: Path, step: int) -> Path:
    """The fixed run's config as an elastic run's snapshot (trainer.nodes=3 nodes of one process, from 1 node on),
    with the fixed run's checkpoint of `step` as its newest: its first leg at the full world is the fixed run's own."""
    cfg = OmegaConf.load(fixed / "config.yaml")
    cfg.trainer.nodes, cfg.trainer.procs_per_node, cfg.trainer.min_nodes = 3, 1, 1
    run_dir.mkdir()
    OmegaConf.save(cfg, run_dir / "config.yaml")
    (run_dir / "checkpoints").mkdir()
    [start] = [c.path for c in committed(fixed / "checkpoints") if c.step == step]
    for path in (start, sidecar(start)):
        shutil.copy2(path, run_dir / "checkpoints" / path.name)
    return run_dir / "config.yaml"


def torchrun(snapshot: Path, processes: int, stop: int, cwd: Path) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node=N -m train SNAPSHOT` up to step `stop`: the world the rendezvous gave this round."""
    cfg = OmegaConf.load(snapshot)
    cfg.trainer.max_steps = stop
    OmegaConf.save(cfg, snapshot)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
                           "-m", "train", str(snapshot)], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_world_going_3_2_3_ends_with_the_weights_of_the_fixed_3_process_run(family, corpus, tmp_path):
    words, cwd = FAMILIES[family]
    common = [*words, *FAST, f"data.root={corpus}", "data.batch_size=5", "trainer.eval_every=0", "trainer.epochs=1",
              "trainer.max_steps=6", "checkpoint.every_steps=2", "optim.schedule.warmup_steps=0", "optim.schedule.warmup_epochs=0"]
    fixed = run_cli("launcher", *common, "trainer.procs_per_node=3", f"hydra.run.dir={tmp_path / 'fixed'}", cwd=cwd)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    snapshot = elastic_copy(tmp_path / "fixed", tmp_path / "elastic", step=2)  # 3 processes to step 2: the fixed run's
    for processes, stop in ((2, 4), (3, 6)):  # 2 does not divide the global batch of 15: 8 and 7
        leg = torchrun(snapshot, processes, stop, cwd)
        assert leg.returncode == 0, leg.stderr[-3000:]
        if processes == 2:
            assert "elastic: trainer.nodes' 3 processes' global batch on 2: 8 or 7 samples per replica in 2 " \
                   "micro-batches of up to 5" in leg.stdout + leg.stderr
            assert "the world changed from 3 to 2 processes since the checkpoint of step 2" in leg.stderr
    early = checkpoint_at(tmp_path / "fixed", 2)["model"]
    a, b = final_checkpoint(tmp_path / "fixed"), final_checkpoint(tmp_path / "elastic")
    assert a["step"] == b["step"] == 6 and a["global_batch"] == b["global_batch"] == 15
    moved = 0.0
    for name, expected in a["model"].items():
        if expected.is_floating_point():
            scale = expected.abs().max().item()
            torch.testing.assert_close(b["model"][name], expected, rtol=1e-6, atol=1e-6 * scale,
                                       msg=f"{family}: {name} differs from the fixed run's")
            moved = max(moved, (expected - early[name]).abs().max().item() / scale)
    assert moved > 1e-3, f"{family}: 4 steps moved the weights by {moved:g} only: the comparison would be vacuous"
