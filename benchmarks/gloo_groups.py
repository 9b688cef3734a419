"""What an idle gloo process group costs a compute-bound process: the same forward/backward loop, timed with 0, 1
or 2 extra gloo groups that never run a collective.

    python -m benchmarks.gloo_groups                  # 2 processes, groups 0,1,2, 5 alternating repetitions
    python -m benchmarks.gloo_groups --smoke          # seconds: keeps the script working (run by the tests)

Each gloo group owns an event loop thread per process that wakes every 10 ms whether or not anything is sent
(gloo's tcp Loop polls with a 10 ms timeout). With one compute thread per core, every wake-up preempts training.
This is why the trainer keeps its stop agreement and its waits on checkpoint I/O on the training group under
gloo (train.dist.control_group). Each run prints one JSON line: the extra groups, the seconds of the timed loop
(mean over ranks) and the event-loop threads counted in rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(extra: int, iterations: int, width: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    idle = [dist.new_group(backend="gloo") for _ in range(extra)]  # noqa: F841  (kept alive, never used)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, width, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))
    x = torch.randn(32, 3, 32, 32)
    for _ in range(3):
        model(x).sum().backward()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iterations):
        model(x).sum().backward()
    elapsed = time.perf_counter() - started
    loops = sum(Path(f"/proc/self/task/{t}/comm").read_text().strip() == "gloo_tcp_loop"
                for t in os.listdir("/proc/self/task"))
    times = [None] * dist.get_world_size()
    dist.all_gather_object(times, elapsed)
    if dist.get_rank() == 0:
        print(json.dumps({"extra_groups": extra, "seconds": statistics.mean(times), "event_loops": loops}), flush=True)
    dist.destroy_process_group()


def launch(procs: int, extra: int, iterations: int, width: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", "-m",
           "benchmarks.gloo_groups", "--worker", str(extra), "--iterations", str(iterations), "--width", str(width)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        sys.exit(f"run failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="The cost of idle gloo groups to a compute-bound loop.")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--groups", default="0,1,2", help="extra idle groups to compare, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=40, help="timed forward/backward passes per run")
    parser.add_argument("--width", type=int, default=64, help="channels of the convolutions")
    parser.add_argument("--smoke", action="store_true", help="tiny runs, one repetition")
    parser.add_argument("--out", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        from train.dist import exit_without_finalizing

        worker(args.worker, args.iterations, args.width)
        exit_without_finalizing()  # a rank: see train.dist
        return {}
    if args.smoke:
        args.reps, args.iterations, args.width = 1, 2, 8
    counts = [int(g) for g in args.groups.split(",")]
    runs: dict[int, list[dict]] = {g: [] for g in counts}
    for rep in range(args.reps):  # alternating, so drifts of the machine hit every count alike
        for extra in counts if rep % 2 == 0 else reversed(counts):
            result = launch(args.procs, extra, args.iterations, args.width)
            runs[extra].append(result)
            print(f"  rep {rep + 1}/{args.reps}, {extra} extra groups: {result['seconds']:.3f} s, "
                  f"{result['event_loops']} gloo event loops per process", flush=True)
    base = statistics.median(r["seconds"] for r in runs[counts[0]])
    report = {"procs": args.procs, "iterations": args.iterations, "runs": {str(g): r for g, r in runs.items()},
              "median_seconds": {str(g): statistics.median(r["seconds"] for r in rs) for g, rs in runs.items()}}
    print("\nextra groups   median s   slower than %d extra" % counts[0])
    for g in counts:
        median = report["median_seconds"][str(g)]
        print(f"{g:>12} {median:>10.3f}   {100 * (median / base - 1):+.1f}%")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
