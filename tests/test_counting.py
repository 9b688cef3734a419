"""What a loss counts: a step's loss is the mean over every item that carries a loss in the global batch (tokens
that are not ignored, samples), however the global batch is split over ranks and micro-batches; a model's own loss
is weighed the same way; a loss that is not finite stops the run before it reaches a checkpoint. Real processes,
gloo."""

from __future__ import annotations

import pytest
import torch

from conftest import FAST, REPO, SMALL_GPT, final_checkpoint, read_metrics, run_cli
from train.tasks import Classification, LanguageModeling, ModelLoss

HF = REPO / "tests" / "foreign" / "huggingface"
# Windows whose first 0..30 targets are a prompt that does not count (tests/foreign/huggingface/text_data.py).
MASKED = {
    "model_loss": ["--config-dir", "conf", "+experiment=hf_gpt2", "data.train._target_=text_data.MaskedPrompts"],
    "language_modeling": ["+experiment=gpt_tiny", "data=tokens", *SMALL_GPT,
                          "data.train._target_=text_data.MaskedPrompts", "+data.train.format=pairs"],
}


def masked_run(corpus, run_dir, task: str, *overrides: str):
    base = [*MASKED[task], *FAST, f"data.root={corpus}", "trainer.eval_every=0", "trainer.log_every=2",
            "trainer.max_steps=4", "optim.lr=0.01", "optim.schedule.warmup_steps=0", "optim.schedule.warmup_epochs=0"]
    return run_cli("launcher", *base, *overrides, f"hydra.run.dir={run_dir}", cwd=HF)


@pytest.mark.parametrize("task", ["model_loss", "language_modeling"])
def test_a_loss_over_tokens_is_the_same_however_the_global_batch_is_split(corpus, tmp_path, task):
    """Windows with 1 to 31 counted targets: 2 ranks x 8, 1 x 16 and 1 x 8 with 2 micro-batches reach the same
    weights and log the same loss. (A mean of per-rank, per-micro-batch means gave each a different gradient.)"""
    runs = {"1x16": ["trainer.procs_per_node=1", "data.batch_size=16"],
            "2x8": ["trainer.procs_per_node=2", "data.batch_size=8"],
            "1x8x2": ["trainer.procs_per_node=1", "data.batch_size=8", "trainer.accumulate=2"]}
    for name, overrides in runs.items():
        proc = masked_run(corpus, tmp_path / name, task, *overrides)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
    one, ddp, accumulated = (final_checkpoint(tmp_path / n)["model"] for n in runs)
    for name, expected in one.items():
        torch.testing.assert_close(ddp[name], expected, rtol=1e-5, atol=1e-5, msg=f"2 x 8: {name} differs from 1 x 16")
        torch.testing.assert_close(accumulated[name], expected, rtol=1e-5, atol=1e-5,
                                   msg=f"1 x 8 x 2 accumulation: {name} differs from 1 x 16")
    losses = {n: [r["loss"] for r in read_metrics(tmp_path / n) if r["kind"] == "train"] for n in runs}
    assert len(losses["1x16"]) == 2
    for name in ("2x8", "1x8x2"):
        assert losses[name] == pytest.approx(losses["1x16"], rel=1e-5), f"{name}: another training loss is logged"


def test_model_loss_counts_one_label_per_sample_without_a_shift():
    """A classifier's labels (N,) are not shifted as a causal LM's (N, T) are: a batch of N counts N, not N - 1."""
    task = ModelLoss(shift_labels=True)
    labels = torch.tensor([0, 1, 2, 1])
    assert task.count({"input_ids": torch.zeros(4, 7, dtype=torch.long), "labels": labels}) == 4
    tokens = torch.tensor([[5, 6, -100, 7], [-100, -100, 1, 2]])
    assert task.count({"input_ids": tokens.clamp(min=0), "labels": tokens}) == 4  # labels[:, 1:]: 6, 7 and 1, 2
    assert ModelLoss(shift_labels=False).count({"labels": tokens}) == 5
    output = {"loss": torch.tensor(0.5), "logits": torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [2.0, 0.0, 0.0],
                                                                   [0.0, 2.0, 0.0]])}
    sums = ModelLoss(accuracy=True).sums(output, {"labels": labels})
    assert sums["weight"] == 4 and sums["correct"] == 3 and sums["loss"] == pytest.approx(2.0)
    assert ModelLoss(accuracy=True).main_metric == "acc"


def test_built_in_tasks_sum_what_they_count():
    logits = torch.randn(3, 5, 11)
    targets = torch.tensor([[1, 2, -100, 4, 5], [-100, -100, -100, -100, 3], [0, 1, 2, 3, 4]])
    task = LanguageModeling()
    assert task.count(targets) == 10
    torch.testing.assert_close(task.loss_sum(logits, targets), task.loss(logits, targets) * 10)
    classes = Classification()
    scores, labels = torch.randn(6, 4), torch.tensor([0, 3, 1, 2, 2, 0])
    torch.testing.assert_close(classes.loss_sum(scores, labels), classes.loss(scores, labels) * 6)
    # A Hugging Face style dict batch: the targets are its labels, the rest goes to the model as keywords.
    inputs, targets = classes.split({"input_ids": torch.ones(6, 3), "attention_mask": torch.ones(6, 3), "labels": labels})
    assert sorted(inputs) == ["attention_mask", "input_ids"] and targets is labels
    assert classes.loss(type("Out", (), {"logits": scores})(), labels) == classes.loss(scores, labels)


POISONED = '''
import os

import torch
from torch.utils.data import Dataset


class Poisoned(Dataset):
    """y = sum(x) on 8 features; on rank `poison_rank` (of replica group `poison_group`, if given), the samples of its
    micro-batch number `batch` (counted from 1) hold a NaN: a loss that is not finite at that step, on that rank only."""

    def __init__(self, poison_rank: int = -1, batch: int = 0, batch_size: int = 8, poison_group: int = -1):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 8, generator=generator)
        self.poisoned = os.environ.get("RANK") == str(poison_rank) and (
            poison_group < 0 or os.environ.get("REPLICA_GROUP_ID") == str(poison_group))
        self.first, self.last = (batch - 1) * batch_size, batch * batch_size
        self.served = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        x = self.x[index].clone()
        if self.poisoned and self.first <= self.served < self.last:
            x[0] = float("nan")
        self.served += 1
        return x, x.sum(0, keepdim=True)
'''
EXPERIMENT = """# @package _global_
defaults:
  - override /model: null
  - override /data: poisoned
  - override /task: regression
name: poisoned
model: {_target_: torch.nn.Linear, in_features: 8, out_features: 1}
"""
DATA = """name: poisoned
batch_size: 8
train: {_target_: poisoned.Poisoned, poison_rank: 1, batch: 4, batch_size: 8}
eval: {_target_: poisoned.Poisoned}
"""


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    project = tmp_path_factory.mktemp("poisoned")
    (project / "conf" / "experiment").mkdir(parents=True)
    (project / "conf" / "data").mkdir()
    (project / "conf" / "data" / "poisoned.yaml").write_text(DATA)
    (project / "poisoned.py").write_text(POISONED)
    (project / "conf" / "experiment" / "poisoned.yaml").write_text(EXPERIMENT)
    return project


def poisoned_run(project, run_dir, *overrides: str):
    return run_cli("launcher", "--config-dir", "conf", "+experiment=poisoned", *FAST, "trainer.procs_per_node=2",
                   "trainer.max_steps=8", "trainer.log_every=1", "checkpoint.every_steps=2", "optim.lr=0.01",
                   *overrides, f"hydra.run.dir={run_dir}", cwd=project)


def test_a_loss_that_is_not_finite_stops_the_run_naming_the_step_and_rank_and_keeps_the_last_good_checkpoint(
        poisoned, tmp_path):
    proc = poisoned_run(poisoned, tmp_path / "run", "launcher.max_restarts=2", "trainer.log_every=3")
    assert proc.returncode == 65  # as docs/watching.md says: not a crash's 1
    assert "the training loss was not finite (NaN or inf) at step 4, first on rank 1" in proc.stderr
    assert "restarting the workers" not in proc.stderr  # it would come back at the same step
    assert proc.stderr.count("Traceback") == 1 and "exit code 65" in proc.stderr  # the cause once, not per rank
    assert "failed (exitcode" not in proc.stderr  # torch's own repeated lines
    newest = final_checkpoint(tmp_path / "run")
    assert newest["step"] == 2  # the save due at step 4 was not written
    status = run_cli("launcher.jobs", "status", str(tmp_path / "run"), cwd=poisoned)
    assert "exit code 65: NonFiniteLoss: the training loss was not finite (NaN or inf) at step 4, first on rank 1" \
        in " ".join(status.stdout.split())  # why it failed, in the run's status
    assert all(torch.isfinite(v).all() for v in newest["model"].values())


def test_trainer_nonfinite_skip_drops_the_step_and_goes_on(poisoned, tmp_path):
    proc = poisoned_run(poisoned, tmp_path / "run", "trainer.nonfinite=skip")
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = final_checkpoint(tmp_path / "run")
    assert final["step"] == 8 and all(torch.isfinite(v).all() for v in final["model"].values())
    skipped = {r["step"]: r["skipped_steps"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"}
    assert skipped[3] == 0 and skipped[4] == 1 and skipped[8] == 1


def test_replica_groups_skip_a_step_together_when_one_groups_loss_is_not_finite(poisoned, tmp_path):
    """trainer.nonfinite=skip with 2 replica groups: group 1's loss is NaN at step 4 and its NaN gradients are averaged
    into group 0's; group 0's own loss was finite, and stepping on them made its weights NaN (each group agreed its skip
    with its own ranks only). The verdict crosses the groups with the gradients: both skip step 4, end identical."""
    proc = poisoned_run(poisoned, tmp_path / "run", "trainer.nonfinite=skip", "trainer.fault_tolerance=replicas",
                        "trainer.replica_groups=2", "+data.train.poison_group=1", "data.train.poison_rank=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = final_checkpoint(tmp_path / "run")
    assert final["step"] == 8 and all(torch.isfinite(v).all() for v in final["model"].values())
    for group in (0, 1):
        assert f"replica group {group}: weights identical to the other groups' at step 8" in proc.stdout
    skipped = {r["step"]: r["skipped_steps"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"}
    assert skipped[3] == 0 and skipped[4] == 1 and skipped[8] == 1


def test_replica_groups_stop_together_at_a_loss_that_is_not_finite_and_say_whose_it_was(poisoned, tmp_path):
    """The default trainer.nonfinite=stop with 2 replica groups: group 1's loss is NaN at step 4; both groups stop
    there (exit 65) with the last good checkpoint, and group 0 says the NaN was another group's."""
    proc = poisoned_run(poisoned, tmp_path / "run", "trainer.fault_tolerance=replicas", "trainer.replica_groups=2",
                        "+data.train.poison_group=1", "data.train.poison_rank=0", "trainer.log_every=3")
    assert proc.returncode == 65, proc.stderr[-3000:]
    assert "not finite (NaN or inf) at step 4, first on rank 0;" in proc.stderr  # group 1's
    assert "not finite (NaN or inf) at step 4, first on rank 0 of another replica group;" in proc.stderr  # group 0's
    newest = final_checkpoint(tmp_path / "run")
    assert newest["step"] == 2 and all(torch.isfinite(v).all() for v in newest["model"].values())


def test_a_replica_groups_logged_loss_is_its_batch_mean_not_divided_by_every_groups_copies(tmp_path):
    """With replica groups the meter's all-gather covers one group, whose ranks' losses are that group's mean scaled by
    its own copies; dividing by every group's copies logged 4.74 where ddp logged 6.27 on the same data."""
    import torch.distributed as dist

    from train.step import Meter

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        meter = Meter(torch.device("cpu"))
        meter.add(torch.tensor(6.27))  # one rank, one copy in its group: its loss is its batch's mean
        meter.timed_steps = 1
        assert meter.reduce(global_batch=16, replicas=2, loss_replicas=1)["loss"] == pytest.approx(6.27)
        meter.add(torch.tensor(6.27))
        meter.timed_steps = 1
        assert meter.reduce(global_batch=16, replicas=1, loss_replicas=1)["loss"] == pytest.approx(6.27)  # no groups
    finally:
        dist.destroy_process_group()


def test_a_model_with_batch_norm_says_at_start_that_splitting_the_batch_changes_it():
    from train.build import batch_statistics_note
    from train.models.vision import mlp, resnet18

    net = resnet18(channels=3, image_size=32, num_classes=10, width=8)
    note = batch_statistics_note(net, replicas=2, accumulate=1, elastic=False)
    assert note and "BatchNorm layer(s)" in note and "2 replica(s) x 1 micro-batch(es)" in note
    assert "2 x B differs from 1 x 2B" in note and "trainer.sync_batchnorm=true computes them over every rank." in note
    assert batch_statistics_note(net, replicas=2, accumulate=1, elastic=False, synced=True) is None  # the fix
    assert "over each micro-batch apart (trainer.accumulate=2)" in batch_statistics_note(net, 2, 2, False, synced=True)
    assert "changes the micro-batches" in batch_statistics_note(net, 2, 1, True, synced=True)
    assert "elastic" in batch_statistics_note(net, replicas=1, accumulate=1, elastic=True)
    assert batch_statistics_note(net, replicas=1, accumulate=1, elastic=False) is None  # nothing is split
    assert batch_statistics_note(mlp(channels=1, image_size=8, num_classes=10, hidden=[8]), 4, 2, True) is None


def test_a_mixture_of_experts_with_a_router_loss_says_at_start_that_splitting_the_batch_changes_it():
    from transformers import MixtralConfig, MixtralForCausalLM

    from train.build import router_loss_note

    config = MixtralConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, intermediate_size=32, num_local_experts=2, num_experts_per_tok=1,
                           output_router_logits=True, router_aux_loss_coef=0.02)
    note = router_loss_note(MixtralForCausalLM(config), replicas=1, accumulate=2, elastic=False)
    assert note and "router_aux_loss_coef=0.02" in note and "1 replica(s) x 2 micro-batch(es)" in note
    assert "output_router_logits=false" in note  # the way to keep the identity
    assert router_loss_note(MixtralForCausalLM(config), replicas=1, accumulate=1, elastic=False) is None
    config.output_router_logits = False
    assert router_loss_note(MixtralForCausalLM(config), replicas=4, accumulate=2, elastic=True) is None


def tiny_segformer():
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    torch.manual_seed(0)
    config = SegformerConfig(num_labels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                             num_attention_heads=[1, 1], decoder_hidden_size=16, patch_sizes=[7, 3], strides=[4, 2],
                             mlp_ratios=[2, 2])
    return SegformerForSemanticSegmentation(config).eval()  # semantic_loss_ignore_index: 255, its default


def test_a_segmentation_models_ignored_label_is_followed_and_its_accuracy_read_from_class_first_logits():
    """SegFormer's own loss ignores label 255 (config.semantic_loss_ignore_index) and gives logits (N, C, H/4, W/4).
    Before: the task counted its 255 pixels as items (the evaluation loss and the ranks' weights wrong), and accuracy
    took the classes as last and died at the first evaluation."""
    model = tiny_segformer()
    labels = torch.randint(0, 3, (2, 32, 32))
    labels[:, :8] = 255  # a quarter of the pixels: the model's "ignore"
    batch = {"pixel_values": torch.randn(2, 3, 32, 32), "labels": labels}
    task = ModelLoss(accuracy=True)
    said = task.follow(model)
    assert "task.ignore_index=255: SegformerForSemanticSegmentation's own loss ignores label 255" in said, said
    assert task.count(batch) == 2 * 24 * 32
    with torch.no_grad():
        output = task.call(model, batch)
    upsampled = torch.nn.functional.interpolate(output.logits, size=(32, 32), mode="bilinear", align_corners=False)
    counted = labels != 255
    sums = task.sums(output, batch)
    assert sums["weight"] == counted.sum() and sums["correct"] == ((upsampled.argmax(1) == labels) & counted).sum()
    # The index set in the config wins, and the line says what it costs
    kept = ModelLoss(ignore_index=-100)
    assert "labels 255 are counted as items" in kept.follow(model) and kept.count(batch) == 2 * 32 * 32
    # Logits the task cannot read: the key and the way out, not an IndexError at the first evaluation
    with pytest.raises(ValueError, match="leave task.accuracy off"):
        ModelLoss(accuracy=True).sums({"loss": torch.tensor(1.0), "logits": torch.randn(2, 5)}, {"labels": torch.zeros(3, dtype=torch.long)})
