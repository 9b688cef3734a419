"""Shared helpers: run the real CLI in a subprocess, compose configs in-process, read run directories."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

# OpenMP's threads spin for a while at the end of each parallel region, waiting for the next one: on a machine with
# spare cores that saves a wake-up, on this 2-core machine running three test files at once it burns the CPU the
# other processes wait for. A rank or test process with 2 threads (the benchmarks, one-process runs) took ~3x its
# CPU beside a busy neighbour (the GPT benchmark's smoke test: 44 s against 15 s with PASSIVE, 2026-11-29). Set
# before torch loads libgomp, here and in every process the tests start; results do not depend on it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from train.host import descendants  # noqa: F401  (the tests' name for it)
import torch
from ci_clusters import cluster_started, ray_test_done, ray_tests  # noqa: F401 (cluster_started: the tests' name)
from file_seconds import longest_first, measured

pytest_plugins = ["cpu_accounting"]  # each test's CPU, the session's (tests/cpu_accounting.py)

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = REPO / "conf"

FAULTS_DIR = Path(__file__).resolve().parent / "faults"


def faults_path() -> str:
    """PYTHONPATH with tests/faults first: its sitecustomize injects the faults and delays the variables name."""
    return os.pathsep.join(p for p in (str(FAULTS_DIR), os.environ.get("PYTHONPATH", "")) if p)


def fault_env(kind: str, rank: int, step: int = 0) -> dict:
    """Environment that makes rank `rank` fail as `kind` in the first attempt (see tests/faults/sitecustomize.py)."""
    return {"PYTHONPATH": faults_path(), "FAULT": kind, "FAULT_RANK": str(rank), "FAULT_STEP": str(step)}


def slowed_steps(ms: int = 20) -> dict:
    """Environment that makes every optimizer step of every rank sleep `ms` longer (tests/faults: STEP_DELAY_MS): for
    a run that trains until the test ends it, whose ranks would otherwise compute flat out beside the other tests
    while the test acts."""
    return {"PYTHONPATH": faults_path(), "STEP_DELAY_MS": str(ms)}


@contextlib.contextmanager
def shared_lock(name: str, exclusive: bool):
    """A lock the test processes of one pytest-xdist run share (outside xdist: always granted). Taking it goes
    through a gate held by whoever waits for it exclusively, so a steady stream of shared holders cannot starve
    an exclusive one."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    base = Path(tempfile.gettempdir()) / f"pytest-{run}-{name}"
    with open(f"{base}.gate", "a") as gate, open(f"{base}.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def raised_priority(by: int = 10):
    """This process (and what it starts meanwhile) `by` nice levels above the others while inside; PermissionError
    where it may not (it takes root, or CAP_SYS_NICE)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, before - by)
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)


@functools.cache  # the permission does not change during a run
def may_raise_priority() -> bool:
    try:
        with raised_priority():
            return True
    except PermissionError:
        return False


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: `-p no:xdist` runs without it
def pytest_xdist_make_scheduler(config, log):
    """Two workers for the files that compute, one for those that wait on the test clusters (tests/lanes.py)."""
    from lanes import Lanes

    return Lanes(config, log)


# The conformance matrix's table (tests/conformance/test_matrix.py), printed after a run in one process (-n 0)
MATRIX_TABLE = pytest.StashKey[str]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if MATRIX_TABLE in config.stash:
        terminalreporter.write_line("\n" + config.stash[MATRIX_TABLE])


def pytest_collection_modifyitems(items):
    """pytest-xdist hands out the files in this order (`--no-loadscope-reorder`): the files of tests that use the Ray
    test cluster first, which stops after them (tests/ci_clusters.py), then the longest first, so that the workers
    end together (tests/file_seconds.py, tests/lanes.py). Among the Ray files, those with the fewest other tests
    first, and in each its Ray tests first: test_ray.py, then the conformance matrix's Ray cells, then its other
    cells (the cluster's daemons idled beside those for ~6 minutes, 2026-11-29)."""
    order = {nodeid: i for i, nodeid in enumerate(longest_first([item.nodeid for item in items], measured()))}
    on_ray = ray_tests(items)
    files = Counter(item.nodeid.split("::", 1)[0] for item in items)
    off_ray = Counter(item.nodeid.split("::", 1)[0] for item in items if item.nodeid not in on_ray)
    ray_files = {nodeid.split("::", 1)[0] for nodeid in on_ray}

    def key(item):
        file = item.nodeid.split("::", 1)[0]
        return file not in ray_files, off_ray[file] / files[file], item.nodeid not in on_ray, order[item.nodeid]

    items.sort(key=key)


RAY_TESTS = pytest.StashKey[set]()


def pytest_collection_finish(session):
    session.config.stash[RAY_TESTS] = ray_tests(session.items)  # after any deselection (-k, -m): what will run


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # its fixtures' finalizers first (test_ray.py's module fixture releases the cluster there)
    ray_test_done(item.nodeid, item.config.stash.get(RAY_TESTS, set()))


@pytest.fixture(autouse=True)
def _alone_if_timed(request):
    """Under `pytest -n 3` (pytest-xdist, --dist=loadfile) three tests run at once. A test marked `alone` asserts
    time limits of a few seconds (hang and collective timeouts, slow I/O, one rank's stall against the other's):
    the other tests' processes must not starve its ranks. Where this process may raise its priority (as root, as
    in CI), an `alone` test runs at nice -10 beside the other tests, whose processes then get about a tenth of the
    CPU its ranks ask for (they slow, they do not wait); elsewhere it runs with no other test beside it.
    Either way `alone` tests run one at a time."""
    alone = request.node.get_closest_marker("alone") is not None
    if alone and may_raise_priority():
        with shared_lock("alone-prioritized", exclusive=True), raised_priority():
            yield
        return
    with shared_lock("alone", exclusive=alone):
        yield


def rank_processes():
    """The multiprocessing context for a test's own ranks: each forks from one server process that has imported torch
    and the trainer (started at the first use in this test process, then kept), instead of importing them again
    (~1.5 s of CPU a rank); and never a fork of the test process itself (its threads, earlier tests' gloo state: such
    a fork aborted once while collecting garbage, "Fatal Python error: Aborted")."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch.distributed", "train.run"])  # effective where the server is not running yet
    return context


def run_ranks(worker, world: int, *args, shared: dict | None = None) -> dict:
    """Run `worker(rank, *args, out)` in `world` processes of rank_processes(); `out` starts as `shared` and holds
    what the ranks put there."""
    import torch.multiprocessing as mp

    with rank_processes().Manager() as manager:
        out = manager.dict(shared or {})
        mp.start_processes(worker, args=(*args, out), nprocs=world, join=True, start_method="forkserver")
        return dict(out)


# Small, fast settings for runs that check mechanics rather than accuracy.
FAST = ["trainer.progress=lines", "trainer.threads=1"]


def run_cli(module: str, *args: str, cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` in a fresh process; its output is shown if a test fails."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    print(f"$ python -m {module} {' '.join(args)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


@pytest.fixture
def launch(tmp_path):
    """Run `python -m launcher` with the given overrides in a scratch working directory."""

    def _launch(*overrides: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
        return run_cli("launcher", *overrides, cwd=tmp_path, timeout=timeout, env=env)

    return _launch


def run_commands(cwd: Path, rows: list[dict], *options: str, env: dict | None = None) -> dict[str, dict]:
    """`python -m launcher ARGS` of every row ({"id", "args"}), run in one process in `cwd` with every backend's start
    recorded, not run (tests/conformance/commands.py): {id: {"code", "stdout", "stderr", "started", "seconds"}}."""
    (cwd / "rows.json").write_text(json.dumps(rows))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "conformance" / "commands.py"), "rows.json",
                           "results.json", *options], cwd=cwd, text=True, capture_output=True, timeout=900,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {result["id"]: result for result in json.loads((cwd / "results.json").read_text())}


def compose(*overrides: str):
    """Compose the config in-process exactly as the CLI does (same schema, same resolver), without running."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from launcher.run_dir.directory import register_resolvers
    from launcher.schema import register_configs

    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=False)


def typed(*overrides: str):
    from launcher.checks.validate import typed_config

    return typed_config(compose(*overrides))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """~300 kB of this Python's standard library sources as byte tokens: 270k training tokens, 8.4k windows of 32
    (prepared once for every language-model test)."""
    from train.data.prepare_text import prepare, stdlib_sources

    directory = tmp_path_factory.mktemp("tokens")
    prepare(stdlib_sources(300_000), directory)
    return directory


def kill_leftovers(proc: subprocess.Popen, run_dir) -> None:
    """A failed test must not leave a launcher or its workers running (they sit in their own sessions)."""
    if proc.poll() is None:
        proc.kill()
    subprocess.run(["pkill", "-9", "-f", f"train {run_dir}/config.yaml"], capture_output=True)


def signalled_launch(overrides: list[str], run_dir, cwd, sig: int = signal.SIGTERM, after_step: int = 3,
                     env: dict | None = None, terminal: bool = False) -> tuple[subprocess.Popen, str, str]:
    """`python -m launcher OVERRIDES hydra.run.dir=RUN_DIR`, sent `sig` once it has logged a step past
    `after_step`; the ended process, its stdout and its stderr. `terminal`: as a terminal sends Ctrl-C, to the whole
    foreground process group (the launcher leads one of its own here), not to the launcher alone."""
    command = [sys.executable, "-m", "launcher", *overrides, f"hydra.run.dir={run_dir}"]
    with subprocess.Popen(command, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=terminal) as proc:
        try:
            wait_for(lambda: any(s >= after_step for s in logged_steps(run_dir)), timeout=120,
                     what="the first logged steps")
            os.killpg(proc.pid, sig) if terminal else proc.send_signal(sig)
            out, err = proc.communicate(timeout=120)
        finally:
            kill_leftovers(proc, run_dir)
    print(out, err)
    return proc, out, err


def process_named(name: str, under: int) -> int | None:
    """The process below `under` whose name (ps, top, pgrep's) is `name`, e.g. "train rank 0", as an operator finds
    a rank to signal it; None if there is none."""
    return named(name, descendants(under))


def named(name: str, pids) -> int | None:
    """The first of `pids` whose name (/proc/PID/comm) is `name`; None if none is."""
    for pid in pids:
        try:
            if open(f"/proc/{pid}/comm").read().strip() == name:
                return pid
        except OSError:
            continue
    return None


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wait_for(condition, timeout: float, what: str, poll: float = 0.05) -> None:
    """Wait for `condition` to hold, polling; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


def logged_steps(run_dir: Path) -> list[int]:
    """Steps logged so far by a run that may be writing right now."""
    from train.observe.metrics import read_records

    return [r["step"] for r in read_records(run_dir)]


def final_checkpoint(run_dir: Path) -> dict:
    """The newest checkpoint's state, "model" included, in either format (a step directory's model read whole)."""
    from train.checkpoint import committed

    found = committed(run_dir / "checkpoints")
    assert found, f"no checkpoint in {run_dir}"
    return _read_checkpoint(found[-1].path)


def checkpoint_at(run_dir: Path, step: int) -> dict:
    """The committed checkpoint of `step` (kept: checkpoint.keep_last), in either format."""
    from train.checkpoint import committed

    found = [c for c in committed(run_dir / "checkpoints") if c.step == step]
    assert found, f"no checkpoint of step {step} in {run_dir}"
    return _read_checkpoint(found[-1].path)


def _read_checkpoint(path: Path) -> dict:
    from train.checkpoint import dcp

    if path.is_dir():  # seen as a single file would hold it: every rank's RNG and data position in lists
        ranks = [dcp.load_rank_state(path, r) for r in range(dcp.read_manifest(path)["world_size"])]
        return {**dcp.load_trainer_state(path), "model": dcp.read_model(path), "rng": [r["rng"] for r in ranks],
                "data": [r["data"] for r in ranks]}
    return torch.load(path, weights_only=True)


# SGD with momentum on an MLP without dropout or batch norm: nothing that depends on the per-rank batch.
IDENTITY = [
    *FAST,
    "data=synthetic",
    "data.num_samples=512",
    "model=mlp",
    "model.hidden=[64,32]",
    "optim.lr=0.05",
    "trainer.epochs=3",
    "trainer.max_steps=24",  # 1.5 epochs: crosses an epoch boundary (reshuffle with set_epoch)
    "trainer.eval_every=0",
    "trainer.log_every=8",
]


def _reference_run(tmp_path_factory, name: str, *overrides: str, base: list[str] = IDENTITY) -> Path:
    """The run directory of `base` (IDENTITY) with `overrides`, run once per pytest run: the first worker to ask runs
    it, the others wait for it and read the same directory (pytest-xdist's workers share their base directory's
    parent). Several files on several workers compare with it, and each launch is seconds of CPU (tests/lanes.py).
    Read-only for the tests."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    tmp = root / f"reference-{name}"
    with shared_lock(f"reference-{name}", exclusive=True):
        if not (tmp / "done").exists():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            proc = run_cli("launcher", *base, *overrides, f"hydra.run.dir={tmp / 'run'}", cwd=tmp)
            assert proc.returncode == 0, proc.stderr[-3000:]
            (tmp / "done").touch()
    return tmp / "run"


@pytest.fixture(scope="session")
def one_process_batch_32(tmp_path_factory) -> dict:
    """The final checkpoint of IDENTITY on 1 process with batch 32: what every parallel layout must reach."""
    return final_checkpoint(_reference_run(tmp_path_factory, "single", "trainer.procs_per_node=1", "data.batch_size=32"))


@pytest.fixture(scope="session")
def two_process_ddp(tmp_path_factory) -> Path:
    """The run directory of IDENTITY under DDP on 2 processes with batch 16 each (global batch 32)."""
    return _reference_run(tmp_path_factory, "ddp", "trainer.procs_per_node=2", "data.batch_size=16")


# The small GPT of the language-model tests: gpt_tiny cut to 2 layers of width 32, on `corpus`'s windows of 32.
SMALL_GPT = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32"]
GPT_PIPELINE = ["model._target_=train.models.gpt.GPTPipeline", "~model.tie_weights"]  # the GPT as nn.Sequential


def small_gpt(corpus: Path) -> list[str]:
    return [*FAST, "+experiment=gpt_tiny", "data=tokens", f"data.root={corpus}", *SMALL_GPT, "trainer.eval_every=0",
            "trainer.log_every=4"]


# 1 process with the global batch of 32 for 12 steps, a checkpoint every 4 and evaluated at step 8 and at the end:
# what the GPT's parallel layouts reach (tests/test_gpt.py, tests/test_layouts.py)
GPT_ONE = ["trainer.procs_per_node=1", "data.batch_size=32", "trainer.max_steps=12", "trainer.eval_every_steps=8",
           "checkpoint.every_steps=4"]


@pytest.fixture(scope="session")
def gpt_one_process(corpus, tmp_path_factory) -> Path:
    """The run directory of GPT_ONE (read-only)."""
    return _reference_run(tmp_path_factory, "gpt-one", *GPT_ONE, base=small_gpt(corpus))


@pytest.fixture(scope="session")
def gpt_pipeline_one_process(corpus, tmp_path_factory) -> Path:
    """The run directory of GPT_ONE for GPTPipeline, the pipelines' reference (read-only)."""
    return _reference_run(tmp_path_factory, "gpt-pipeline-one", *GPT_PIPELINE, *GPT_ONE, base=small_gpt(corpus))


# AdamW, dropout, augmentation, gradient clipping, accumulation: every piece of state that resume must restore.
RESUME = [
    *FAST,
    "trainer.procs_per_node=2",
    "model.dropout=0.2",
    "data.augment=true",
    "data.batch_size=32",
    "optim=adamw",
    "optim.lr=0.003",
    "optim.schedule.warmup_epochs=0.5",
    "trainer.accumulate=2",
    "trainer.grad_clip=1.0",
    "trainer.epochs=4",
    "trainer.log_every=3",
]


# RESUME to step 32 straight through, with what the fault tests need of it (tests/test_faults.py FAULTY: a checkpoint
# every 4 steps, restarts, a quick stop check), none of which changes the arithmetic: run once for both files.
STRAIGHT = [*RESUME, "trainer.max_steps=32", "checkpoint.every_steps=4", "launcher.max_restarts=2", "trainer.stop_check_s=0.05"]


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory) -> Path:
    """The run directory of STRAIGHT (tests/test_ddp_identity.py resumes against it, tests/test_faults.py restarts
    and stops; read-only)."""
    return _reference_run(tmp_path_factory, "straight", base=STRAIGHT)


# IDENTITY for 3 epochs with a checkpoint every 3 steps (tests/test_sharded_checkpoints.py, test_checkpoint_io.py),
# and the layout that makes those checkpoints sharded step directories.
CHECKPOINTED = [*IDENTITY, "trainer.max_steps=-1", "trainer.epochs=3", "checkpoint.every_steps=3", "checkpoint.keep_last=10"]
FSDP2 = ["trainer.strategy=fsdp", "trainer.procs_per_node=2", "data.batch_size=48"]


@pytest.fixture(scope="session")
def fsdp_halfway(tmp_path_factory) -> Path:
    """The run directory of CHECKPOINTED under FSDP2 stopped after step 7, mid-epoch: step directories 3, 6 and 7
    (read-only: a test that changes it works on a copy)."""
    return _reference_run(tmp_path_factory, "fsdp-halfway", *FSDP2, "trainer.max_steps=7", base=CHECKPOINTED)


# --- an S3 server (tests/test_object_store.py; checkpoint.store from other backends' tests) -----------------------

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server for this module's tests: {"env": what a rank needs to reach it, "process": the server}."""
    host = "127.0.0.5"
    port = free_port(host)
    log = open(tmp_path_factory.mktemp("moto") / "server.log", "w")
    server = subprocess.Popen([shutil.which("moto_server") or "moto_server", "-H", host, "-p", str(port)],
                              stdout=log, stderr=subprocess.STDOUT)
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://{host}:{port}"}

    def answers() -> bool:
        with socket.socket() as s:
            return s.connect_ex((host, port)) == 0

    wait_for(answers, timeout=60, what="the moto S3 server to listen")
    from launcher.backends.local import environment

    try:
        with environment(env):  # this process's own Store() reads the same environment as the runs' ranks
            yield {"env": env, "process": server}
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.terminate()
        server.wait(timeout=30)
        log.close()


@pytest.fixture
def bucket(s3) -> str:
    """A fresh bucket: s3://NAME."""
    import boto3

    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3["env"]["AWS_ENDPOINT_URL"]).create_bucket(Bucket=name)
    return f"s3://{name}"
