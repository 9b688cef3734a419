"""The plan derived from config and world size: global batch, linear lr scaling, and an lr schedule defined in
epochs, so changing the world size does not change the schedule over the data."""

from __future__ import annotations

import math

import pytest
import torch

from train.config import TrainConfig
from train.optim import build_optimizer, build_scheduler, parameter_groups
from train.plan import make_plan

WARMUP = {"_target_": "train.optim.WarmupSchedule", "_partial_": True}  # conf/optim/schedule/warmup.yaml's target


def config(**trainer) -> TrainConfig:
    cfg = TrainConfig()
    cfg.optim.optimizer = {"_target_": "torch.optim.SGD", "_partial_": True, "momentum": 0.9}
    cfg.optim.schedule = dict(WARMUP)
    cfg.data.batch_size = 32
    cfg.trainer.epochs = 10
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    return cfg


def test_global_batch_and_linear_lr_scaling():
    cfg = config(accumulate=2)
    cfg.optim.lr, cfg.optim.scale_lr, cfg.optim.reference_batch_size = 0.1, True, 256
    plan = make_plan(cfg, world_size=4, train_size=10_000)
    assert plan.global_batch == 32 * 4 * 2
    assert plan.lr == pytest.approx(0.1 * 256 / 256)
    assert make_plan(cfg, world_size=8, train_size=10_000).lr == pytest.approx(0.2)
    cfg.optim.scale_lr = False
    assert make_plan(cfg, world_size=8, train_size=10_000).lr == 0.1


def test_warmup_and_schedule_are_in_epochs_whatever_the_world_size():
    cfg = config()
    cfg.optim.schedule["warmup_epochs"] = 2
    small, large = make_plan(cfg, 1, 6400), make_plan(cfg, 4, 6400)
    assert (small.steps_per_epoch, large.steps_per_epoch) == (200, 50)
    warmups = [build_scheduler(torch.optim.SGD([torch.zeros(1)]), cfg.optim.schedule, p).lr_lambdas[0].warmup for p in (small, large)]
    assert warmups == [400, 100]
    assert (small.total_steps, large.total_steps) == (2000, 500)

    def lr_at_epoch(plan, epoch):
        optimizer = build_optimizer(cfg.optim, torch.nn.Linear(2, 2), plan.lr)
        scheduler = build_scheduler(optimizer, cfg.optim.schedule, plan)
        for _ in range(round(epoch * plan.steps_per_epoch)):
            optimizer.step()
            scheduler.step()
        return scheduler.get_last_lr()[0]

    for epoch in (1, 2, 5, 9.5):
        assert lr_at_epoch(small, epoch) == pytest.approx(lr_at_epoch(large, epoch), rel=0.02)
    assert lr_at_epoch(small, 1) == pytest.approx(cfg.optim.lr * 201 / 400)  # halfway through warmup
    assert lr_at_epoch(large, 9.99) < 0.01 * cfg.optim.lr  # cosine ends near zero


def test_step_schedule_drops_at_milestones():
    cfg = config()
    cfg.optim.schedule.update(name="step", milestones=[3.0, 6.0], gamma=0.1)
    plan = make_plan(cfg, 2, 640)
    factor = build_scheduler(build_optimizer(cfg.optim, torch.nn.Linear(2, 2), 1.0), cfg.optim.schedule, plan).lr_lambdas[0]
    spe = plan.steps_per_epoch
    assert [factor(0), factor(3 * spe - 1), factor(3 * spe), factor(6 * spe)] == pytest.approx([1, 1, 0.1, 0.01])


def test_max_steps_stops_early_without_changing_the_schedule():
    plan = make_plan(config(max_steps=7), 1, 6400)
    assert (plan.stop_step, plan.total_steps) == (7, 2000)


def test_a_batch_larger_than_a_rank_share_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="lower data.batch_size or trainer.accumulate"):
        make_plan(config(), world_size=8, train_size=100)


def test_no_weight_decay_on_biases_and_norms_when_asked():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    cfg = config()
    cfg.optim.weight_decay = 0.1
    assert [g["weight_decay"] for g in parameter_groups(cfg.optim, model)] == [0.1]  # the default: everything decays
    cfg.optim.decay_norms_and_biases = False
    optimizer = build_optimizer(cfg.optim, model, lr=0.5)
    decayed, exempt = optimizer.param_groups
    assert (decayed["weight_decay"], exempt["weight_decay"]) == (0.1, 0.0) and decayed["lr"] == exempt["lr"] == 0.5
    assert [p.dim() for p in decayed["params"]] == [2, 2] and [p.dim() for p in exempt["params"]] == [1, 1, 1, 1]
    assert isinstance(optimizer, torch.optim.SGD) and decayed["momentum"] == 0.9  # the target's own arguments


def test_a_run_that_ends_on_the_warmups_last_step_is_not_warned():
    from types import SimpleNamespace

    from train.optim import WarmupSchedule, schedule_warning

    factor = WarmupSchedule(steps_per_epoch=4, total_steps=4, warmup_steps=4, warmup_epochs=0)
    assert schedule_warning(factor, SimpleNamespace(stop_step=4, total_steps=4)) == ""  # its last lr is the peak
    assert "inside the lr warmup of 4 steps" in schedule_warning(factor, SimpleNamespace(stop_step=3, total_steps=4))


def test_a_short_run_inside_an_epoch_long_warmup_is_warned_and_warmup_steps_is_honoured(launch, tmp_path):
    """The default warmup of one epoch (64 steps here) and a 10-step run: all warmup, and said so; in steps, the
    warmup is what it says whatever the epoch's length."""
    from conftest import FAST, read_metrics

    run = [*FAST, "data=synthetic", "model=mlp", "model.hidden=[32]", "trainer.procs_per_node=1", "trainer.log_every=2",
           "trainer.max_steps=10"]
    inherited = launch(*run, f"hydra.run.dir={tmp_path / 'inherited'}")
    assert inherited.returncode == 0, inherited.stderr
    assert "warning: the run stops at step 10, inside the lr warmup of 64 steps" in inherited.stdout
    in_steps = launch(*run, "optim.schedule.warmup_epochs=0", "optim.schedule.warmup_steps=4",
                      "optim.schedule.decay_steps=10", f"hydra.run.dir={tmp_path / 'in_steps'}")
    assert in_steps.returncode == 0, in_steps.stderr
    assert "inside the lr warmup" not in in_steps.stdout and "its lr decay spans" not in in_steps.stdout
    lr = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "in_steps") if r["kind"] == "train"}
    assert lr[2] == pytest.approx(0.1 * 3 / 4)  # (step + 1) / warmup_steps of the peak 0.1, the lr for the 3rd step
    assert lr[4] == pytest.approx(0.1)  # the peak, after 4 steps
    assert lr[6] == pytest.approx(0.1 * (0.5 * (1 + math.cos(math.pi * 2 / 6))))  # cosine over the 6 steps after
    assert lr[10] == pytest.approx(0.0, abs=1e-12)  # the decay ends with the run


def test_warmup_in_epochs_and_in_steps_at_once_is_refused():
    cfg = config()
    cfg.optim.schedule.update(warmup_epochs=1.0, warmup_steps=100)
    with pytest.raises(ValueError, match="give the warmup in one of them"):
        build_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), cfg.optim.schedule,
                        make_plan(cfg, world_size=1, train_size=1000))


@pytest.mark.parametrize("pp,said", [(2, "pipeline: 2 stages of consecutive blocks, 4 microbatches per batch, 1f1b; 2 "
                                        "copies of the pipeline, the batch split 2 ways between them"),
                                     (0, "pipeline: 4 stages of consecutive blocks")])
def test_the_summary_counts_a_pipelines_stages_not_its_processes(pp, said):
    """pp=2 on 4 processes is 2 stages, each replicated twice (the summary said 4 stages)."""
    from conftest import typed

    from launcher.tools.summary import _strategy

    cfg = typed("trainer.strategy=pipeline", "trainer.procs_per_node=4", f"trainer.pp={pp}")
    assert _strategy(cfg, 4).startswith(said)
