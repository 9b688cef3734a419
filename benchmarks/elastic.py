"""What a change of world costs an elastic run (trainer.min_nodes): the seconds from a node lost to the next step at
the smaller world, and from a node's launcher started again to the first step at the larger one.

    sudo python -m benchmarks.elastic                    # ~1 min on 2 CPU cores (root: the nodes' namespaces)
    sudo python -m benchmarks.elastic --out benchmarks/results/elastic-2cores.json
    sudo python -m benchmarks.elastic --smoke            # checks the script works

Two nodes by rendezvous on this machine, as tests/test_multinode.py makes them (each launcher in UTS and mount
namespaces of its own, with its own host name), one process each, trainer.nodes=2 trainer.min_nodes=1; every step
made --step-ms longer (tests/faults). At step --lose-at n2's launcher and rank are SIGKILLed (a machine gone); once
n1 trains alone, n2's launcher is started again with the same command. Times are read from the run's metric records
(each attempt's first step writes one) and this script's clock:
- lost -> step: from the SIGKILL to the first step of the attempt at world 1 (the survivor's failure, its restart,
  the rendezvous taking n2 for lost: 3 missed beats of launcher.rdzv_keep_alive_s, launcher.rdzv_last_call_s, the
  start-up and the checkpoint's load);
- joined -> step: from n2's launcher start to the first step at world 2 (n2's start-up and rendezvous, n1's ranks
  saving at their step boundary, both starting again). Steps redone: those since the checkpoint the survivor took up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from benchmarks.overhead import REPO, machine
from train.host import descendants
from train.observe.metrics import read_records


def node(name: str, hosts: Path, command: list[str], log: Path, env: dict) -> subprocess.Popen:
    """The launcher as node `name`: its own host name, /etc/hosts replaced by `hosts` for it only."""
    script = f'hostname {name} && mount --bind {hosts} /etc/hosts && exec "$0" "$@"'
    with open(log, "a") as out:
        return subprocess.Popen(["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", script,
                                 *command], cwd=log.parent, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"benchmark: no {what} within {timeout:.0f} s")
        time.sleep(0.1)


def attempts(run_dir: Path) -> list[tuple[float, int]]:
    """(time, step) of each attempt's first step: its start-up record."""
    return [(r["time"], r["step"]) for r in read_records(run_dir) if r["kind"] == "startup"]


def measure(scratch: Path, steps: int, lose_at: int, every: int, step_ms: int, keep_alive: int) -> dict:
    hosts = scratch / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.0.2 n1\n127.0.0.3 n2\n")
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    run_dir = scratch / "run"
    command = [sys.executable, "-m", "launcher", "data=synthetic", "data.num_samples=4096", "model=mlp",
               "model.hidden=[64,32]", "data.batch_size=16", "trainer.nodes=2", "trainer.min_nodes=1",
               "trainer.procs_per_node=1", "trainer.threads=1", "trainer.progress=lines", "trainer.eval_every=0",
               "trainer.log_every=1", f"trainer.max_steps={steps}", f"checkpoint.every_steps={every}",
               "launcher.max_restarts=2", "launcher.rdzv_last_call_s=1", f"launcher.rdzv_keep_alive_s={keep_alive}",
               "launcher.rdzv_timeout_s=120",
               f"launcher.rdzv_endpoint=n1:{port}", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests" / "faults"), "STEP_DELAY_MS": str(step_ms)}
    logs = {name: scratch / f"{name}.log" for name in ("n1", "n2")}
    nodes = {name: node(name, hosts, command, logs[name], env) for name in ("n1", "n2")}
    try:
        trained = lambda: [r["step"] for r in read_records(run_dir) if r["kind"] == "train"]  # noqa: E731
        wait_until(lambda: run_dir.exists() and any(s >= lose_at for s in trained()), 180, f"step {lose_at}")
        done = max(trained())
        n2 = nodes["n2"]
        for pid in [n2.pid, *descendants(n2.pid)]:
            os.kill(pid, signal.SIGKILL)
        lost = time.time()
        n2.wait()
        wait_until(lambda: any(t > lost for t, _ in attempts(run_dir)), 180, "step at world 1")
        resumed = next(s for t, s in attempts(run_dir) if t > lost) - 1
        alone = next(t for t, _ in attempts(run_dir) if t > lost)
        joined = time.time()
        nodes["n2"] = node("n2", hosts, command, logs["n2"], env)
        wait_until(lambda: any(t > joined for t, _ in attempts(run_dir)), 180, "step at world 2")
        grown = next(t for t, _ in attempts(run_dir) if t > joined)
        codes = [p.wait(timeout=300) for p in nodes.values()]
    finally:
        for p in nodes.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    if codes != [0, 0]:
        sys.exit(f"benchmark: the nodes ended with {codes}\n{logs['n1'].read_text()[-3000:]}")
    return {"lost_to_step_s": alone - lost, "joined_to_step_s": grown - joined, "lost_at_step": lose_at,
            "resumed_at_step": resumed, "steps_redone": done - resumed}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lose-at", type=int, default=30, help="n2 is SIGKILLed once this step is logged")
    parser.add_argument("--every", type=int, default=20, help="checkpoint.every_steps")
    parser.add_argument("--step-ms", type=int, default=100, help="added to every step: a model this slow")
    parser.add_argument("--keep-alive", type=int, default=5, help="launcher.rdzv_keep_alive_s (torch's default: 5)")
    parser.add_argument("--smoke", action="store_true", help="a short run: checks the script works")
    parser.add_argument("--out", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        sys.exit("benchmarks.elastic needs root and unshare: each node is a launcher in namespaces of its own")
    if args.smoke:
        args.steps, args.lose_at, args.every, args.step_ms = 120, 10, 5, 100
    with tempfile.TemporaryDirectory() as scratch:
        results = measure(Path(scratch), args.steps, args.lose_at, args.every, args.step_ms, args.keep_alive)
    print(f"node lost -> next step at world 1: {results['lost_to_step_s']:.1f} s (steps redone: "
          f"{results['steps_redone']}, from the checkpoint of step {results['resumed_at_step']})\n"
          f"node joined -> first step at world 2: {results['joined_to_step_s']:.1f} s", flush=True)
    report = {"date": str(date.today()), "machine": machine(), "settings": vars(args) | {"out": str(args.out)},
              "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
