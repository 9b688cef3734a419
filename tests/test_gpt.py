"""Language models: the GPT preset's model, token windows from memory-mapped files, the next-token task, tokens/s and
MFU, activation checkpointing. Real processes and gloo for the distributed properties."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from conftest import FAST, GPT_PIPELINE, REPO, SMALL_GPT, final_checkpoint, read_metrics, run_cli, small_gpt
from train.models.gpt import GPT
from train.step import SavedActivations
from train.data.tokens import TokenWindows

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def ddp_run(corpus, tmp_path_factory):
    """12 steps on 2 processes x 16 windows (with a peak for MFU): the reference of several tests below."""
    run_dir = tmp_path_factory.mktemp("gpt") / "ddp"
    proc = gpt_run(corpus, run_dir, "trainer.procs_per_node=2", "trainer.peak_tflops=0.5", "trainer.eval_every_steps=8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir, proc


def gpt_run(corpus, run_dir, *overrides: str, cwd=None):
    return run_cli("launcher", *small_gpt(corpus), "data.batch_size=16", "trainer.max_steps=12", *overrides,
                   f"hydra.run.dir={run_dir}", cwd=cwd or run_dir.parent)


def test_flops_per_token_is_the_hand_count():
    model = GPT(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=8, tie_weights=True)
    # per block: qkv 8x24 + proj 8x8 + mlp 8x32 + 32x8 + 2 LayerNorm weights 8 = 192 + 64 + 512 + 16 = 784
    # multiplying: 2 x 784 + final norm 8 + the tied output matrix 256 x 8 = 3624 (position table excluded)
    assert model.flops_per_token() == 6 * 3624 + 12 * 2 * 8 * 16
    untied = GPT(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=8, tie_weights=False)
    assert untied.flops_per_token() == model.flops_per_token()  # the untied lookup table multiplies nothing


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    from train.build import checkpoint_blocks

    torch.manual_seed(0)
    plain = GPT(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16, dropout=0.1)
    recomputed = GPT(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16, dropout=0.1)
    recomputed.load_state_dict(plain.state_dict())
    checkpoint_blocks(recomputed)
    tokens = torch.randint(0, 64, (4, 17))
    losses, kept = [], []
    for model in (plain, recomputed):
        torch.manual_seed(1)  # the same dropout masks: the recomputation must draw them again identically
        with SavedActivations(model) as saved:
            loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss)
        kept.append(saved.bytes)
    assert kept[1] < kept[0] / 2  # the blocks' activations are recomputed, not kept
    assert abs(losses[0].item() - losses[1].item()) < 1e-6
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-6, msg=f"{name}: gradients differ")
    assert list(recomputed.state_dict()) == list(plain.state_dict())  # checkpoints keep their names


def test_token_windows_are_the_file_read_in_order(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) % 251
    tokens.tofile(tmp_path / "train.bin")
    windows = TokenWindows(str(tmp_path / "train.bin"), block_size=10)
    assert len(windows) == 99  # (1000 - 1) // 10: the last window needs one token beyond its 10
    inputs, targets = windows[7]
    assert inputs.tolist() == list(range(70, 80)) and targets.tolist() == list(range(71, 81))
    assert inputs.dtype == torch.int64


def test_gpt_ddp_matches_one_process_and_fsdp_checkpointing_and_compile_match_ddp(corpus, ddp_run, gpt_one_process,
                                                                                   tmp_path):
    runs = {
        "fsdp_ac": ["trainer.procs_per_node=2", "trainer.strategy=fsdp", "trainer.activation_checkpointing=true"],
        # each block compiled, 2 micro-batches of 8 per step: the same global batch of 32
        "fsdp_compiled": ["trainer.procs_per_node=2", "trainer.strategy=fsdp", "trainer.compile=true",
                          "trainer.accumulate=2", "data.batch_size=8"],
    }
    for name, overrides in runs.items():
        proc = gpt_run(corpus, tmp_path / name, *overrides)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-2000:]}"
    fsdp_ac, compiled = (final_checkpoint(tmp_path / n)["model"] for n in runs)
    one = final_checkpoint(gpt_one_process)["model"]
    # the same micro-batch of 16 per rank: ddp keeps every block's activations, checkpointing only the blocks' inputs
    [plain_memory], [checkpointed_memory] = ([r for r in read_metrics(run) if r["kind"] == "memory"]
                                             for run in (ddp_run[0], tmp_path / "fsdp_ac"))
    assert checkpointed_memory["rank0_activation_mb"] < plain_memory["rank0_activation_mb"] / 2  # logged, and less
    ddp = final_checkpoint(ddp_run[0])["model"]
    assert any(k.startswith("blocks.1.") for k in one)
    for name, expected in one.items():
        torch.testing.assert_close(ddp[name], expected, **TOLERANCE, msg=f"ddp 2 x 16: {name} differs from 1 x 32")
        torch.testing.assert_close(fsdp_ac[name], ddp[name], **TOLERANCE, msg=f"fsdp, checkpointing: {name} differs from ddp")
        torch.testing.assert_close(compiled[name], fsdp_ac[name], **TOLERANCE, msg=f"compiled blocks, accumulating: {name} differs")
    # each rank compiled in itself (its 1 thread), not in a pool of a process per core of the machine
    assert json.loads((tmp_path / "fsdp_compiled" / "plan.json").read_text())["compile_workers_per_process"] == 1


def test_a_two_stage_pipeline_of_the_gpt_reaches_one_process(corpus, gpt_pipeline_one_process, tmp_path):
    """GPTPipeline: embedding, 2 blocks, head as an nn.Sequential, cut into 2 stages of 2 children each; gradient
    accumulation (2 micro-steps of 2 microbatches) on the pipeline against one process's whole batch."""
    staged = gpt_run(corpus, tmp_path / "staged", *GPT_PIPELINE, "trainer.procs_per_node=2", "trainer.strategy=pipeline",
                     "data.batch_size=16", "trainer.accumulate=2", "trainer.microbatches=2")
    assert staged.returncode == 0, staged.stderr[-2000:]
    a, b = final_checkpoint(gpt_pipeline_one_process)["model"], final_checkpoint(tmp_path / "staged")["model"]
    assert a.keys() == b.keys() and "0.wte.weight" in a and "3.head.weight" in a  # the stages put together
    for name in a:
        torch.testing.assert_close(b[name], a[name], **TOLERANCE, msg=f"pipeline: {name} differs from one process")
    one_eval = [r for r in read_metrics(gpt_pipeline_one_process) if r["kind"] == "eval"][-1]  # step 12's
    [staged_eval] = [r for r in read_metrics(tmp_path / "staged") if r["kind"] == "eval"]
    assert staged_eval["step"] == one_eval["step"] == 12
    assert staged_eval["loss"] == pytest.approx(one_eval["loss"], rel=1e-5)  # scored by the last stage


def test_the_gpt_learns_in_bf16_under_fsdp_with_accumulation(corpus, tmp_path):
    """bf16 autocast, parameters gathered in bf16 and gradients reduced in float32, 2 micro-steps per step."""
    proc = gpt_run(corpus, tmp_path / "run", "trainer.procs_per_node=2", "trainer.strategy=fsdp", "trainer.precision=bf16",
                   "data.batch_size=8", "trainer.accumulate=2", "trainer.max_steps=24")
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 0.5  # from ~5.5 (uniform over bytes)
    weights = final_checkpoint(tmp_path / "run")["model"]
    assert all(w.dtype == torch.float32 for w in weights.values())  # the checkpoint keeps float32 masters


def test_tokens_per_second_and_mfu_are_logged_from_the_flop_count(ddp_run):
    run_dir, proc = ddp_run
    flops = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32).flops_per_token()
    records = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert records
    for r in records:
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 32, rel=1e-9)  # 32 tokens per window
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / 2, rel=1e-9)
        assert r["mfu"] == pytest.approx(r["tokens_per_s_per_device"] * flops / 0.5e12, rel=1e-9)
    assert "tokens/s" in proc.stdout and "MFU" in proc.stdout
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "eval"] == [8, 12]  # eval_every_steps, and the end


def test_gpt_resume_is_bitwise_and_at_another_world_size_reads_the_same_windows(corpus, ddp_run, tmp_path):
    """8.4k windows / 32 per step: 263 steps per epoch, so every stop here is mid-epoch."""
    first = gpt_run(corpus, tmp_path / "split", "trainer.procs_per_node=2", "trainer.max_steps=6")
    shutil.copytree(tmp_path / "split", tmp_path / "resized")  # the same 6 steps, resumed at another world size below
    resumed = gpt_run(corpus, tmp_path / "split", "trainer.procs_per_node=2", "trainer.peak_tflops=0.5",
                      "trainer.eval_every_steps=8")
    assert first.returncode == resumed.returncode == 0 and "resumed at step 6" in resumed.stdout
    a, b = final_checkpoint(ddp_run[0])["model"], final_checkpoint(tmp_path / "split")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a), "resume is not bitwise"
    # 6 steps on 2 processes x 16, then 1 process x 32 to step 12: the same windows as 2 x 16 throughout, so the same
    # weights up to the order of floating-point sums.
    resized = gpt_run(corpus, tmp_path / "resized", "trainer.procs_per_node=1", "data.batch_size=32")
    assert resized.returncode == 0 and "resumed at step 6" in resized.stdout
    c = final_checkpoint(tmp_path / "resized")["model"]
    for name in a:
        torch.testing.assert_close(c[name], a[name], **TOLERANCE, msg=f"{name}: other windows after resizing?")


def test_perplexity_at_world_size_3_equals_one_process(corpus, tmp_path):
    """The validation windows split unevenly over 3 ranks (an unpadded share each); lr ~0: the initial model in both
    runs."""
    results = {}
    for world in (1, 3):
        run_dir = tmp_path / f"world{world}"
        proc = gpt_run(corpus, run_dir, f"trainer.procs_per_node={world}", "data.batch_size=8", "trainer.max_steps=1",
                       "optim.lr=1e-12", "data.eval_batch_size=64")
        assert proc.returncode == 0
        [results[world]] = [r for r in read_metrics(run_dir) if r["kind"] == "eval"]
    assert results[3]["perplexity"] == pytest.approx(results[1]["perplexity"], rel=1e-6)
    assert results[1]["perplexity"] == pytest.approx(math.exp(results[1]["loss"]), rel=1e-9)


def test_the_tiny_preset_learns_the_python_sources_below_their_unigram_entropy(tmp_path):
    """A short run of `+experiment=gpt_tiny` from a fresh directory: the launcher tokenizes the standard library
    itself; 40 steps already bring the validation loss (2.78 nats a byte here) far below what byte frequencies alone
    give (3.39). Each evaluation scores the preset's 1,024 windows spread over the ~2,400 (data.max_eval_samples)."""
    proc = run_cli("launcher", *FAST, "+experiment=gpt_tiny", f"data.root={tmp_path / 'stdlib'}", "trainer.max_steps=40",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "each evaluation scores 1,024 samples spread over data.eval (data.max_eval_samples)" in proc.stdout
    val = np.fromfile(tmp_path / "stdlib" / "val.bin", dtype=np.uint16)
    frequencies = np.bincount(val, minlength=256) / len(val)
    unigram = -(frequencies[frequencies > 0] * np.log(frequencies[frequencies > 0])).sum()  # nats per byte
    [evaluation] = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "eval"]
    assert unigram > 3.0 and evaluation["loss"] < unigram - 0.4


def test_prepare_text_writes_the_files_the_preset_reads(tmp_path):
    text = tmp_path / "a.txt"
    text.write_bytes(bytes(range(256)) * 40)
    proc = run_cli("train.data.prepare_text", str(text), str(tmp_path / "out"), "--val-fraction", "0.25", cwd=REPO)
    assert proc.returncode == 0 and "7,680 training and 2,560 validation tokens" in proc.stdout
    train = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16)
    assert train[:256].tolist() == list(range(256))  # each byte is its own token


def test_a_vocabulary_smaller_than_the_data_is_refused_before_start_naming_it(corpus, tmp_path):
    """Byte tokens (ids up to 255) into a GPT with 100 embeddings: named as a vocabulary, not as an input size."""
    proc = run_cli("launcher", *FAST, "+experiment=gpt_tiny", "data=tokens", f"data.root={corpus}", *SMALL_GPT,
                   "model.vocab_size=100", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2 and "plan:" not in proc.stdout
    assert "IndexError: index out of range in self. An embedding was given an id beyond its table (the batch holds " \
           "ids up to" in proc.stderr and "make the model's vocabulary (e.g. model.vocab_size) larger" in proc.stderr
