"""The default job end to end through the real CLI: 2 gloo processes, checkpoints, TensorBoard, accuracy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from conftest import FAST, REPO, read_metrics
from train.config import load_config
from train.build import build_model


def test_default_job_trains_to_90_percent_with_checkpoints_and_tensorboard(launch, tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(f"hydra.run.dir={run_dir}", "trainer.progress=lines")
    assert proc.returncode == 0

    # One summary, printed by the launcher before the workers start.
    assert proc.stdout.count("run dir") == 1 and "backend gloo" in proc.stdout
    assert "= global batch 128" in proc.stdout
    assert "2 processes = 1 node(s) x 2" in proc.stdout

    # The resolved snapshot, with an absolute data root, readable by the worker schema.
    snapshot = load_config(run_dir / "config.yaml")
    assert snapshot.trainer.procs_per_node == 2 and snapshot.data.root.startswith("/")

    records = read_metrics(run_dir)
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(evals) == 15  # one per epoch
    assert evals[-1]["acc"] >= 0.90

    # Checkpoints: the unwrapped model's plain state_dict, loadable weights-only, plus everything to resume.
    ckpt_dir = run_dir / "checkpoints"
    steps = sorted(ckpt_dir.glob("step_*.pt"))
    assert len(steps) == 3  # keep_last
    final = torch.load(steps[-1], weights_only=True)
    assert final["step"] == 165 and final["world_size"] == 2 and final["global_batch"] == 128
    assert not any(k.startswith("module.") for k in final["model"])
    assert len(final["rng"]) == 2 and not torch.equal(final["rng"][0]["torch"], final["rng"][1]["torch"])
    model = build_model(snapshot)  # from the snapshot's model node, as a user would for inference
    model.load_state_dict(final["model"])  # strict: every key matches the unwrapped model

    best = torch.load(ckpt_dir / "best.pt", weights_only=True)
    assert best["best_metric"] == max(e["acc"] for e in evals)  # the task's main metric: accuracy, higher is better

    # TensorBoard scalars read back agree with metrics.jsonl.
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/samples_per_s", "train/step_time_s", "train/data_time_s", "eval/loss", "eval/acc"):
        assert tag in tags
    # Curves are what a person reads as one, loss and accuracy first; constants and tables are text.
    assert sorted(tags)[:2] == ["eval/acc", "eval/loss"]
    assert not [t for t in tags if t.startswith(("checkpoint/", "memory/")) or t.endswith(("/epoch", "/restarts", "_rank"))]
    assert {"plan/text_summary", "memory/text_summary"} <= set(events.Tags()["tensors"])
    tb_acc = [(e.step, e.value) for e in events.Scalars("eval/acc")]
    assert [s for s, _ in tb_acc] == [e["step"] for e in evals]
    assert abs(tb_acc[-1][1] - evals[-1]["acc"]) < 1e-6
    train_steps = [e.step for e in events.Scalars("train/loss")]
    assert train_steps == list(range(10, 166, 10))
    lrs = [e.value for e in events.Scalars("train/lr")]
    assert lrs[-1] < lrs[1]  # the cosine schedule decays
    assert all(e.value > 0 for e in events.Scalars("train/samples_per_s"))

    # Hyper-parameters (the HPARAMS view), with the derived global batch and lr among them.
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["plan.global_batch"].number_value == 128 and hparams["plan.lr"].number_value == 0.1
    assert hparams["model._target_"].string_value == "train.models.vision.cnn"

    # Re-running the same command finds the run finished: nothing started, nothing rewritten.
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
    again = launch(f"hydra.run.dir={run_dir}", "trainer.progress=lines")
    assert again.returncode == 0
    assert "already finished with this config" in again.stdout
    assert read_metrics(run_dir) == records


def test_two_runs_at_once_do_not_clash_on_ports(tmp_path):
    """Run "a" also profiles steps 10-11: a trace per rank, and the metrics say which records they fall in."""
    common = [*FAST, "data=synthetic", "model=mlp", "model.hidden=[32]", "trainer.epochs=1", "trainer.log_every=8",
              "trainer.procs_per_node=2"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "launcher", *common, *extra, f"hydra.run.dir={tmp_path / name}"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for name, extra in (("a", ["trainer.profile=[10,11]"]), ("b", []))
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for proc, out in zip(procs, outputs):
        print(out)
        assert proc.returncode == 0
    for name in ("a", "b"):
        assert list((tmp_path / name / "checkpoints").glob("step_*.pt"))

    for rank in (0, 1):
        events = json.loads((tmp_path / "a" / "profile" / f"rank{rank}.pt.trace.json").read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        assert {"train step 10", "train step 11"} <= names and "train step 12" not in names
        assert "aten::addmm" in names  # the model's own work, with its shapes
    assert "steps 10-11 profiled: " in outputs[0]
    marked = [r["step"] for r in read_metrics(tmp_path / "a") if r["kind"] == "train" and r.get("profiled")]
    assert marked == [16]  # the record of steps 9-16
    assert not (tmp_path / "b" / "profile").exists()


def test_bf16_autocast_trains_on_cpu(launch, tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(*FAST, "data=synthetic", "model=mlp", "trainer.precision=bf16", "trainer.epochs=2",
                  f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0 and "precision bf16" in proc.stdout
    evals = [r for r in read_metrics(run_dir) if r["kind"] == "eval"]
    assert evals[-1]["acc"] > 0.5  # well above the 10% of chance
    final = torch.load(sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1], weights_only=True)
    assert all(t.dtype == torch.float32 for t in final["model"].values())  # autocast leaves the weights in fp32


def test_a_file_user_code_leaves_open_in_a_reference_cycle_is_still_written_at_exit(tmp_path):
    """Workers freeze what their imports made out of the garbage collector (a faster exit); what is made after
    that (a user's objects) must still be collected at exit, finalizers included: here a file is flushed."""
    out = tmp_path / "written.txt"
    code = (
        "import gc\n"
        "from train.host import freeze_imported_objects\n"
        "freeze_imported_objects()\n"
        "assert gc.get_freeze_count() > 100_000, gc.get_freeze_count()  # torch's objects are out of sight\n"
        "class Holder: pass\n"
        f"holder = Holder(); holder.me = holder; holder.file = open({str(out)!r}, 'w'); holder.file.write('all of it')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == "all of it"


KEPT_MEMORY = """
import resource, sys
import torch
from train.host import keep_freed_memory

torch.set_num_threads(1)  # one thread touches the pages: intra-op threads' first touches only add noise

kept = keep_freed_memory() if sys.argv[1] == "keep" else False
pages = 40 * (4 << 20) // resource.getpagesize()

def step():  # a step's activations: 40 blocks of 4 MB, written, then freed
    blocks = [torch.ones(1 << 20) for _ in range(40)]
    del blocks

step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(kept, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5 / pages)
"""


def test_a_worker_keeps_the_memory_a_step_frees_for_the_next_step():
    """Workers call keep_freed_memory(): the blocks a step frees are reused by the next one, not given back to the
    kernel and faulted in again (page faults: the share of the step's pages)."""
    def faults(mode: str, **env: str) -> tuple[str, float]:
        proc = subprocess.run([sys.executable, "-c", KEPT_MEMORY, mode], capture_output=True, text=True, cwd=REPO,
                              env={**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, **env})
        assert proc.returncode == 0, proc.stderr
        kept, share = proc.stdout.split()
        return kept, float(share)

    kept, share = faults("keep")
    default = faults("default")[1]
    # Kept: 1-4% of the step's pages faulted in again (Python's own allocations); given back: 40% here.
    assert kept == "True" and share < 0.1 and share < default / 4, (share, default)
    # a user's own malloc tuning is left alone
    assert faults("keep", MALLOC_ARENA_MAX="2")[0] == "False"
