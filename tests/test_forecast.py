"""The dry run at the target scale: rank 0 and the last rank of the configured world built on torch's fake process
group with the model on the meta device, and what each will hold per GPU, on this CPU-only machine in seconds."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import FAST, REPO, read_metrics, run_cli

GPT_7B = ["model.n_layer=32", "model.n_head=32", "model.n_embd=4096", "model.block_size=2048", "model.vocab_size=32000"]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """A token file as long as 512 ranks need (100M tokens), sparse: its length is all a forecast reads."""
    directory = tmp_path_factory.mktemp("tokens")
    np.random.default_rng(0).integers(0, 50257, 20_000, dtype=np.uint16).tofile(directory / "val.bin")
    with open(directory / "train.bin", "wb") as f:
        f.truncate(2 * 100_000_000)
    (directory / "meta.json").write_text(json.dumps({"vocab_size": 50304, "dtype": "uint16"}))
    return directory


def dry_run(tmp_path, *overrides):
    return run_cli("launcher", "+experiment=gpt2_124m", "trainer.nodes=64", "launcher.dry_run=true",
                   "launcher.gpu_memory_gb=80", *overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)


def forecast(tmp_path, world: int, rank: int) -> dict:
    proc = run_cli("train.forecast", str(tmp_path / "run" / "config.yaml"), "--world", str(world), "--rank", str(rank),
                   cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_gpt2_124m_on_64_nodes_of_8_gpus_is_built_as_its_ranks_and_fits(tokens, tmp_path):
    proc = dry_run(tmp_path, f"data.root={tokens}")
    assert proc.returncode == 0, proc.stderr[-2000:]  # on a machine without a GPU
    assert "forecast  rank 0 of 512 (fsdp, 64 dp_replicate x 8 dp_shard; 124.4M parameters)" in proc.stdout
    assert "forecast  plan at 512 ranks: global batch 32768, 2 steps/epoch" in proc.stdout
    assert "each of 512 data replicas reads 191 samples per epoch" in proc.stdout
    assert "forecast  rank 511 of 512" in proc.stdout and "(fits)" in proc.stdout
    last = forecast(tmp_path, 512, 511)
    # HSDP within a node: 8 shards of fp32 parameters (FSDP pads a shard by a row at most)
    assert last["parameter_bytes"] == pytest.approx(124_373_760 * 4 / 8, rel=0.01)
    assert last["gradient_bytes"] == last["parameter_bytes"]
    assert last["optimizer_bytes"] == pytest.approx(2 * last["parameter_bytes"], rel=0.01)  # AdamW: two moments
    assert last["global_batch"] == 512 * 16 * 4 and last["samples_per_replica"] == -(-97_560 // 512)


def test_a_7b_gpt_that_cannot_fit_under_ddp_is_refused_with_the_numbers_and_fits_sharded(tokens, tmp_path):
    proc = dry_run(tmp_path, f"data.root={tokens}", *GPT_7B, "trainer.strategy=ddp", "data.batch_size=4")
    assert proc.returncode == 2
    assert "forecast  rank 0 of 512 (ddp, 512 dp_replicate; 6,582.2M parameters): parameters 24.52" in proc.stdout
    assert "more than the 70.0 GB usable on a 80 GB GPU (launcher.gpu_memory_gb)" in proc.stderr
    assert "Try: trainer.strategy=fsdp" in proc.stderr
    # The knob it names: sharded (8 per node), the same model fits (rank 0 alone, from the snapshot above)
    snapshot = tmp_path / "run" / "config.yaml"
    snapshot.write_text(snapshot.read_text().replace("strategy: ddp", "strategy: fsdp"))
    sharded = forecast(tmp_path, 512, 0)
    assert sharded["parameter_bytes"] == pytest.approx(6_582_177_792 * 4 / 8, rel=0.01)
    total = sum(sharded[k] for k in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes",
                                     "gathered_bytes"))
    assert total < 70 * 2**30


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_forecast_at_world_size_2_is_what_a_real_2_process_run_measures(tmp_path, strategy):
    run = [*FAST, "trainer.procs_per_node=2", f"trainer.strategy={strategy}", "trainer.max_steps=1", "trainer.log_every=1"]
    real = run_cli("launcher", *run, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert real.returncode == 0, real.stderr[-2000:]
    [measured] = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "memory"]
    predicted = forecast(tmp_path, 2, 0)
    mb = 2**20
    assert predicted["parameter_bytes"] / mb == pytest.approx(measured["rank0_param_mb"], rel=0.01)
    assert predicted["optimizer_bytes"] / mb == pytest.approx(measured["rank0_optim_mb"], rel=0.01)
    if strategy == "ddp":  # fsdp's measure also counts the gathered parameters a block keeps for its backward
        assert predicted["activation_bytes"] / mb == pytest.approx(measured["rank0_activation_mb"], rel=0.1)


def test_a_hugging_face_encoder_is_forecast_with_its_activations_measured_another_way(tmp_path):
    """BERT's forward reads a value back (.item()) that the meta device does not have: the forecast measures its
    activations on the CPU with a real batch instead of giving up on the whole forecast."""
    proc = run_cli("launcher", "--config-dir", "conf", "+experiment=hf_bert_classifier", "launcher.dry_run=true",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=REPO / "tests" / "foreign" / "huggingface")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "not made" not in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("forecast  rank")]
    assert len(lines) == 2 and all("activations measured on the CPU (the meta device cannot run the forward: "
                                   "Tensor.item() cannot be called on meta tensors)" in line for line in lines)


def test_the_forecast_counts_the_gradient_of_the_models_output():
    """Measured on an H200 (benchmarks/README.md): GPT-2 124M at 8 x 1024 peaked at 7.47 GB against a 5.18 GB
    forecast; the gap was the loss's backward, the float32 gradient of the B x T x V logits and, under bf16, the
    loss's float32 copy of them (counted at half with the activations)."""
    from train.forecast import output_gradient

    logits = torch.empty(8, 1024, 50304, device="meta")
    assert output_gradient(logits, mixed=True) == 2 * 8 * 1024 * 50304 * 4  # 3.07 GiB: 5.18 + 3.07 = 8.25 GiB
    assert output_gradient(logits, mixed=False) == 8 * 1024 * 50304 * 4
    assert output_gradient(torch.empty(8, 1024, dtype=torch.long, device="meta"), mixed=True) == 0  # ids: no gradient


def test_a_dry_run_plans_a_built_in_data_set_whose_files_are_not_here_and_the_run_still_refuses_it(tmp_path):
    """docs/launching.md: plan it on your laptop. The CIFAR files are the cluster's: the dry run plans with a stand-in
    of CIFAR-10's shape and size (before: refused for the missing files); the launch itself refuses them."""
    words = ["+experiment=resnet18", "trainer.gpus=4", f"data.root={tmp_path / 'no-data'}", "launcher.gpu_memory_gb=80"]
    planned = run_cli("launcher", *words, "launcher.dry_run=true", f"hydra.run.dir={tmp_path / 'plan'}", cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert "planned with a stand-in of the same shape and size, 50,000 samples of 3x32x32, 10 classes" in planned.stderr
    assert "each of 4 data replicas reads 12500 samples per epoch" in planned.stdout
    assert "forecast  rank 3 of 4 (ddp, 4 dp_replicate; 11.2M parameters)" in planned.stdout
    refused = run_cli("launcher", *FAST, *words, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert refused.returncode == 2 and "data.name=cifar10: no data set at data.root=" in refused.stderr
    assert not (tmp_path / "run").exists()
