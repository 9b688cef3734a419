"""Model parallelism through the real CLI with real gloo processes: FSDP2 reaches DDP's weights with about half
the parameter memory per rank, a 2-stage pipeline reaches one process's weights, both checkpoint and resume
exactly, export a plain single-device state dict, and refuse bad combinations before any process starts."""

from __future__ import annotations

import pytest
import torch

from conftest import IDENTITY, final_checkpoint, read_metrics
from train.checkpoint import dcp
from train.checkpoint import committed
from train.models.vision import mlp

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def assert_same_weights(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, **TOLERANCE, msg=f"{name} differs")


def memory(run_dir) -> dict:
    [record] = [r for r in read_metrics(run_dir) if r["kind"] == "memory"]
    return record


def single_device_model() -> torch.nn.Module:
    return mlp(channels=1, image_size=16, num_classes=10, hidden=[64, 32])


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    from conftest import run_cli

    tmp = tmp_path_factory.mktemp("fsdp")
    proc = run_cli("launcher", *IDENTITY, "trainer.strategy=fsdp", "trainer.procs_per_node=2", "data.batch_size=16",
                   f"hydra.run.dir={tmp / 'run'}", cwd=tmp)
    assert proc.returncode == 0
    assert "fsdp: parameters, gradients and optimizer state sharded 2 ways" in proc.stdout
    assert "the model was built on the meta device" in proc.stderr  # trainer.meta_init, the default under fsdp
    return tmp / "run"


def test_fsdp_reaches_the_weights_of_ddp_with_half_the_parameter_memory(fsdp_run, two_process_ddp):
    fsdp, ddp = final_checkpoint(fsdp_run), final_checkpoint(two_process_ddp)
    assert fsdp["strategy"] == "fsdp" and fsdp["step"] == ddp["step"] == 24
    assert_same_weights(fsdp["model"], ddp["model"])

    sharded, replicated = memory(fsdp_run), memory(two_process_ddp)
    for rank in (0, 1):
        assert replicated[f"rank{rank}_param_mb"] == pytest.approx(replicated["rank0_param_mb"])  # full copies
        # 1/2 of every parameter, up to the padding of each shard to equal sizes
        assert sharded[f"rank{rank}_param_mb"] == pytest.approx(replicated[f"rank{rank}_param_mb"] / 2, rel=0.02)
        assert sharded[f"rank{rank}_optim_mb"] == pytest.approx(replicated[f"rank{rank}_optim_mb"] / 2, rel=0.02)


def test_fsdp_on_one_process_trains_the_whole_model_as_ddp_does_and_says_so(launch, tmp_path, one_process_batch_32):
    """Nothing to shard on one rank: FSDP's gathers and hooks only cost time there (2.4x slower than a plain model for
    GPT-2 124M on an H200), so the model stays whole (its parameters plain tensors, not DTensor shards), the launcher
    says so in its strategy line, the checkpoint stays fsdp's, and the weights are those of one ddp process."""
    run = tmp_path / "run"
    proc = launch(*IDENTITY, "trainer.strategy=fsdp", "trainer.procs_per_node=1", "data.batch_size=32",
                  "checkpoint.format=file", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fsdp on one process: nothing to shard" in proc.stdout
    saved = final_checkpoint(run)
    assert saved["strategy"] == "fsdp" and saved["step"] == 24
    assert_same_weights(saved["model"], one_process_batch_32["model"])
    whole = sum(p.numel() * 4 for p in single_device_model().parameters()) / 2**20
    assert memory(run)["rank0_param_mb"] == pytest.approx(whole, rel=0.01)


def test_fsdp_checkpoint_file_is_a_plain_state_dict_and_resumes_exactly(launch, tmp_path, fsdp_run):
    """checkpoint.format=file under fsdp (sharded step directories are tested in test_sharded_checkpoints.py)."""
    run = [*IDENTITY, "trainer.strategy=fsdp", "trainer.procs_per_node=2", "data.batch_size=16", "checkpoint.format=file",
           f"hydra.run.dir={tmp_path / 'run'}"]
    assert launch(*run, "trainer.max_steps=12").returncode == 0
    halfway = final_checkpoint(tmp_path / "run")
    single_device_model().load_state_dict(halfway["model"])  # strict: every key, unsharded shapes
    assert launch(*run).returncode == 0  # the same command again: resumes at step 12, runs to 24
    resumed = final_checkpoint(tmp_path / "run")
    assert resumed["step"] == 24
    for name, value in final_checkpoint(fsdp_run)["model"].items():
        assert torch.equal(resumed["model"][name], value), f"{name} differs after resume"


PIPELINE = [*IDENTITY, "trainer.strategy=pipeline", "trainer.procs_per_node=2", "trainer.microbatches=4"]


# 1F1B without accumulation: test_pipeline_resumes_exactly's runs, test_layouts.py against one process
@pytest.mark.parametrize("schedule,batch,accumulate", [("gpipe", 32, 1), ("1f1b", 16, 2)])
def test_a_two_stage_pipeline_reaches_the_weights_of_one_process(launch, tmp_path, one_process_batch_32, schedule, batch, accumulate):
    proc = launch(*PIPELINE, f"trainer.pipeline_schedule={schedule}", f"data.batch_size={batch}",
                  f"trainer.accumulate={accumulate}", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0
    pipeline = final_checkpoint(tmp_path / "run")
    assert pipeline["global_batch"] == one_process_batch_32["global_batch"] == 32  # every stage sees the whole batch
    assert_same_weights(pipeline["model"], one_process_batch_32["model"])
    single_device_model().load_state_dict(pipeline["model"])  # the stages put together: the whole model

    # Each stage holds only its blocks: together exactly the whole model, each well under it.
    record = memory(tmp_path / "run")
    whole = sum(v.numel() * v.element_size() for v in pipeline["model"].values()) / 2**20
    assert record["rank0_param_mb"] + record["rank1_param_mb"] == pytest.approx(whole)
    assert max(record["rank0_param_mb"], record["rank1_param_mb"]) < 0.9 * whole
    train = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert all(r["loss"] > 0 for r in train)  # the loss is the last stage's, not averaged with zeros


def test_pipeline_resumes_exactly(launch, tmp_path):
    run = [*PIPELINE, "data.batch_size=32", "trainer.grad_clip=0.5"]  # clipping: the norm spans both stages
    assert launch(*run, f"hydra.run.dir={tmp_path / 'straight'}").returncode == 0
    assert launch(*run, "trainer.max_steps=12", f"hydra.run.dir={tmp_path / 'resumed'}").returncode == 0
    assert launch(*run, f"hydra.run.dir={tmp_path / 'resumed'}").returncode == 0
    straight, resumed = final_checkpoint(tmp_path / "straight"), final_checkpoint(tmp_path / "resumed")
    assert straight["step"] == resumed["step"] == 24
    for name, value in straight["model"].items():
        assert torch.equal(resumed["model"][name], value), f"{name} differs after resume"


def test_a_model_without_enough_split_points_is_refused_before_start(launch, tmp_path):
    proc = launch(*IDENTITY, "trainer.strategy=pipeline", "trainer.procs_per_node=2", "model.hidden=[]",
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert "model._target_=train.models.vision.mlp declares 1 block(s)" in proc.stderr and "more model.hidden layers" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()  # no worker ever started


def test_the_launcher_knows_the_pipeline_schedules_the_trainer_has():
    from train.parallel.pipeline import SCHEDULES
    from train.parallel.strategies import PIPELINE_SCHEDULES

    assert set(PIPELINE_SCHEDULES) == set(SCHEDULES)


# A conv model with active clipping (the norm of the first steps is far above 0.05) and channels_last batches.
NO_MODEL = [o for o in IDENTITY if not o.startswith("model")]  # IDENTITY's mlp arguments do not fit other models
CONV = [*NO_MODEL, "model=cnn", "model.width=4", "trainer.procs_per_node=2", "data.batch_size=16",
        "trainer.memory_format=channels_last", "trainer.grad_clip=0.05"]


def test_fsdp_trains_conv_models_in_channels_last_and_clips_like_ddp(launch, tmp_path):
    """fully_shard refuses channels_last parameters: FSDP keeps them contiguous, the batches stay channels_last.
    Clipping sums each rank's shard norms over the ranks: the same clipped weights as DDP's whole-gradient norm."""
    for strategy in ("ddp", "fsdp"):
        proc = launch(*CONV, f"trainer.strategy={strategy}", f"hydra.run.dir={tmp_path / strategy}")
        assert proc.returncode == 0, f"{strategy} with channels_last failed"
    assert_same_weights(final_checkpoint(tmp_path / "fsdp")["model"], final_checkpoint(tmp_path / "ddp")["model"])


def test_fsdp_bf16_keeps_batchnorm_in_float32(launch, tmp_path):
    """bf16 parameters with float32 running statistics fail in BatchNorm: its layers get their own float32 group."""
    proc = launch(*NO_MODEL, "model=resnet18", "model.width=4", "data.channels=3", "trainer.procs_per_node=2",
                  "data.batch_size=16", "trainer.strategy=fsdp", "trainer.precision=bf16", "trainer.max_steps=6",
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0
    model = final_checkpoint(tmp_path / "run")["model"]
    assert model["stem.1.weight"].dtype == model["stem.1.running_var"].dtype == torch.float32
    assert not torch.equal(model["stem.1.running_var"], torch.ones_like(model["stem.1.running_var"]))  # it ran
    [evaluation] = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "eval"]
    assert 0 < evaluation["loss"] < 10


def test_hsdp_2_copies_of_2_shards_reach_the_weights_of_ddp(launch, tmp_path):
    """4 processes as a 2 x 2 device mesh (shard within a copy, all-reduce between the copies), with gradient
    clipping (each shard's norm counted once, not once per copy): ddp's weights within 1e-5."""
    clip = ["trainer.grad_clip=0.5"]
    proc = launch(*IDENTITY, "trainer.strategy=fsdp", "trainer.procs_per_node=4", "trainer.fsdp_replicate=2",
                  "data.batch_size=8", *clip, f"hydra.run.dir={tmp_path / 'hsdp'}")
    assert proc.returncode == 0 and "2 copies of the model, each sharded 2 ways" in proc.stdout
    assert launch(*IDENTITY, "trainer.procs_per_node=2", "data.batch_size=16", *clip,
                  f"hydra.run.dir={tmp_path / 'ddp'}").returncode == 0
    hsdp, ddp = final_checkpoint(tmp_path / "hsdp"), final_checkpoint(tmp_path / "ddp")
    assert hsdp["step"] == ddp["step"] == 24
    assert_same_weights(hsdp["model"], ddp["model"])
    manifest = dcp.read_manifest(committed(tmp_path / "hsdp" / "checkpoints")[-1].path)
    assert manifest["world_size"] == 4
    shards = memory(tmp_path / "hsdp")
    assert shards["rank3_param_mb"] == pytest.approx(memory(tmp_path / "ddp")["rank0_param_mb"] / 2, rel=0.02)


def test_the_global_norm_of_gradients_in_pieces_is_clipped_as_clip_grad_norm_clips_the_whole():
    """clip_global_norm (fsdp, pipelines) in fused kernels per group of pieces: the same norm and the same scaled
    gradients as torch's clip_grad_norm_ on the whole, pieces of two dtypes and held by several ranks counted once."""
    import torch.distributed as dist

    from train.parallel.strategy import clip_global_norm

    own_group = not dist.is_initialized()
    if own_group:  # a world of one, its store in this process: nothing in the environment for later tests
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        whole = [torch.nn.Parameter(torch.zeros(5, 7)), torch.nn.Parameter(torch.zeros(3))]
        for p in whole:
            p.grad = torch.randn_like(p) * 3
        pieces = [whole[0].grad.clone(), whole[1].grad.clone().double()]
        expected = torch.nn.utils.clip_grad_norm_(whole, 1.0)
        total = clip_global_norm(pieces, 1.0, torch.device("cpu"))
        assert torch.allclose(total.double(), expected.double(), rtol=1e-6)
        assert torch.allclose(pieces[0], whole[0].grad, rtol=1e-6) and torch.allclose(pieces[1].float(), whole[1].grad, rtol=1e-6)
        doubled = [whole[0].grad.clone()] * 2  # one piece held by 2 ranks (HSDP's copies): counted once
        twice = clip_global_norm([doubled[0].clone(), doubled[1].clone()], 1e9, torch.device("cpu"), copies=[2, 2])
        assert torch.allclose(twice, whole[0].grad.norm(), rtol=1e-6)
    finally:
        if own_group:
            dist.destroy_process_group()
