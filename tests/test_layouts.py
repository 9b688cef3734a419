"""Parallel layouts on one device mesh (train.parallel.layout): tensor parallelism (train.parallel.tensor_parallel) splits the GPT 2
ways by heads and hidden units and reaches one process's weights; composed with FSDP over the other 2 ranks it
reaches DDP's on 4; its sharded checkpoints resume under another layout; a pipeline of 2 stages copied twice
reaches one process. Real processes, gloo: DTensor runs on CPU."""

from __future__ import annotations

import pytest
import torch

from conftest import GPT_PIPELINE, REPO, read_metrics, run_cli, small_gpt
from test_config import problems
from train.parallel.layout import Layout, LayoutError, layout_of
from train.config import TrainerConfig

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def gpt_run(corpus, run_dir, *overrides: str):
    proc = run_cli("launcher", *small_gpt(corpus), "checkpoint.every_steps=4", *overrides, f"hydra.run.dir={run_dir}",
                   cwd=run_dir.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def weights(run_dir, step: int) -> dict:
    """The model of the checkpoint of `step`, whichever format holds it."""
    from conftest import checkpoint_at

    return checkpoint_at(run_dir, step)["model"]


def evals(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["kind"] == "eval"}


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], **TOLERANCE, msg=f"{what}: {name} differs")


def test_the_layout_orders_ranks_tp_innermost_and_refuses_what_does_not_divide():
    layout = Layout(pp=1, dp_replicate=2, dp_shard=2, tp=2)
    assert layout.world_size == 8 and layout.dp == 4
    assert [layout.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # a tp group reads one share
    assert layout.coordinates(5) == {"pp": 0, "dp_replicate": 1, "dp_shard": 0, "tp": 1}
    fsdp = TrainerConfig(strategy="fsdp", tp=2, fsdp_replicate=0)
    assert layout_of(fsdp, 8, 4) == Layout(dp_replicate=2, dp_shard=2, tp=2)  # a copy per node of 4
    assert layout_of(TrainerConfig(strategy="ddp"), 4, 4) == Layout(dp_replicate=4)
    assert layout_of(TrainerConfig(strategy="pipeline"), 4, 4) == Layout(pp=4)
    with pytest.raises(LayoutError, match=r"trainer.tp=3 must divide the world size \(8 processes\)"):
        layout_of(TrainerConfig(strategy="fsdp", tp=3), 8, 8)


def test_evaluation_runs_in_lockstep_where_a_forward_gathers_shards_across_data_parallel_ranks():
    lockstep = {name: layout_of(TrainerConfig(**overrides), 4, 4).lockstep_eval for name, overrides in {
        "ddp": {"strategy": "ddp"}, "ddp+tp": {"strategy": "fsdp", "tp": 2, "fsdp_replicate": 2},
        "fsdp": {"strategy": "fsdp"}, "hsdp": {"strategy": "fsdp", "fsdp_replicate": 2},
        "pipeline": {"strategy": "pipeline", "pp": 2}, "sharded pipeline": {"strategy": "pipeline", "pp": 2, "pp_sharded": True},
    }.items()}
    assert lockstep == {"ddp": False, "ddp+tp": False, "fsdp": True, "hsdp": True, "pipeline": False,
                        "sharded pipeline": True}


def test_a_layout_or_a_plan_that_does_not_fit_is_refused_before_start(tmp_path):
    gpt = ["+experiment=gpt_tiny", "data=synthetic", "trainer.strategy=fsdp"]
    assert "trainer.tp=3 must divide the world size (2 processes)" in \
        problems(*gpt, "trainer.procs_per_node=2", "trainer.tp=3", run_dir=tmp_path)
    assert "trainer.tp=4 does not divide the 2 attention heads of blocks.0.attn.q" in \
        problems(*gpt, "trainer.procs_per_node=4", "trainer.tp=4", "model.n_head=2", "model.n_embd=64", run_dir=tmp_path)
    assert "trainer.tp=2 composes with trainer.strategy=fsdp" in \
        problems("trainer.procs_per_node=2", "trainer.tp=2", run_dir=tmp_path)
    assert "the model has no tensor-parallel plan" in \
        problems("trainer.procs_per_node=2", "trainer.tp=2", "trainer.strategy=fsdp", run_dir=tmp_path)
    assert "trainer.sequence_parallel=true, but the tensor-parallel plan has no sequence-parallel styles" in \
        problems(*gpt, "trainer.procs_per_node=2", "trainer.tp=2", "trainer.sequence_parallel=true",
                 "+trainer.tp_plan={blocks.*.mlp.0: colwise}", run_dir=tmp_path)
    assert "trainer.loss_parallel=true computes the cross-entropy on logits split by vocabulary, which " \
           "task._target_=train.tasks.Classification does not do" in \
        problems("trainer.procs_per_node=2", "trainer.tp=2", "trainer.strategy=fsdp", "trainer.loss_parallel=true",
                 "+trainer.tp_plan={fc*: colwise}", run_dir=tmp_path)
    assert "trainer.tp_plan names no module of the model" in \
        problems("trainer.procs_per_node=2", "trainer.tp=2", "trainer.strategy=fsdp",
                 "+trainer.tp_plan={fc*: colwise}", run_dir=tmp_path)


def test_tp2_reaches_one_process_and_its_checkpoint_resumes_as_one_process(corpus, gpt_one_process, tmp_path):
    """AdamW with clipping, 8 steps split 2 ways (the same batch on both ranks of the tp group) against 1 process,
    with sequence parallelism (the residual stream cut along the sequence, the tied vocabulary table split by rows)
    and loss parallelism (the logits left split by vocabulary for the cross-entropy); then the sharded checkpoint of
    step 8 resumed by 1 process to step 12, against the straight run. Plain tp: test_tp2_by_fsdp2_..., the split
    pipeline."""
    one = gpt_one_process
    tp = gpt_run(corpus, tmp_path / "tp", "trainer.procs_per_node=2", "trainer.strategy=fsdp", "trainer.tp=2",
                 "trainer.sequence_parallel=true", "trainer.loss_parallel=true", "data.batch_size=32",
                 "trainer.max_steps=8")
    assert "plan: 2 processes (fsdp, 2 tp)" in tp.stdout and "1 replicas" in tp.stdout
    assert "the model was built on the meta device" in tp.stderr  # each rank filled in its tp x fsdp pieces only
    assert_same(weights(one, 8), weights(tmp_path / "tp", 8), "tp=2 with sequence and loss parallelism at step 8")
    assert evals(tmp_path / "tp")[8] == pytest.approx(evals(one)[8], rel=1e-6)  # exact evaluation
    train = [r for r in read_metrics(tmp_path / "tp") if r["kind"] == "train"]
    reference = [r for r in read_metrics(one) if r["kind"] == "train"]
    assert train[-1]["loss"] == pytest.approx(reference[1]["loss"], rel=1e-5)  # the tp group's loss counted once

    resumed = gpt_run(corpus, tmp_path / "tp", "trainer.procs_per_node=1", "checkpoint.format=dcp", "data.batch_size=32",
                      "trainer.max_steps=12")
    assert "resumed at step 8" in resumed.stdout
    assert_same(weights(one, 12), weights(tmp_path / "tp", 12), "tp=2 resumed by 1 process")


def test_tp2_by_fsdp2_reaches_one_process_and_resumes_as_fsdp_on_2(corpus, gpt_one_process, tmp_path):
    """4 processes: tp groups {0,1} and {2,3}, each reading half the batch, sharded (or copied) over the other
    dimension. The reference is one process with the global batch (ddp's 4 x 8 is it: test_gpt, test_counting)."""
    layered = gpt_run(corpus, tmp_path / "tp", "trainer.procs_per_node=4", "trainer.strategy=fsdp", "trainer.tp=2",
                      "trainer.fsdp_replicate=1", "data.batch_size=16", "trainer.max_steps=8")
    assert "plan: 4 processes (fsdp, 2 dp_shard x 2 tp)" in layered.stdout
    assert_same(weights(gpt_one_process, 8), weights(tmp_path / "tp", 8), "tp=2 x fsdp=2 at step 8")
    # The 2 dp_shard x 2 tp pieces resharded into fsdp's 2 shards (into one process's whole tensors: tp alone, above;
    # the split pipeline's stages x tp, test_a_two_stage_pipeline_...)
    resumed = gpt_run(corpus, tmp_path / "tp", "trainer.procs_per_node=2", "trainer.strategy=fsdp", "data.batch_size=16",
                      "trainer.max_steps=12")
    assert "resumed at step 8" in resumed.stdout
    assert_same(weights(gpt_one_process, 12), weights(tmp_path / "tp", 12), "resumed as fsdp=2")
    # ddp's layout with tp: 2 whole copies (HSDP with shards of one), what the refusal of tp under ddp points to.
    copies = gpt_run(corpus, tmp_path / "copies", "trainer.procs_per_node=4", "trainer.strategy=fsdp", "trainer.tp=2",
                     "trainer.fsdp_replicate=2", "data.batch_size=16", "trainer.max_steps=8")
    assert "plan: 4 processes (fsdp, 2 dp_replicate x 2 tp)" in copies.stdout
    assert_same(weights(gpt_one_process, 8), weights(tmp_path / "copies", 8), "tp=2 x 2 copies at step 8")


def test_a_two_stage_pipeline_copied_sharded_or_split_reaches_one_process(corpus, gpt_pipeline_one_process, tmp_path):
    """4 processes as 2 stages x 2: copies of the pipeline (a stage's copies average their gradients), its stages
    sharded over the 2 (FSDP2 per stage), or each stage's layers split 2 ways (tp). Clipping by the norm over both
    stages, each piece counted once."""
    pipeline = [*GPT_PIPELINE, "trainer.max_steps=8", "trainer.procs_per_node=4", "trainer.strategy=pipeline",
                "trainer.microbatches=2"]
    one = gpt_pipeline_one_process
    layouts = {"copied": (["trainer.pp=2", "data.batch_size=16"], "2 pp x 2 dp_replicate", "16 x 2 replicas"),
               "sharded": (["trainer.pp=2", "trainer.pp_sharded=true", "data.batch_size=16"], "2 pp x 2 dp_shard",
                           "16 x 2 replicas"),
               "split": (["trainer.tp=2", "data.batch_size=32"], "2 pp x 2 tp", "32 x 1 replicas")}
    for name, (overrides, layout, batch) in layouts.items():
        staged = gpt_run(corpus, tmp_path / name, *pipeline, *overrides)
        assert f"processes (pipeline, {layout}), global batch 32 ({batch} x 1 accumulation)" in staged.stdout
        assert_same(weights(one, 8), weights(tmp_path / name, 8), f"2 stages {layout}")
        assert evals(tmp_path / name)[8] == pytest.approx(evals(one)[8], rel=1e-5)
    # The split pipeline's sharded checkpoint (stages x tp) resumed by one process, without a pipeline.
    alone = gpt_run(corpus, tmp_path / "split", *pipeline, "trainer.procs_per_node=1", "trainer.strategy=ddp",
                    "checkpoint.format=dcp", "data.batch_size=32", "trainer.max_steps=12")
    assert "resumed at step 8" in alone.stdout
    assert_same(weights(one, 12), weights(tmp_path / "split", 12), "2 pp x 2 tp resumed by 1 process")


def test_a_users_own_plan_that_splits_heads_is_refused_by_the_heads_the_model_declares():
    """nanoGPT's attention (verbatim, tests/foreign/nanogpt) fuses q, k and v in one Linear and declares n_head:
    3 heads of 8 make 72 output features, which divide by 2, but no rank could hold whole heads (the model's view()
    would fail inside every rank)."""
    import importlib.util

    from train.parallel.tensor_parallel import problems_with

    spec = importlib.util.spec_from_file_location("nanogpt_model", REPO / "tests" / "foreign" / "nanogpt" / "model.py")
    nanogpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nanogpt)
    with torch.device("meta"):
        model = nanogpt.GPT(nanogpt.GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=3, n_embd=24))
    plan = {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.attn.c_proj": "rowwise"}
    [problem] = problems_with(model, plan, tp=2)
    assert problem.startswith("trainer.tp=2 does not divide the 3 attention heads of transformer.h.0.attn.c_attn (n_head=3)")
    assert problems_with(model, plan, tp=3) == []
