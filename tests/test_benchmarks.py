"""Smoke runs of the benchmark scripts, so they keep working: tiny sizes, figures checked for consistency only
(the figures themselves are benchmarks/README.md's business, never asserted). One process where the script's
figures do not depend on the world (each rank is an interpreter that imports torch: the suite's CPU)."""

from __future__ import annotations

import csv
import json
import re
import os
import statistics
import sys
from pathlib import Path

from conftest import FAST, REPO, read_metrics, run_cli


def test_overhead_benchmark_runs_both_loops_and_reports_their_ratio(tmp_path):
    out = tmp_path / "overhead.json"
    proc = run_cli("benchmarks.overhead", "--smoke", "--procs", "1", "--regime", "mlp", "--out", str(out), cwd=REPO, timeout=600)
    assert proc.returncode == 0
    report = json.loads(out.read_text())
    mlp = report["regimes"]["mlp"]
    for variant in ("ours", "raw"):
        assert len(mlp[variant]["samples_per_s"]) == 1 and mlp[variant]["samples_per_s"][0] > 0
        assert mlp[variant]["startup_s"][0] > 0
    assert mlp["ratio"] == mlp["median_samples_per_s"]["ours"] / mlp["median_samples_per_s"]["raw"]
    assert f"{mlp['ratio']:.3f}" in proc.stdout  # the printed table shows the same figure


def test_startup_benchmark_times_the_launch_against_torchrun_on_the_same_snapshot():
    proc = run_cli("benchmarks.startup", "--procs", "1", "--reps", "1", "--max-steps", "2", cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    walls = re.findall(r"^(ours|torchrun) +wall ([0-9.]+) s, CPU ([0-9.]+) s$", proc.stdout, re.M)
    assert sorted(w[0] for w in walls) == ["ours", "torchrun"] and all(float(w[1]) > 0 for w in walls)
    assert "ours - torchrun:" in proc.stdout


def test_scaling_report_sweeps_the_world_size_and_plots_it(tmp_path):
    sweep = tmp_path / "scaling"
    overrides = [*FAST, "model=mlp", "model.hidden=[32]", "data=synthetic", "data.num_samples=512",
                 "data.batch_size=16", "trainer.epochs=1", "trainer.log_every=4"]
    proc = run_cli("benchmarks.scaling", "--sizes", "1,2", "--out", str(sweep), *overrides, cwd=REPO, timeout=600)
    assert proc.returncode == 0
    rows = list(csv.DictReader((sweep / "scaling.csv").open()))
    assert [int(r["world_size"]) for r in rows] == [1, 2]
    assert [int(r["global_batch"]) for r in rows] == [16, 32]  # the per-process batch is fixed
    assert float(rows[0]["speedup"]) == 1.0 and float(rows[0]["efficiency"]) == 1.0
    assert abs(float(rows[1]["efficiency"]) - float(rows[1]["speedup"]) / 2) < 1e-9
    for row in rows:  # the table's figures are those of the points' own metrics
        records = read_metrics(sweep / row["point"])
        train = [r["samples_per_s"] for r in records if r["kind"] == "train"]
        assert abs(float(row["samples_per_s"]) - statistics.median(train[1:])) < 1e-6 * float(row["samples_per_s"])
        assert float(row["final_acc"]) == [r for r in records if r["kind"] == "eval"][-1]["acc"]

    import matplotlib.image

    png = sweep / "scaling.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(png).shape
    assert (width, height) == (1000, 750)  # the 2 x 2 panels at 100 dpi


def test_data_path_benchmark_measures_each_path_from_its_own_metrics(tmp_path):
    out = tmp_path / "data.json"
    proc = run_cli("benchmarks.data_paths", "--smoke", "--procs", "1", "--workers", "0,2", "--out", str(out), cwd=REPO, timeout=600)
    assert proc.returncode == 0
    report = json.loads(out.read_text())
    assert set(report["image_folder"]) == {"0", "2"}
    for figures in [*report["memory"], *report["loader"], *report["image_folder"].values()]:
        assert figures["samples_per_s"] > 0 and 0 <= figures["data_wait_share"] <= 1
    assert report["median_loader"]["samples_per_s"] == report["loader"][0]["samples_per_s"]  # one repetition
    assert f"{report['median_memory']['samples_per_s']:9.1f}" in proc.stdout  # the printed table shows the figures


def test_gpt_benchmark_runs_both_loops_and_plots_a_loss_curve(tmp_path):
    out = tmp_path / "gpt.json"
    proc = run_cli("benchmarks.gpt_tokens", "--smoke", "--procs", "1", "--out", str(out), cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["ours"][0] > 0 and report["raw"][0] > 0
    assert report["ratio"] == report["median"]["ours"] / report["median"]["raw"]
    assert f"ratio {report['ratio']:.3f}" in proc.stdout
    run = tmp_path / "run"  # a finished run's losses, plotted
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"kind": "train", "step": 10, "loss": 3.0, "time": 1.0}, {"kind": "train", "step": 20, "loss": 2.5, "time": 2.0},
        {"kind": "eval", "step": 20, "loss": 2.6, "time": 2.5}]))
    png = tmp_path / "curve.png"
    plotted = run_cli("benchmarks.gpt_tokens", "--curve", str(run), "--png", str(png), cwd=REPO, timeout=120)
    assert plotted.returncode == 0 and "validation loss 2.600" in plotted.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gloo_group_benchmark_compares_idle_groups_and_counts_their_event_loops(tmp_path):
    out = tmp_path / "groups.json"
    proc = run_cli("benchmarks.gloo_groups", "--smoke", "--groups", "0,2", "--out", str(out), cwd=REPO, timeout=300)
    assert proc.returncode == 0
    report = json.loads(out.read_text())
    # what the trainer's choice of groups rests on: every gloo group brings one event-loop thread per process
    assert [r["event_loops"] for r in report["runs"]["0"]] == [1]
    assert [r["event_loops"] for r in report["runs"]["2"]] == [3]
    assert report["median_seconds"]["2"] == report["runs"]["2"][0]["seconds"] > 0


def test_checkpoint_scale_benchmark_measures_commit_resume_and_staging(tmp_path):
    out = tmp_path / "scale.json"
    proc = run_cli("benchmarks.checkpoint_scale", "--smoke", "--sizes", "1,2", "--out", str(out), cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    one, two = report["commit"]["1"], report["commit"]["2"]
    assert two["rank0_hashed_mb"] < 0.75 * two["old_rank0_hashed_mb"]  # rank 0 hashes its share, not every file
    assert one["rank0_hashed_mb"] > 0.99 * one["old_rank0_hashed_mb"]
    assert [len(report["resume"][n]) for n in ("1", "2")] == [1, 2]  # every process's figures
    assert len(report["staging"]["reused_s"]) == len(report["staging"]["fresh_s"]) == 2


def test_object_store_benchmark_measures_transfers_step_times_and_what_each_rank_sends(tmp_path):
    proc = run_cli("benchmarks.object_store", "--mb", "4", "--shard-total-mb", "8", "--worlds", "8", "--steps", "30",
                   cwd=REPO,
                   timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "upload" in proc.stdout and "MB/s" in proc.stdout
    assert proc.stdout.count("ms during one") == 2  # to S3 and to file://
    # a step directory of 8 MB over 8 ranks: each rank uploads its own 1 MB shard; rank 0 adds the small files
    assert "world   8 rank   7:     1.00 MB in 1 objects" in proc.stdout
    assert "world   8 rank   0:     1.00 MB in 4 objects" in proc.stdout


def test_gpu_check_without_a_gpu_says_to_run_its_cpu_checks(tmp_path):
    """The script a lent GPU runs (a check of it runs under the prepared command's test below)."""
    refused = run_cli("benchmarks.gpu_check", cwd=REPO)  # no GPU here: it says so instead of failing every check
    assert refused.returncode == 2 and "no CUDA GPU here: run with --cpu" in refused.stderr


def test_layout_benchmark_reports_memory_per_rank_and_tokens_per_second(tmp_path):
    out = tmp_path / "layouts.json"
    proc = run_cli("benchmarks.layouts", "--smoke", "--out", str(out), cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())["layouts"]
    assert set(report) == {"fsdp 2", "tp 2"}
    for figures in report.values():
        assert len(figures["param_mb"]) == 2 and figures["median_tokens_per_s"] > 0
    assert f"{report['tp 2']['median_tokens_per_s']:9.0f} tokens/s" in proc.stdout


def test_the_scale_rehearsal_in_small_meets_its_targets(tmp_path):
    """Rank 0 and the last rank of 8 and 64 ranks (fake process group), a 2-layer GPT: what the last rank does at
    save and resume does not grow with the world (metadata operations, bytes received), a model build that
    computes longer than the hang limit is no hang, and a stop is agreed within stop_check_s plus two steps."""
    out = tmp_path / "rehearsal.json"
    proc = run_cli("benchmarks.scale_rehearsal", "--worlds", "8", "64", "--small", "--n-embd", "64", "--fs-ms", "0",
                   "--read-mb-s", "0", "--build-s", "2", "--hang-s", "1", "--step-s", "0.5", "--stop-check-s", "0.2",
                   "--out", str(out), cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]  # no rank exited 70 in its 2 s model build
    results = {(r["world"], r["rank"]): r for r in json.loads(out.read_text())["results"]}
    last = {world: results[(world, world - 1)]["phases"] for world in (8, 64)}
    for phases in last.values():  # where the background write's operations fall, stall or write, is a race: as one
        stall, write = phases.pop("async save stall"), phases["async save write"]
        write["fs_ops"] = {op: stall["fs_ops"].get(op, 0) + write["fs_ops"].get(op, 0)
                           for op in stall["fs_ops"].keys() | write["fs_ops"].keys()}
        write["received_bytes"] += stall["received_bytes"]
    for phase in ("save", "async save write", "stop", "resume"):
        assert last[8][phase]["fs_ops"] == last[64][phase]["fs_ops"], phase
        assert last[64][phase]["received_bytes"] <= 1.1 * last[8][phase]["received_bytes"] + 1024, phase
    for result in results.values():
        assert result["resumed_step"] > 0  # the resume found and loaded the stop's checkpoint
        assert result["stop_agreed_s"] <= 0.2 + 2 * 0.5 + 0.5  # stop_check_s, two steps, the save's own slack
    assert "stop agreed after" in proc.stdout


def test_the_prepared_gpu_command_installs_its_wheels_apart_and_leaves_its_table_and_log_under_out(tmp_path):
    """benchmarks/gpu_run.sh as the lent machine runs it, from a copy of the checkout: the wheels that machine lacks
    are fetched here (--fetch), installed into a folder of their own (never `pip install -e .`), imported from there,
    and the checks' table and log are written under $OUT. (Rehearsed whole in a venv with torch only: the closing
    note of issue 44 and benchmarks/README.md.)"""
    import shutil
    import subprocess

    copy = tmp_path / "checkout"
    top = {".venv", ".git", ".whl", "runs", "outputs", "multirun", "data"}  # what a checkout's copy there lacks

    def ignored(folder: str, names: list[str]) -> set[str]:
        here = {n for n in names if n == "__pycache__" or n.endswith(".egg-info")}
        return here | (top & set(names) if folder == str(REPO) else set())

    shutil.copytree(REPO, copy, ignore=ignored)
    (copy / ".git" / "info").mkdir(parents=True)
    fetched = subprocess.run(["bash", "benchmarks/gpu_run.sh", "--fetch"], cwd=copy, capture_output=True, text=True, timeout=300)
    assert fetched.returncode == 0, fetched.stderr[-2000:]
    wheels = sorted(p.name.split("-")[0] for p in (copy / ".whl").glob("*.whl"))
    assert wheels == ["antlr4_python3_runtime", "hydra_core", "omegaconf", "submitit", "torchdata"]
    out, site = tmp_path / "out", tmp_path / "site"
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # python3: this one
    env = {**os.environ, "OUT": str(out), "GPU_RUN_SITE": str(site), "GPU_RUN_ONLY": "started fresh", "PATH": path}
    proc = subprocess.run(["bash", "benchmarks/gpu_run.sh", "--cpu"], cwd=copy, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert f"hydra from {site}" in proc.stdout  # the carried wheel, not this environment's hydra
    table = json.loads((out / "gpu_check.json").read_text())
    assert table["device"] == "CPU (gloo)"
    assert [(r["check"], r["ok"]) for r in table["checks"]] == [("ranks started fresh", True)]
    assert "PASS  ranks started fresh" in (out / "gpu_run.log").read_text()


def test_a_trace_summary_counts_each_operation_once_and_the_gpu_busy_once_per_instant(tmp_path):
    """benchmarks/trace_summary.py on a crafted chrome trace: a parent's own time excludes its children's, and two
    overlapping kernels on two streams are busy time once."""
    import json

    from benchmarks.trace_summary import busy, self_times, summary

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "train step 3", "ts": 0, "dur": 1000, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 100, "dur": 500, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 150, "dur": 300, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 700, "dur": 100, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 200, "dur": 400, "pid": 0, "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "copy", "ts": 500, "dur": 200, "pid": 0, "tid": 8},
    ]
    ops = [e for e in events if e["cat"] == "cpu_op"]
    assert self_times(ops) == {"aten::linear": 200, "aten::mm": 400}
    assert busy([e for e in events if e["cat"] == "kernel"]) == 500  # 200..700
    trace = tmp_path / "rank0.pt.trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    text = summary(trace)
    assert "1 step(s), 1.0 ms each" in text and "GPU busy 0.5 ms a step (50%" in text
    assert "aten::mm 0.40 ms; aten::linear 0.20 ms" in text


def test_a_gpu_check_the_budget_cuts_short_is_skipped_and_says_so_not_failed(tmp_path):
    """The lent machine's run of 2026-11-28 reported `meta init = full build` as FAIL (TimeoutExpired) when it was only
    the 480 s budget that ended it: a check started with too little budget left is not measured, and says to rerun it."""
    out = tmp_path / "table.json"
    proc = run_cli("benchmarks.gpu_check", "--cpu", "--only", "ddp, 1 process", "--budget-s", "1", "--out", str(out),
                   cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [row] = json.loads(out.read_text())["checks"]
    assert row["ok"] is None and "cut short at --budget-s=1" in row["result"] and "GPU_RUN_ONLY" in row["result"]
