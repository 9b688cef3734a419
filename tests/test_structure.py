"""How the code hangs together: imports run one way (launcher -> train), and the launcher's modules import each
other without a cycle, counting imports inside functions (a cycle held together by them is still a cycle)."""

from __future__ import annotations

import ast
import os

import pytest

from conftest import REPO


def imports_of(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports, at the top or inside a function."""
    graph = {}
    for path in sorted((REPO / package).glob("**/*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            found.update(n for n in names if n == package or n.startswith(package + "."))
        graph[module] = found - {module}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (the modules in order), or []."""
    state, path = {}, []

    def visit(module: str) -> list[str]:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[module] = "done"
        path.pop()
        return []

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return []


def test_the_launchers_modules_import_each_other_without_a_cycle():
    graph = imports_of("launcher")
    assert cycle(graph) == [], " -> ".join(cycle(graph))


# launcher/ by concern, each floor importing only those below it (and the config's types, launcher/schema.py)
FLOORS = ["launcher.run_dir", "launcher.backends", "launcher.checks", "launcher.tools"]
ENTRY = {"launcher", "launcher.__main__", "launcher.main", "launcher.schema", "launcher.jobs", "launcher.export",
         "launcher.sweep", "launcher.doctor"}  # the commands keep their short names (launcher/jobs.py: its tools/ module)


def floor(module: str) -> int:
    """A module's floor in FLOORS; the entry (main, __main__) above them all."""
    return next((i for i, f in enumerate(FLOORS) if module == f or module.startswith(f + ".")), len(FLOORS))


def test_the_launchers_folders_hold_one_concern_each_and_import_one_way():
    graph = imports_of("launcher")
    top = {m for m in graph if m.count(".") <= 1 and m.removeprefix("launcher.") not in {f.split(".")[1] for f in FLOORS}}
    assert top == ENTRY  # a new backend, check or tool goes into its folder, not beside main.py
    upward = [f"{m} -> {t}" for m, targets in graph.items() for t in targets
              if t not in ENTRY and floor(t) > floor(m)]
    assert upward == []
    assert graph["launcher.schema"] <= {"launcher"}  # the config's types depend on nothing of ours


def test_the_commands_keep_their_short_names():
    """`python -m launcher.jobs` (export, sweep, doctor): the names the docs give, each running its tools/ module."""
    import subprocess
    import sys

    for command, word in (("jobs", "status"), ("export", "--out"), ("sweep", "summary")):
        out = subprocess.run([sys.executable, "-m", f"launcher.{command}", "--help"], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0 and word in out.stdout, (command, out.stdout, out.stderr)


def test_no_lower_floor_of_train_reaches_up_to_the_run():
    """train.parts.Run (everything a run is made of) is assembled by train.run and used by the loop; the floors below
    (checkpoint/, observe/, data/, parallel/, ...) take the parts they need, not the run, not even for typing (an
    import under TYPE_CHECKING counts): no cycle through the hub. A submodule importing its own package (whose
    __init__ re-exports it) is the usual Python package, not counted."""
    graph = imports_of("train")
    assert {m for m, targets in graph.items() if "train.parts" in targets} <= {"train.run", "train.loop"}
    assert {m for m, targets in graph.items() if "train.run" in targets} <= {"train.__main__"}
    own_packages = {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in graph.items()}
    assert cycle(own_packages) == [], " -> ".join(cycle(own_packages))


def test_train_never_imports_the_launcher():
    assert not {m: t for m, t in imports_of("train").items() if any(x.startswith("launcher") for x in t)}
    assert not [m for m, targets in imports_of("train").items() if any("submitit" in t or "hydra.main" in t for t in targets)]


def test_a_ddp_launch_does_not_import_what_only_sharding_needs():
    """torch.distributed.tensor (DTensor) takes ~0.4 s to import: the launcher of every run paid it once train.build
    imported meta_init at its top."""
    import subprocess
    import sys

    modules = ["launcher.main", "launcher.backends.local", "launcher.checks.validate", "launcher.checks.one_batch",
               "launcher.tools.summary", "launcher.checks.forecast", "train.build"]
    script = f"import sys; import {', '.join(modules)}; print('torch.distributed.tensor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_jobs_command_runs_without_torch(tmp_path):
    """`python -m launcher.jobs status|logs|cancel` reads a run's files and asks its scheduler: importing torch cost it
    ~1.5 s of CPU per call (through train.observe.metrics, for a type annotation), then ~2 s once it asked every
    backend, the local one importing torch's elastic agent with its module."""
    import subprocess
    import sys

    script = ("import sys, contextlib, io, launcher.tools.jobs as jobs\n"
              "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
              "    codes = [jobs.main([command, sys.argv[1]]) for command in ('status', 'logs', 'cancel')]\n"
              "print(codes, sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 2, 0] []"  # logs: no job and no rank log in an empty directory


def test_the_collector_is_off_only_while_a_process_imports():
    """The launcher and the ranks import with the garbage collector off (~0.45 s of CPU per process): it must be on
    again once their imports are done, or every object cycle a run makes would stay until exit."""
    import subprocess
    import sys

    script = ("import gc, launcher.__main__ as launcher, train.__main__, train.host; off = gc.isenabled(); "
              "train.host.freeze_imported_objects(); print(off, gc.isenabled())")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
    source = (REPO / "launcher" / "__main__.py").read_text()
    cli = source[source.index("def cli"):]
    assert cli.index("gc.enable()") < cli.index("main()")  # the launcher turns it on before it does anything else


def test_our_other_processes_import_torch_out_of_the_collectors_sight_and_collect_after():
    """An export, an agent of a replica group or of a Ray node, a SLURM task, a forecast: each imports torch after its
    start; with the collector on, torch's import set off collections over all it made so far (0.1-0.25 s of CPU per
    process; train.host.untracked_imports)."""
    import subprocess
    import sys

    script = ("import gc, sys, launcher.export; "
              "print(gc.isenabled(), gc.get_freeze_count() > 100_000, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True"]
    for entry in ("launcher/backends/replicas.py", "launcher/backends/node.py", "launcher/backends/slurm_task.py"):
        assert "with untracked_imports():" in (REPO / entry).read_text(), entry


def test_ci_waits_for_a_cluster_still_starting_and_names_the_log_of_one_that_failed(tmp_path, monkeypatch):
    """.ci/run starts the test clusters beside the install; a cluster's tests wait for its start to end, and a
    failed start fails them with its log instead of a bare "no cluster answers"."""
    import threading

    from conftest import cluster_started

    monkeypatch.setenv("CI_CLUSTERS", str(tmp_path))
    (tmp_path / "ray.log").write_text("ray start: the GCS did not come up\n")
    finish = threading.Timer(0.2, lambda: (tmp_path / "ray.status").write_text("0\n"))
    finish.start()
    cluster_started("ray")  # returns once the status is there
    assert (tmp_path / "ray.status").exists()
    (tmp_path / "slurm.log").write_text("apt-get: unable to fetch slurmctld\n")
    (tmp_path / "slurm.status").write_text("100\n")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)slurm test cluster did not start \(exit 100.*unable to fetch"):
        cluster_started("slurm")
    monkeypatch.delenv("CI_CLUSTERS")
    cluster_started("slurm")  # outside CI: nothing to wait for (the fixture then asks the cluster itself)


def test_ci_stops_the_ray_cluster_once_every_test_marked_for_it_has_run(tmp_path, monkeypatch):
    """Idle, the Ray test cluster's daemons took ~4 s of CPU a minute to the end of the suite (tests/ci_clusters.py):
    CI stops it after the last test marked ray_cluster, on whichever worker that ran, once; a test that asks for it
    later fails naming the mark."""
    import ci_clusters

    stops = tmp_path / "stops"
    monkeypatch.setattr(ci_clusters, "STOP_RAY", ["sh", "-c", f"echo stop >> {stops}"])
    monkeypatch.setenv("CI_CLUSTERS", str(tmp_path))
    (tmp_path / "ray.status").write_text("0\n")
    marked = {"tests/test_ray.py::test_a", "tests/conformance/test_matrix.py::test_cell[ray-ddp-fail]"}
    ci_clusters.ray_test_done("tests/test_x.py::test_unmarked", marked)
    ci_clusters.ray_test_done("tests/test_ray.py::test_a", marked)
    ci_clusters.cluster_started("ray")  # one marked test left: the cluster stays
    assert not stops.exists()
    ci_clusters.ray_test_done("tests/conformance/test_matrix.py::test_cell[ray-ddp-fail]", marked)
    ci_clusters.ray_test_done("tests/conformance/test_matrix.py::test_cell[ray-ddp-fail]", marked)  # another worker's
    assert stops.read_text() == "stop\n"
    with pytest.raises(pytest.fail.Exception, match=r"stopped after the last test marked @pytest.mark.ray_cluster"):
        ci_clusters.cluster_started("ray")
    monkeypatch.delenv("CI_CLUSTERS")
    ci_clusters.ray_test_done("tests/test_ray.py::test_a", marked)  # outside CI: a cluster started by hand stays
    assert stops.read_text() == "stop\n"


@pytest.mark.alone
def test_an_alone_test_and_what_it_starts_run_prioritized_where_the_process_may_raise_its_priority():
    """As root (CI) an `alone` test runs at nice -10 beside the other test (tests/conftest.py _alone_if_timed),
    its launches too; elsewhere at the pytest run's own priority, with no other test beside it."""
    import subprocess
    import sys

    from conftest import may_raise_priority

    expected = os.getpriority(os.PRIO_PROCESS, os.getppid()) - (10 if may_raise_priority() else 0)
    assert os.getpriority(os.PRIO_PROCESS, 0) == expected
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
                           capture_output=True, text=True, check=True)
    assert int(child.stdout) == expected


def test_the_longest_test_files_are_handed_out_first_an_unknown_one_before_them():
    """pytest-xdist hands out whole files in collection order (tests/file_seconds.py): a long file handed out last
    would leave one worker running it alone at the end of the run."""
    from file_seconds import longest_first, measured

    ids = ["tests/a.py::x", "tests/b.py::y", "tests/a.py::z", "tests/new.py::w", "tests/c.py::v"]
    seconds = {"tests/a.py": 5.0, "tests/b.py": 50.0, "tests/c.py": 5.0}
    assert longest_first(ids, seconds) == ["tests/new.py::w", "tests/b.py::y", "tests/a.py::x", "tests/a.py::z", "tests/c.py::v"]
    missing = [file for file in measured() if not (REPO / file).exists()]
    assert not missing, f"tests/file_seconds.json names files that are gone: {missing}; refresh it (tests/file_seconds.py)"


class FakeWorker:
    """A pytest-xdist worker as the scheduler sees it: it runs the tests it is sent, but its last one only once it is
    sent more or shut down (xdist needs the next test to tear down fixtures)."""

    def __init__(self, number: int, collection: list[str]):
        self.gateway = type("Gateway", (), {"id": f"gw{number}"})()
        self.collection, self.queue, self.ran, self.shutting_down = collection, [], [], False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.queue += [self.collection[i] for i in indices]

    def shutdown(self) -> None:
        self.shutting_down = True

    def run_one(self) -> str | None:
        if len(self.queue) > 1 or (self.queue and self.shutting_down):
            self.ran.append(self.queue.pop(0))
            return self.ran[-1]
        return None


def run_lanes(workers: int, collection: list[str]) -> list[FakeWorker]:
    """Schedules `collection` with tests/lanes.py over fake workers, as xdist's session loop does; returns them."""
    from lanes import Lanes

    config = type("Config", (), {"getvalue": lambda self, name: [f"{workers}*popen"],
                                 "option": type("Option", (), {"loadscopereorder": False})()})()
    scheduler = Lanes(config)
    nodes = [FakeWorker(n, collection) for n in range(workers)]
    for node in nodes:
        scheduler.add_node(node)
        scheduler.add_node_collection(node, collection)
    scheduler.schedule()
    progress = True
    while progress and not scheduler.tests_finished:
        progress = False
        for node in nodes:
            if (nodeid := node.run_one()) is not None:
                scheduler.mark_test_complete(node, collection.index(nodeid))
                progress = True
                # No worker holds its last test, unsent more, while files are left: it would keep that file's module
                # fixtures (test_slurm's lock on the cluster, which test_sweep waits for on another worker): a hang.
                assert len(node.queue) > 1 or node.shutting_down or not scheduler.workqueue, node.gateway.id
    assert scheduler.tests_finished, f"the run never ends: {[(n.gateway.id, n.queue, n.shutting_down) for n in nodes]}"
    for node in nodes:  # xdist's session shuts every worker down; each runs what it holds
        node.shutdown()
        while node.run_one() is not None:
            pass
    return nodes


def test_one_worker_runs_the_waiting_files_then_the_shortest_two_the_longest_none_idles_holding_a_test():
    collection = [f"tests/test_{name}.py::t{i}" for name in ("ray", "a", "slurm", *"bcdefgh")
                  for i in range(3 if name in ("ray", "slurm") else 5)]
    nodes = run_lanes(3, collection)
    files = {node.gateway.id: {nodeid.split("::")[0] for nodeid in node.ran} for node in nodes}
    order = list(dict.fromkeys(nodeid.split("::")[0] for nodeid in nodes[2].ran))
    assert order[:2] == ["tests/test_ray.py", "tests/test_slurm.py"]  # the waiting files first, on their own lane
    assert not {"tests/test_ray.py", "tests/test_slurm.py"} & (files["gw0"] | files["gw1"])
    queue = list(dict.fromkeys(nodeid.split("::")[0] for nodeid in collection))
    assert order[2:] and order[2:] == queue[::-1][:len(order) - 2]  # then the shortest files left, from the end
    assert sorted(nodeid for node in nodes for nodeid in node.ran) == sorted(collection)
    # with two workers, either takes any file; without waiting files the third takes the shortest from the start
    assert sorted(nodeid for node in run_lanes(2, collection) for nodeid in node.ran) == sorted(collection)
    computing = [nodeid for nodeid in collection if "_ray" not in nodeid and "_slurm" not in nodeid]
    assert run_lanes(3, computing)[2].ran[0] == "tests/test_h.py::t0"


def test_the_launcher_rank_contract_is_one_module_that_both_sides_read():
    """Every name a rank reads from its environment (TRAIN_*, LAUNCHER_*) is defined once, in train/contract.py;
    ddp_loop.py, which imports nothing of ours (a user's train.py may come first on its path), holds the same."""
    import re

    import ddp_loop
    from train import contract

    names = {value for key, value in vars(contract).items() if key.endswith("_ENV")}
    for path in (REPO / "train").rglob("*.py"):
        if path.name == "contract.py":
            continue
        literals = set(re.findall(r'"((?:TRAIN|LAUNCHER)_[A-Z_]+)"', path.read_text()))
        assert literals <= names, f"{path.relative_to(REPO)} names {sorted(literals - names)} outside train/contract.py"
    assert ddp_loop.HANG_ENV == contract.HANG_ENV and ddp_loop.ON_HANG_ENV == contract.ON_HANG_ENV
    assert ddp_loop.TRACKERS_ENV == contract.TRACKERS_ENV and ddp_loop.ALIVE == contract.ALIVE_FILE
    assert f'"{contract.RUN_DIR_ENV}"' in (REPO / "ddp_loop.py").read_text()
    assert f'"{contract.DEVICE_ENV}"' in (REPO / "ddp_loop.py").read_text()
    assert f'"{contract.ATTEMPT_ENV}"' in (REPO / "ddp_loop.py").read_text()


def test_the_private_parts_of_torch_the_agent_uses_are_the_ones_docs_code_lists():
    """docs/code.md's table of the private parts of torch's agent the launcher extends (issue 60: half of the 9 of
    before) is what launcher/backends/agent.py uses: a private member named there that the table lacks fails this,
    as `_worker_group` did before it became `get_worker_group()`."""
    import re

    source = (REPO / "launcher" / "backends" / "agent.py").read_text()
    ours = set(re.findall(r"def (_[a-z][a-z_]*)", source)) - {"_monitor_workers", "_shutdown", "_exit_barrier"}
    used = set(re.findall(r"\.(_[a-z][a-z_]*)", source)) - ours
    doc = (REPO / "docs" / "code.md").read_text()
    table = doc[doc.index("| private part of torch |"):doc.index("What the rendezvous adds")]
    listed = set(re.findall(r"`(?:\w+\.)*(_[a-z][a-z_]*)", table))
    assert used <= listed, f"agent.py uses {sorted(used - listed)}, missing from docs/code.md's table"
    assert len(re.findall(r"^\| `", table, flags=re.M)) <= 4  # rows: the goal of issue 60 was half of 9
    assert "_state_holder" not in source and "get_free_port" not in source
