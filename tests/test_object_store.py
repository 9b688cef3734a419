"""Checkpoints in an object store (checkpoint.store, train/checkpoint/store.py) against a real S3 server: moto's
server mode on a loopback address, spoken to over HTTP by s3fs, with its credentials and endpoint in the
environment as a user's would be. Faults come from outside: the server stopped (SIGSTOP) and resumed, the uploading
rank killed, an object deleted by hand; the identity after each: resume from the store alone ends bitwise where the
uninterrupted run does, and the previous checkpoint is never lost."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import (CREDENTIALS, IDENTITY, final_checkpoint, free_port, kill_leftovers, process_named, run_cli,
                      run_commands, wait_for)

from train.checkpoint import committed
from train.checkpoint.store import SET_ASIDE, Record, Store, StoreDamaged

def train(tmp_path: Path, run_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = run_cli("launcher", *IDENTITY, "checkpoint.every_steps=8", *overrides, f"hydra.run.dir={run_dir}",
                   cwd=tmp_path, env=env)
    return proc


def same_model(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- the store itself ------------------------------------------------------------------------------------------

def test_a_checkpoint_counts_once_its_record_is_written_and_downloads_only_whole(bucket, tmp_path):
    store = Store(f"{bucket}/run")
    source = tmp_path / "ckpt"
    source.mkdir()
    (source / "a.bin").write_bytes(b"a" * 1000)
    (source / "b.bin").write_bytes(b"b" * 10)
    import hashlib

    files = {n: {"size": (source / n).stat().st_size, "sha256": hashlib.sha256((source / n).read_bytes()).hexdigest()}
             for n in ("a.bin", "b.bin")}
    store.upload(source, "step_00000001", files)
    assert store.committed() == []  # every object is there, but no record: not a checkpoint
    record = Record("step_00000001", 0, 1, "dcp", files)
    store.commit(record)
    assert store.committed() == [record]
    store.download(record, tmp_path / "back")
    assert (tmp_path / "back" / "a.bin").read_bytes() == b"a" * 1000

    store.fs.pipe_file(store.key("step_00000001", "b.bin"), b"c" * 10)  # changed behind the record's back
    with pytest.raises(StoreDamaged, match="not what was committed"):
        store.download(record, tmp_path / "again")
    store.fs.rm_file(store.key("step_00000001", "a.bin"))
    with pytest.raises(StoreDamaged, match="missing"):
        store.download(record, tmp_path / "again")

    (source / "a.bin").write_bytes(b"x" * 1000)  # the local file changed after its commit: never uploaded as it
    with pytest.raises(OSError, match="changed on the local disk"):
        store.upload(source, "step_00000002", files)


def test_prune_keeps_the_last_commits_and_removes_an_upload_that_never_committed(bucket, tmp_path):
    store = Store(f"{bucket}/run")
    (tmp_path / "f").write_bytes(b"1")
    import hashlib

    files = {"f": {"size": 1, "sha256": hashlib.sha256(b"1").hexdigest()}}
    store.upload(tmp_path, "step_00000005", files)  # a crash before its record: an orphan
    for commit, step in enumerate((10, 20, 30)):
        store.upload(tmp_path, f"step_{step:08d}", files)
        store.commit(Record(f"step_{step:08d}", commit, step, "dcp", files))
    store.prune(keep_last=2)
    assert [r.step for r in store.committed()] == [20, 30]
    store.fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(store.root)) == ["step_00000020", "step_00000030"]


def test_a_start_from_a_checkpoint_the_store_lacks_uploads_it_first(tmp_path):
    """A run whose last upload did not finish (killed, or the store was down) left its newest checkpoint on the disk
    only: the next start on that machine resumes from it and puts it in the store before training goes on."""
    import torch

    from train.checkpoint.file import REQUIRED_KEYS
    from train.checkpoint.manager import CheckpointManager
    from train.config import CheckpointConfig

    state = {key: torch.tensor([1.0]) for key in REQUIRED_KEYS} | {"step": 8, "rng": [], "config": {}}
    CheckpointManager(tmp_path / "checkpoints", CheckpointConfig(), is_writer=True).save(state, 8)
    url = f"file://{tmp_path / 'store'}"
    manager = CheckpointManager(tmp_path / "checkpoints", CheckpointConfig(store=url), is_writer=True)
    assert Store(url).committed() == []
    assert manager.choose()["step"] == 8
    [record] = Store(url).committed()
    assert record.step == 8 and record.name == "step_00000008.pt"
    manager.close()


# --- the checks before start -----------------------------------------------------------------------------------

def test_a_store_url_is_checked_before_any_process_starts(bucket, tmp_path):
    """Refused before start, each with the key and the fix; the URL's form even in a dry run, which does not ask
    the store (as it asks no cluster). The launches run in one process (tests/conformance/commands.py): a refusal
    costs its checks, not a Python and torch start each."""
    store = Store(f"{bucket}/run")
    store.commit(Record("step_00000008.pt", 0, 8, "file", {}))
    launches = {
        "missing": ["checkpoint.store=s3://no-such-bucket-here/run"],
        "secret": ["checkpoint.store=s3://AKIA:hunter2@bucket/run", "launcher.dry_run=true"],
        "unknown": ["checkpoint.store=nosuch://bucket/run", "launcher.dry_run=true"],
        "fresh": [f"checkpoint.store={bucket}/run", "checkpoint.resume=false"],
        "planned": [f"checkpoint.store={bucket}/run", "checkpoint.resume=false", "launcher.dry_run=true"],
    }
    said = run_commands(tmp_path, [{"id": name, "args": [*args, f"hydra.run.dir=runs/{name}"]}
                                   for name, args in launches.items()])
    missing, secret, unknown, fresh, planned = (said[name] for name in launches)
    assert missing["code"] != 0 and not missing["started"]
    assert "checkpoint.store=s3://no-such-bucket-here/run: the bucket no-such-bucket-here does not exist" in missing["stderr"]
    assert secret["code"] != 0 and "the URL holds credentials" in secret["stderr"]
    assert "hunter2" not in secret["stderr"] + secret["stdout"]
    assert unknown["code"] != 0 and "checkpoint.store=nosuch://bucket/run: Protocol not known" in unknown["stderr"]
    assert fresh["code"] != 0 and not fresh["started"]
    assert f"checkpoint.resume=false, but checkpoint.store={bucket}/run already holds 1 checkpoint(s)" in fresh["stderr"]
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("metrics.jsonl"))  # nothing ran
    assert planned["code"] == 0 and f"dry run: checkpoint.store={bucket}/run was not asked" in planned["stderr"]


def test_a_rank_that_cannot_reach_the_store_stops_with_what_to_give_it(tmp_path, monkeypatch):
    """A node without the store's credentials or route (the launcher's machine had them): the rank's first listing
    says what the ranks need, instead of a traceback of botocore's."""
    from train.checkpoint.file import CheckpointSaveError
    from train.checkpoint.manager import CheckpointManager
    from train.config import CheckpointConfig

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.5:{free_port('127.0.0.5')}")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(CheckpointSaveError, match="cannot be listed from .*EndpointConnectionError.*give them to the "
                                                  "nodes that run the ranks"):
        CheckpointManager(tmp_path / "checkpoints", CheckpointConfig(store="s3://bucket/run"), is_writer=True)


def test_a_node_without_the_stores_file_system_stops_with_what_to_install(tmp_path, monkeypatch):
    """The launcher's machine has s3fs (checked before start), a node of the cluster has not: its rank says what to
    install where, instead of fsspec's ImportError deep in a traceback (seen on the Ray test cluster)."""
    import fsspec.registry  # noqa: F401 (the module: fsspec's own `registry` attribute is a read-only view of it)

    from train.checkpoint.file import CheckpointSaveError
    from train.checkpoint.manager import CheckpointManager
    from train.config import CheckpointConfig

    monkeypatch.setitem(sys.modules, "s3fs", None)  # `import s3fs` raises ImportError
    monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, "s3", raising=False)  # not the class this process already loaded
    with pytest.raises(CheckpointSaveError, match=r"checkpoint.store=s3://bucket/run cannot be opened on .*Install "
                                                  r"it in the environment the ranks run in on every node \(pip install s3fs"):
        CheckpointManager(tmp_path / "checkpoints", CheckpointConfig(store="s3://bucket/run"), is_writer=True)


# --- whole runs --------------------------------------------------------------------------------------------------

def test_a_fresh_machine_resumes_from_the_store_alone_bitwise(bucket, tmp_path, one_process_batch_32):
    """The first run stops at step 16; its run directory is gone (another machine); the same command with the
    run's own length resumes from the store and ends where the uninterrupted run does. Export reads the store."""
    url, run_dir = f"{bucket}/digits", tmp_path / "run"
    one = ["trainer.procs_per_node=1", "data.batch_size=32", f"checkpoint.store={url}"]
    assert train(tmp_path, run_dir, *one, "trainer.max_steps=16").returncode == 0
    assert [r.step for r in Store(url).committed()] == [8, 16]
    shutil.rmtree(run_dir)

    resumed = train(tmp_path, run_dir, *one)
    assert resumed.returncode == 0
    assert f"resume from the newest loadable checkpoint (step_00000016.pt in {url})" in resumed.stdout
    assert "resuming from" in resumed.stderr and "(step 16)" in resumed.stderr
    assert same_model(final_checkpoint(run_dir)["model"], one_process_batch_32["model"])
    assert [r.step for r in Store(url).committed()] == [8, 16, 24]

    status = run_cli("launcher.jobs", "status", str(run_dir), cwd=tmp_path)
    assert "step 24 (store: step 24)" in status.stdout
    exported = run_cli("launcher.export", url, "--out", str(tmp_path / "model.pt"), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert same_model(torch.load(tmp_path / "model.pt", weights_only=True), one_process_batch_32["model"])


def test_sharded_checkpoints_go_to_the_store_from_every_rank(bucket, tmp_path, two_process_ddp):
    """format=dcp on 2 ranks: each rank uploads the shards it wrote; a fresh machine resumes bitwise."""
    url, run_dir = f"{bucket}/sharded", tmp_path / "run"
    two = ["trainer.procs_per_node=2", "data.batch_size=16", "checkpoint.format=dcp", f"checkpoint.store={url}"]
    assert train(tmp_path, run_dir, *two, "trainer.max_steps=16").returncode == 0
    newest = Store(url).committed()[-1]
    assert newest.step == 16 and {"__0_0.distcp", "__1_0.distcp", "rank_00001.pt", "manifest.json"} <= set(newest.files)
    shutil.rmtree(run_dir)
    assert train(tmp_path, run_dir, *two).returncode == 0
    assert same_model(final_checkpoint(run_dir)["model"], final_checkpoint(two_process_ddp)["model"])


def test_an_object_deleted_by_hand_sets_that_checkpoint_aside_and_the_previous_resumes(bucket, tmp_path,
                                                                                      one_process_batch_32):
    url, run_dir = f"{bucket}/deleted", tmp_path / "run"
    one = ["trainer.procs_per_node=1", "data.batch_size=32", f"checkpoint.store={url}"]
    assert train(tmp_path, run_dir, *one, "trainer.max_steps=16").returncode == 0
    store = Store(url)
    store.fs.rm_file(store.key("step_00000016.pt", "step_00000016.pt"))  # an operator's mistake
    shutil.rmtree(run_dir)

    resumed = train(tmp_path, run_dir, *one)
    assert resumed.returncode == 0
    assert f"{url}/step_00000016.pt does not load" in resumed.stderr and "is missing from the store" in resumed.stderr
    assert "(step 8)" in resumed.stderr
    assert same_model(final_checkpoint(run_dir)["model"], one_process_batch_32["model"])
    assert store.fs.exists(store.key("step_00000016.pt", SET_ASIDE))  # kept for inspection, no longer committed
    assert [r.step for r in store.committed()] == [8, 16, 24]  # step 16 written again, whole


@contextlib.contextmanager
def stalled_upload(s3, store: Store, run_dir: Path, tmp_path: Path, *overrides: str):
    """A run whose store stops answering (SIGSTOP to the server) once the upload of step 8 has ended (the run's
    config.yaml beside it is that upload's last object): step 16 is committed on the disk and its upload hangs, and
    the save of step 24 waits for it. Yields (the launcher's process, its stderr file, a function that resumes the
    server) at that moment; the server is resumed (SIGCONT) on the way out in any case."""
    command = [sys.executable, "-m", "launcher", *IDENTITY, "checkpoint.every_steps=8", "trainer.procs_per_node=1",
               "data.batch_size=32", f"checkpoint.store={store.url}", *overrides, f"hydra.run.dir={run_dir}"]
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err_file, subprocess.Popen(
            command, cwd=tmp_path, env={**os.environ, "STEP_DELAY_MS": "50",
                                        "PYTHONPATH": str(Path(__file__).parent / "faults")},
            stdout=subprocess.PIPE, stderr=err_file, text=True) as proc:
        try:
            wait_for(lambda: store.fs.exists(store.key("config.yaml")), timeout=120, what="step 8's upload")
            os.kill(s3["process"].pid, signal.SIGSTOP)
            try:
                wait_for(lambda: "waiting for the upload of step 16 to" in err_path.read_text(), timeout=120,
                         what="the save of step 24 to wait for the upload of step 16")
                assert [c.step for c in committed(run_dir / "checkpoints")][-1] == 16
                yield proc, err_path, lambda: os.kill(s3["process"].pid, signal.SIGCONT)
            finally:
                os.kill(s3["process"].pid, signal.SIGCONT)
        finally:
            kill_leftovers(proc, run_dir)


def test_the_uploading_rank_killed_while_the_server_is_stopped_loses_nothing(s3, bucket, tmp_path,
                                                                             one_process_batch_32):
    """The rank is killed by its name while the upload of step 16 hangs on a stopped server. The store still holds
    step 8 as its newest, whole; resumed from the store alone on a fresh machine, the run ends where the
    uninterrupted one does."""
    url, run_dir = f"{bucket}/killed", tmp_path / "run"
    store = Store(url)
    with stalled_upload(s3, store, run_dir, tmp_path) as (proc, err_path, _):
        os.kill(process_named("train rank 0", proc.pid), signal.SIGKILL)
        proc.communicate(timeout=120)
    print(err_path.read_text())
    assert proc.returncode != 0
    assert [r.step for r in store.committed()] == [8]  # whatever of step 16 arrived is not a checkpoint
    shutil.rmtree(run_dir)

    one = ["trainer.procs_per_node=1", "data.batch_size=32", f"checkpoint.store={url}"]
    resumed = train(tmp_path, run_dir, *one)
    assert resumed.returncode == 0 and "(step 8)" in resumed.stderr
    assert same_model(final_checkpoint(run_dir)["model"], one_process_batch_32["model"])
    assert [r.step for r in store.committed()] == [8, 16, 24]


def test_a_stop_during_a_stalled_upload_waits_for_it_and_commits_it_when_the_server_resumes(s3, bucket, tmp_path):
    """The run is stopped (SIGTERM to the launcher) while its save waits for an upload that hangs. Once the server
    resumes the uploads finish, the stop's checkpoint is committed in the store, and the store's bytes are the
    disk's."""
    url, run_dir = f"{bucket}/paused", tmp_path / "run"
    store = Store(url)
    quick_stop = ["trainer.max_steps=48", "trainer.stop_check_s=0.01"]  # a check every step: the stop lands before 48
    with stalled_upload(s3, store, run_dir, tmp_path, *quick_stop) as (proc, err_path, resume_server):
        proc.send_signal(signal.SIGTERM)
        resume_server()
        out, _ = proc.communicate(timeout=300)
    print(out, err_path.read_text())
    assert proc.returncode == 128 + signal.SIGTERM
    local = {c.step: c.path for c in committed(run_dir / "checkpoints")}
    stopped = max(local)
    assert 24 <= stopped < 48 and f"stopped at step {stopped}" in out
    records = store.committed()
    assert records[-1].step == stopped and 16 in [r.step for r in records]
    from train.checkpoint.file import read_sidecar

    for record in records:  # the store's bytes are the disk's
        assert record.files[local[record.step].name]["sha256"] == read_sidecar(local[record.step])[0]


def test_a_stop_cut_short_by_the_shutdown_timeout_says_what_stands_and_the_next_start_uploads_it(s3, bucket, tmp_path):
    """The stop's wait for a stalled upload outlasts launcher.shutdown_timeout_s: the rank is killed. It said before
    what stands then (the disk holds step 16, the store step 8), and the same command, once the server answers
    again, uploads step 16 before it trains on."""
    url, run_dir = f"{bucket}/cut", tmp_path / "run"
    store = Store(url)
    with stalled_upload(s3, store, run_dir, tmp_path, "launcher.shutdown_timeout_s=3") as (proc, err_path, resume):
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
        err = err_path.read_text()
        print(err)
        assert proc.returncode == 128 + signal.SIGTERM
        assert committed(run_dir / "checkpoints")[-1].step == 16
        assert (f"waiting for the upload of step 16 to {url} to finish; if this rank is ended first, the checkpoint "
                f"stays committed in {run_dir / 'checkpoints'} and the next start there uploads it (the store's newest "
                f"committed: step 8)") in err
        resume()
        assert [r.step for r in store.committed()] == [8]  # what of step 16 arrived is not a checkpoint
        again = train(tmp_path, run_dir, "trainer.procs_per_node=1", "data.batch_size=32", f"checkpoint.store={url}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "the store lacks step_00000016.pt: uploading it before training goes on" in again.stderr
    assert [r.step for r in store.committed()] == [8, 16, 24]


class Link:
    """A TCP proxy in front of the S3 server, as the client's network sees it: `url` is its endpoint. It passes each
    direction on at about `bytes_per_s` (a slow network or a throttled endpoint), and `cut` ends every connection
    and refuses new ones (the server gone, as in a restart) until `restore`. `seen(pattern)` is true once the
    client sent `pattern` (a key in a request line: the upload of that object has begun)."""

    def __init__(self, upstream: str, bytes_per_s: int = 0):
        from urllib.parse import urlsplit

        target = urlsplit(upstream)
        self.target, self.bytes_per_s = (target.hostname, target.port), bytes_per_s
        self.sent, self.sockets, self.lock = b"", set(), threading.Lock()
        self.listener = socket.create_server(("127.0.0.7", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.7:{self.port}"
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            with self.lock:
                self.sockets |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b, a is client), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        chunk = 4096 if self.bytes_per_s else 65536
        try:
            while data := source.recv(chunk):
                if from_client:
                    with self.lock:
                        self.sent = (self.sent + data)[-16_000_000:]
                if self.bytes_per_s:
                    time.sleep(len(data) / self.bytes_per_s)  # the link's pace, not a wait for an event
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def seen(self, pattern: bytes) -> int:
        """How often the client sent `pattern` (in its last 16 MB)."""
        with self.lock:
            return self.sent.count(pattern)

    def cut(self) -> None:
        self.listener.close()
        with self.lock:
            ends, self.sockets = self.sockets, set()
        for end in ends:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
                end.close()

    def restore(self) -> None:
        self.listener = socket.create_server(("127.0.0.7", self.port))
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def close(self) -> None:
        self.cut()


def same_bytes_as_the_disk(records, run_dir: Path) -> None:
    from train.checkpoint.file import read_sidecar

    local = {c.step: c.path for c in committed(run_dir / "checkpoints")}
    for record in records:
        assert record.files[local[record.step].name]["sha256"] == read_sidecar(local[record.step])[0]


def test_a_store_gone_mid_upload_and_back_loses_no_commit_and_the_next_ones_are_whole(s3, bucket, tmp_path):
    """Every connection to the store ends while step 16's upload is on its way, and new ones are refused (the
    server restarting), until the rank has said what became of that upload. Training never stops; whatever of step
    16 arrived is no checkpoint unless committed whole; step 24 is uploaded and committed after the server is back,
    and every commit holds the disk's bytes."""
    link = Link(s3["env"]["AWS_ENDPOINT_URL"], 200_000)  # slow enough to be cut mid-upload (0.2 MB per checkpoint)
    url, run_dir = f"{bucket}/restarted", tmp_path / "run"
    store = Store(url)
    command = [sys.executable, "-m", "launcher", *IDENTITY, "checkpoint.every_steps=8", "trainer.procs_per_node=1",
               "data.batch_size=32", f"checkpoint.store={url}", f"hydra.run.dir={run_dir}"]
    err_path = tmp_path / "stderr.txt"
    said = ("the upload of step_00000016.pt to", "waiting for the upload of step 16 to")
    try:
        with open(err_path, "w") as err_file, subprocess.Popen(
                command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=err_file, text=True,
                env={**os.environ, "AWS_ENDPOINT_URL": link.url, "STEP_DELAY_MS": "100",
                     "PYTHONPATH": str(Path(__file__).parent / "faults")}) as proc:
            try:
                request = b"/restarted/step_00000016.pt/step_00000016.pt"
                wait_for(lambda: link.seen(request), timeout=120, what="the upload of step 16 to begin")
                link.cut()
                wait_for(lambda: any(line in err_path.read_text() for line in said), timeout=120,
                         what="the rank to say what became of the upload of step 16")
                link.restore()
                proc.communicate(timeout=300)
            finally:
                kill_leftovers(proc, run_dir)
    finally:
        link.close()
    err = err_path.read_text()
    print(err)
    assert proc.returncode == 0
    # s3fs sent step 16 again once the server was back, or the upload failed and said so (the next one is whole)
    assert link.seen(request) >= 2 or "the upload of step_00000016.pt to" in err
    records = store.committed()
    assert [r.step for r in records][-1] == 24 and 8 in [r.step for r in records]
    same_bytes_as_the_disk(records, run_dir)
    for record in records:  # each downloads whole: the record names only what arrived
        store.download(record, tmp_path / "check" / record.name)


def test_a_throttled_store_slows_the_saves_to_its_pace_and_every_commit_is_whole(s3, bucket, tmp_path):
    """Uploads through a link of ~100 kB/s take longer than the steps between saves: each save waits for the upload
    before it (saying so), the store never falls more than one checkpoint behind, and every commit there holds the
    disk's bytes."""
    throttle = Link(s3["env"]["AWS_ENDPOINT_URL"], 100_000)
    url, run_dir = f"{bucket}/throttled", tmp_path / "run"
    try:
        proc = train(tmp_path, run_dir, "trainer.procs_per_node=1", "data.batch_size=32", f"checkpoint.store={url}",
                     env={"AWS_ENDPOINT_URL": throttle.url})
    finally:
        throttle.close()
    assert proc.returncode == 0
    assert "waiting for the upload of step" in proc.stderr
    records = Store(url).committed()
    assert [r.step for r in records] == [8, 16, 24]
    same_bytes_as_the_disk(records, run_dir)
