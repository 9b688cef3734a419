"""Several nodes without SLURM, for real: two launchers on this machine acting as two nodes (each in its own UTS
and mount namespace, with its own host name and a hosts file that names both, as slurm/test-cluster.sh does), one
rendezvous, one shared run directory."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST, final_checkpoint, wait_for

NEEDS_NAMESPACES = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare (namespaces, as CI has)"
)
pytestmark = NEEDS_NAMESPACES

RUN = [*FAST, "data=synthetic", "data.num_samples=512", "data.batch_size=16", "model=mlp", "model.hidden=[32]",
       "trainer.nodes=2", "trainer.procs_per_node=1", "trainer.max_steps=20", "trainer.eval_every=0"]


def node(name: str, hosts, overrides: list[str], cwd, log, env: dict | None = None, launch: tuple = (),
         session: bool = False):
    """`python -m launcher` (or `launch`) as node `name`: its own host name, and /etc/hosts replaced by `hosts` for
    it only; `session`: in a session of its own, as from a terminal of its own."""
    script = f'hostname {name} && mount --bind {hosts} /etc/hosts && exec "$0" "$@"'
    command = ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", script,
               *(launch or (sys.executable, "-m", "launcher")), *overrides]
    return subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=session)


@contextlib.contextmanager
def nodes(procs: list[subprocess.Popen]):
    """The node launchers started inside the block, killed if any is still running when it ends."""
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def hosts_file(folder) -> Path:
    """The hosts file every node here reads: n1 and n2 on loopback addresses of their own."""
    hosts = Path(folder) / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.0.2 n1\n127.0.0.3 n2\n")
    return hosts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_two_nodes_share_one_run_directory_and_the_first_says_what_it_waits_for(tmp_path, bucket):
    """... and keep their sharded checkpoints in an S3 store as well: each node's rank uploads the shard it wrote."""
    hosts = hosts_file(tmp_path)
    run_dir, port = tmp_path / "run", free_port()
    store = ["checkpoint.format=dcp", "checkpoint.every_steps=10", f"checkpoint.store={bucket}/rendezvous"]
    overrides = [*RUN, *store, f"launcher.rdzv_endpoint=n1:{port}", "launcher.rdzv_timeout_s=120",
                 f"hydra.run.dir={run_dir}"]
    logs = {name: tmp_path / f"{name}.log" for name in ("n1", "n2")}
    with nodes([]) as procs:
        with open(logs["n1"], "w") as log:
            procs.append(node("n1", hosts, overrides, tmp_path, log))
        wait_for(lambda: "waiting for the other 1 of 2 nodes at n1:" in logs["n1"].read_text(), timeout=60,
                 what="node n1 to say it waits for n2")
        with open(logs["n2"], "w") as log:
            procs.append(node("n2", hosts, overrides, tmp_path, log))
        codes = [p.wait(timeout=240) for p in procs]
    n1, n2 = logs["n1"].read_text(), logs["n2"].read_text()
    print(f"--- n1\n{n1}\n--- n2\n{n2}")
    assert codes == [0, 0]
    assert "is in use by another launcher" not in n1 + n2  # the second node was not refused the shared directory
    assert f"waiting for the other 1 of 2 nodes at n1:{port} (" in n1 and "launcher.rdzv_timeout_s=120" in n1
    import json

    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["world_size"] == 2 and sorted(plan["hosts"]) == ["n1", "n2"]  # one rank on each node
    assert final_checkpoint(run_dir)["step"] == 20
    from train.checkpoint.store import Store

    stored = Store(f"{bucket}/rendezvous").committed()
    assert [r.step for r in stored] == [10, 20] and {"__0_0.distcp", "__1_0.distcp"} <= set(stored[-1].files)


def test_a_second_launch_of_the_same_node_is_refused(tmp_path):
    """The shared lock admits one launcher per node: the same node twice is a mistake, refused at once."""
    from launcher.run_dir.lease import RunDirBusy
    from launcher.backends.local import hold

    with hold(tmp_path, nodes=2):
        with pytest.raises(RunDirBusy, match=f"on {socket.gethostname()}"):
            with hold(tmp_path, nodes=2):
                pass
        with pytest.raises(RunDirBusy, match="in use by another launcher"):  # a one-node run cannot join
            with hold(tmp_path, nodes=1):
                pass


def test_a_ctrl_c_while_the_other_nodes_are_awaited_ends_the_launch_at_once(tmp_path):
    """A Ctrl-C while node 0 waits for node 1 (before torch's agent takes the signals over) ended in Python's raw
    KeyboardInterrupt traceback; now a line saying what stopped, exit 130, status 'stopped'."""
    import signal

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    err = tmp_path / "stderr.txt"
    command = [sys.executable, "-m", "launcher", *FAST, "data=synthetic", "model=mlp", "trainer.nodes=2",
               "trainer.procs_per_node=1", f"launcher.rdzv_endpoint=localhost:{port}", f"hydra.run.dir={tmp_path / 'run'}"]
    # As a terminal's foreground job: SIGINT at its default (a run of the suite started in the background, `&` in a
    # script, passes it on ignored, and Python then raises no KeyboardInterrupt: the launch never saw the Ctrl-C).
    with open(err, "w") as stderr, subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr,
                                                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as proc:
        try:
            wait_for(lambda: "waiting for the other 1 of 2 nodes" in err.read_text(), timeout=120, what="node 0 to wait for node 1")
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)  # before the fix: still waiting after 30 s, and 900 s of rdzv_timeout_s to go
        finally:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT
    assert "stopped by SIGINT before the workers started" in err.read_text() and "Traceback" not in err.read_text()
    assert json.loads((tmp_path / "run" / "status.json").read_text())["status"] == "stopped"


def test_a_node_that_never_comes_ends_the_wait_at_launcher_rdzv_timeout_s(tmp_path):
    """torch's c10d rendezvous bounds the wait with its join_timeout (600 s by default), not the "timeout" the
    launcher gave it: a second node that never came kept node 0 waiting 120 s past a 25 s launcher.rdzv_timeout_s."""
    command = [sys.executable, "-m", "launcher", *FAST, "data=synthetic", "model=mlp", "trainer.nodes=2",
               "trainer.procs_per_node=1", f"launcher.rdzv_endpoint=localhost:{free_port()}",
               "launcher.rdzv_timeout_s=5", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)  # before: 600 s
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "not every node came to the rendezvous" in proc.stderr and "launcher.rdzv_timeout_s=5" in proc.stderr
    assert "Traceback" not in proc.stderr
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "failed" and "launcher.rdzv_timeout_s=5" in status["error"]


def test_an_unchanged_torchrun_script_runs_on_two_nodes_by_rendezvous(tmp_path):
    """program=script on two nodes without a scheduler: the same command on each, one rendezvous, each node's rank
    one of a world of 2 (the script's own print says so), its output written by rank 0 once."""
    shutil.copy(Path(__file__).parent / "foreign" / "own_loop" / "my_loop.py", tmp_path / "my_loop.py")
    hosts = hosts_file(tmp_path)
    run_dir, port = tmp_path / "run", free_port()
    overrides = [*FAST, "program=script", "program.script=my_loop.py", "program.args=[--epochs,1,--out,mine.pt]",
                 "trainer.nodes=2", "trainer.procs_per_node=1", f"launcher.rdzv_endpoint=n1:{port}",
                 "launcher.rdzv_timeout_s=120", f"hydra.run.dir={run_dir}"]
    logs = {name: tmp_path / f"{name}.log" for name in ("n1", "n2")}
    with nodes([]) as procs:
        for name in ("n1", "n2"):
            with open(logs[name], "w") as log:
                procs.append(node(name, hosts, overrides, tmp_path, log))
        codes = [p.wait(timeout=240) for p in procs]
    n1, n2 = logs["n1"].read_text(), logs["n2"].read_text()
    print(f"--- n1\n{n1}\n--- n2\n{n2}")
    assert codes == [0, 0]
    assert "epoch 0 loss" in n1 + n2 and "world 2 local_rank 0" in n1 + n2
    assert (tmp_path / "mine.pt").exists()
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
