"""Research code as its authors wrote it, trained with nothing but YAML: nanoGPT's model.py (kept verbatim in
tests/foreign/nanogpt with its license), whose forward computes its own loss (task=model_loss)."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from conftest import FAST, REPO, final_checkpoint, read_metrics, run_cli

NANOGPT = REPO / "tests" / "foreign" / "nanogpt"
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def nanogpt_run(corpus, run_dir, *overrides: str):
    """Launched from nanoGPT's own directory (its model.py is imported from there), config beside it."""
    base = ["--config-dir", "conf", "+experiment=nanogpt", *FAST, f"data.root={corpus}", "data.batch_size=16",
            "trainer.eval_every=0", "trainer.log_every=4", "trainer.max_steps=12", "trainer.procs_per_node=2"]
    return run_cli("launcher", *base, *overrides, f"hydra.run.dir={run_dir}", cwd=NANOGPT)


@pytest.fixture(scope="module")
def ddp_run(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("nanogpt") / "ddp"
    proc = nanogpt_run(corpus, run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def nanogpt_module():
    spec = importlib.util.spec_from_file_location("nanogpt_model", NANOGPT / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nanogpt_is_kept_verbatim_with_its_license():
    assert "MIT License" in (NANOGPT / "LICENSE").read_text() and "Andrej Karpathy" in (NANOGPT / "LICENSE").read_text()
    assert "return logits, loss" in (NANOGPT / "model.py").read_text()  # its own forward, not adapted


def test_nanogpt_under_ddp_matches_one_process_and_fsdp_matches_ddp(corpus, ddp_run, tmp_path):
    runs = {"one": ["trainer.procs_per_node=1", "data.batch_size=32"], "fsdp": ["trainer.strategy=fsdp"]}
    for name, overrides in runs.items():
        proc = nanogpt_run(corpus, tmp_path / name, *overrides)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
    one, fsdp = (final_checkpoint(tmp_path / n)["model"] for n in runs)
    ddp = final_checkpoint(ddp_run)["model"]
    assert "transformer.h.1.attn.c_attn.weight" in ddp  # nanoGPT's own keys: no wrapper's prefix
    for name, expected in one.items():
        torch.testing.assert_close(ddp[name], expected, **TOLERANCE, msg=f"ddp 2 x 16: {name} differs from 1 x 32")
        torch.testing.assert_close(fsdp[name], ddp[name], **TOLERANCE, msg=f"fsdp: {name} differs from ddp")


def test_nanogpt_resumes_bitwise_and_its_export_loads_into_its_own_class(corpus, ddp_run, tmp_path):
    run_dir = tmp_path / "split"
    first = nanogpt_run(corpus, run_dir, "trainer.max_steps=6")
    resumed = nanogpt_run(corpus, run_dir)
    assert first.returncode == resumed.returncode == 0 and "resumed at step 6" in resumed.stdout
    a, b = final_checkpoint(ddp_run)["model"], final_checkpoint(run_dir)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a), "resume is not bitwise"
    evaluation = [r for r in read_metrics(run_dir) if r["kind"] == "eval"][-1]
    assert evaluation["perplexity"] == pytest.approx(torch.tensor(evaluation["loss"]).exp().item(), rel=1e-6)

    out = tmp_path / "nanogpt.pt"
    export = run_cli("launcher.export", str(run_dir), "--out", str(out), cwd=NANOGPT)
    assert export.returncode == 0, export.stderr
    nanogpt = nanogpt_module()
    model = nanogpt.GPT(nanogpt.GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=32, bias=True))
    model.load_state_dict(torch.load(out, weights_only=True))  # strict, unchanged
    assert torch.equal(model.transformer.h[0].mlp.c_fc.weight, b["transformer.h.0.mlp.c_fc.weight"])
    assert os.path.getsize(out) > 0


# pytorch/examples' mnist/main.py `Net`, as its authors wrote it (its file imports torchvision at the top, so the
# class is copied here rather than imported): a fixed 9216-wide layer, for 28x28 inputs only.
MNIST_NET = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output
'''


def test_a_model_that_does_not_fit_the_data_is_refused_before_start_naming_the_shape_keys(tmp_path):
    project = tmp_path / "project"
    (project / "conf" / "experiment").mkdir(parents=True)
    (project / "net.py").write_text(MNIST_NET)
    (project / "conf" / "experiment" / "mnist_net.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: null\nname: mnist_net\nmodel:\n  _target_: net.Net\n")
    run = ["--config-dir", "conf", "+experiment=mnist_net", *FAST, "trainer.max_steps=2"]
    refused = run_cli("launcher", *run, f"hydra.run.dir={tmp_path / 'at16'}", cwd=project)  # the digits at 16x16
    assert refused.returncode == 2
    assert "model._target_=net.Net does not fit the data: on a batch of (float32[64, 1, 16, 16], int64[64])" in refused.stderr
    assert "data.image_size=16" in refused.stderr and "(64x2304 and 9216x128)" in refused.stderr  # run on the CPU: small
    assert "plan:" not in refused.stdout and "Traceback" not in refused.stderr  # no worker started
    fitted = run_cli("launcher", *run, "data.image_size=28", f"hydra.run.dir={tmp_path / 'at28'}", cwd=project)
    assert fitted.returncode == 0, fitted.stderr  # the fix the message points at
    assert final_checkpoint(tmp_path / "at28")["step"] == 2


# --- Hugging Face causal language models, built from small configs (nothing downloaded) ------------------------

HF = REPO / "tests" / "foreign" / "huggingface"


def hf_run(corpus, run_dir, experiment: str, *overrides: str, world: int = 2):
    base = ["--config-dir", "conf", f"+experiment={experiment}", *FAST, f"data.root={corpus}", "data.batch_size=16",
            "trainer.eval_every=0", "trainer.log_every=4", "trainer.max_steps=8", f"trainer.procs_per_node={world}"]
    return run_cli("launcher", *base, *overrides, f"hydra.run.dir={run_dir}", cwd=HF)


def test_a_hugging_face_lm_under_fsdp_with_meta_init_and_checkpointing_and_under_tp_equals_ddp(corpus, tmp_path):
    """Llama: tied embeddings, grouped-query attention, a rotary table computed at construction (GPT-2's meta build
    is checked against its full build in tests/test_meta_init.py); and tensor parallel with its own plan."""
    experiment = "hf_llama"
    runs = {"ddp": [], "fsdp": ["trainer.strategy=fsdp", "trainer.activation_checkpointing=true"],
            # split 2 ways by Hugging Face's own plan (config.base_model_tp_plan): one replica of the global batch
            "tp": ["trainer.strategy=fsdp", "trainer.tp=2", "data.batch_size=32"]}
    for name, overrides in runs.items():
        proc = hf_run(corpus, tmp_path / name, experiment, *overrides)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        if name == "fsdp":  # built on the meta device, tied embeddings included: no full build on every rank
            assert "the model was built on the meta device" in proc.stderr and "building the whole model" not in proc.stderr
    ddp, fsdp, tp = (final_checkpoint(tmp_path / n)["model"] for n in runs)
    assert "lm_head.weight" in ddp
    for name, expected in ddp.items():
        torch.testing.assert_close(fsdp[name], expected, **TOLERANCE, msg=f"fsdp + checkpointing: {name} differs from ddp")
        torch.testing.assert_close(tp[name], expected, **TOLERANCE, msg=f"tp=2: {name} differs from ddp")
    [memory] = [r for r in read_metrics(tmp_path / "fsdp") if r["kind"] == "memory"]
    assert memory["rank0_activation_mb"] > 0


def test_hugging_face_perplexity_at_world_size_3_equals_one_process(corpus, tmp_path):
    """{input_ids, labels} windows over 3 ranks (an unpadded share each), lr ~0: the same model evaluated."""
    results = {}
    for world in (1, 3):
        proc = hf_run(corpus, tmp_path / f"world{world}", "hf_gpt2", "trainer.max_steps=1", "optim.lr=1e-12",
                      "data.batch_size=8", "data.eval_batch_size=64", world=world)
        assert proc.returncode == 0, proc.stderr[-3000:]
        [results[world]] = [r for r in read_metrics(tmp_path / f"world{world}") if r["kind"] == "eval"]
    assert results[3]["perplexity"] == pytest.approx(results[1]["perplexity"], rel=1e-6)
    assert results[1]["perplexity"] == pytest.approx(math.exp(results[1]["loss"]), rel=1e-9)


def test_a_hugging_face_lm_starts_from_a_save_pretrained_directory_and_from_an_export(corpus, tmp_path):
    import transformers  # the test extra installs it: never skipped
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0)
    torch.manual_seed(7)
    pretrained = transformers.GPT2LMHeadModel(config)
    pretrained.save_pretrained(tmp_path / "pretrained")
    weights = {k: v.clone() for k, v in pretrained.state_dict().items()}
    frozen = ["trainer.max_steps=1", "optim.lr=1e-12", "trainer.procs_per_node=1", "data.batch_size=8"]

    loaded = hf_run(corpus, tmp_path / "from_dir", "hf_gpt2", *frozen, "~model.config",
                    "model._target_=transformers.GPT2LMHeadModel.from_pretrained",
                    f"+model.pretrained_model_name_or_path={tmp_path / 'pretrained'}", "data.train.block_size=32",
                    "data.eval.block_size=32")
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    trained = final_checkpoint(tmp_path / "from_dir")["model"]
    for name, value in weights.items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-9, msg=f"{name}: not the saved weights")

    torch.save(weights, tmp_path / "export.pt")  # what python -m launcher.export writes: a plain state dict
    started = hf_run(corpus, tmp_path / "from_export", "hf_gpt2", *frozen, f"checkpoint.init_from={tmp_path / 'export.pt'}")
    assert started.returncode == 0, started.stderr[-3000:]
    trained = final_checkpoint(tmp_path / "from_export")["model"]
    assert all(torch.allclose(trained[k], v, rtol=0, atol=1e-9) for k, v in weights.items())

    wider = hf_run(corpus, tmp_path / "wider", "hf_gpt2", *frozen, "model.config.n_embd=64",
                   f"checkpoint.init_from={tmp_path / 'export.pt'}")
    assert wider.returncode == 2 and "plan:" not in wider.stdout  # refused before start, with the keys
    assert f"checkpoint.init_from={tmp_path / 'export.pt'} does not fit model._target_=transformers.GPT2LMHeadModel" \
        in wider.stderr and "size mismatch for transformer.wte.weight" in wider.stderr


# --- A Hugging Face encoder classifier: padded dict batches with attention masks, YAML only -----------------------

def bert_run(run_dir, *overrides: str):
    base = ["--config-dir", "conf", "+experiment=hf_bert_classifier", *FAST, "trainer.procs_per_node=2",
            "trainer.epochs=2", "trainer.log_every=7"]
    return run_cli("launcher", *base, *overrides, f"hydra.run.dir={run_dir}", cwd=HF)


def test_a_hugging_face_classifier_trains_with_yaml_only_and_its_hf_export_loads_with_the_same_accuracy(two_process_ddp,
                                                                                                         tmp_path):
    """BertForSequenceClassification on lines of Python's sources (comment / def / other), padded per batch by the
    user's collate function: task=classification reads the output's logits and the batch's labels; task=model_loss
    with accuracy=true trains on the model's own loss, here under fsdp (sharded checkpoints), to the same weights.
    best.pt (best/ for the sharded run) is chosen by accuracy, exported with --hf and loaded by from_pretrained,
    which scores the held-out lines as the run did."""
    import sys

    import transformers

    runs = {"classification": [], "model_loss": ["task=model_loss", "+task.accuracy=true", "trainer.strategy=fsdp"]}
    for name, overrides in runs.items():
        proc = bert_run(tmp_path / name, *overrides)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        assert "best acc" in proc.stdout and "best" in proc.stdout.splitlines()[-1]  # the summary line
    assert (tmp_path / "model_loss" / "checkpoints" / "best").is_dir()  # a sharded step directory
    evaluations = {n: [r for r in read_metrics(tmp_path / n) if r["kind"] == "eval"] for n in runs}
    assert len(evaluations["classification"]) == 2 and evaluations["classification"][-1]["acc"] > 0.8
    for a, b in zip(evaluations["classification"], evaluations["model_loss"]):
        assert b["acc"] == pytest.approx(a["acc"], abs=1e-9) and b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    one, other = (final_checkpoint(tmp_path / n)["model"] for n in runs)
    for key, value in one.items():
        if key.endswith("attention.self.key.bias"):
            continue  # its gradient is zero in exact arithmetic (softmax ignores it): Adam steps on rounding noise
        torch.testing.assert_close(other[key], value, **TOLERANCE, msg=f"model_loss under fsdp: {key} differs")

    sys.path.insert(0, str(HF))
    try:
        from text_data import LineKinds, pad_batch
    finally:
        sys.path.remove(str(HF))
    held_out = LineKinds(split="eval")
    for name in runs:
        best = max(evaluations[name], key=lambda r: r["acc"])
        export = run_cli("launcher.export", str(tmp_path / name), "--best", "--hf", str(tmp_path / f"hf-{name}"), cwd=HF)
        assert export.returncode == 0, export.stderr
        assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / f"hf-{name}").iterdir()}
        model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / f"hf-{name}").eval()
        correct = 0
        with torch.no_grad():
            for start in range(0, len(held_out), 64):
                batch = pad_batch([held_out[i] for i in range(start, min(start + 64, len(held_out)))])
                labels = batch.pop("labels")
                correct += (model(**batch).logits.argmax(-1) == labels).sum().item()
        assert correct / len(held_out) == pytest.approx(best["acc"], abs=1e-9), f"{name}: another accuracy"

    # A model of our own (the session's reference MLP run, read-only) has no Hugging Face form to export to.
    plain = run_cli("launcher.export", str(two_process_ddp), "--hf", str(tmp_path / "y"), cwd=tmp_path)
    assert plain.returncode == 2 and "has no save_pretrained: use --out model.pt" in plain.stderr
    assert not (tmp_path / "y").exists()
