"""Test-only fault injection. Python imports this file at start-up in every process whose PYTHONPATH lists this
directory; it acts only in the training worker of rank FAULT_RANK, and only in the first attempt (so an elastic
restart runs clean):

  FAULT=kill    SIGKILL itself at the start of optimizer step FAULT_STEP
  FAULT=hang    block forever at the start of optimizer step FAULT_STEP
  FAULT=config  fail while loading the config snapshot (a bad rank at start-up)
  FAULT=slow_data  wait FAULT_DELAY_MS (default 50) before each training batch of this rank: a data stall
  FAULT=slow_forward  wait FAULT_DELAY_MS (default 50) inside every training forward pass of this rank: a slow GPU
  FAULT=leave_child  start a child process (`sleep 600`) at optimizer step FAULT_STEP and go on ("[fault] left
                child PID"): a process left in the rank's process group
  FAULT=term    send itself SIGTERM at the start of optimizer step FAULT_STEP (a stop lands on a known step)
  FAULT=fail_on_stop  raise OSError where the ranks agree to stop on a signal, before the stop's save (a save that
                fails: "[fault] no space left on device ...")
  FAULT=slow_compile  wait FAULT_DELAY_MS inside optimizer step FAULT_STEP (a rank that compiles slower than the others)
  FAULT=kill_in_save  SIGKILL itself while committing the step directory of step FAULT_STEP (see the end)
  FAULT=slow_commit  wait FAULT_DELAY_MS (default 50) before committing each step directory (every attempt)
  FAULT=slow_io checkpoint reads and writes of this rank (of every rank with FAULT_RANK=all) go in 1 kB chunks,
                FAULT_DELAY_MS (default 50) each (every attempt: a slow file system, not a crash), both formats
  FAULT=stuck_io  in the first attempt, the first checkpoint shard this rank writes (a DCP .distcp file) stops after
                its first chunk and never returns (a stuck file system)
  FAULT=take_port  before it starts, this rank (another process, as it were) binds MASTER_PORT and keeps it, as a
                process that took the port between the agent's choice and rank 0's store would ("[fault] took
                MASTER_PORT P" or "[fault] MASTER_PORT P was held: ...")
  FAULT_GROUP=G   with replica groups (trainer.fault_tolerance=replicas): the fault acts in group G only
  END_DELAY_MS    with replica groups: the ranks of group END_DELAY_GROUP (default 0) wait this long, in every
                  attempt, before the run's last evaluation and save (a group slow to end), beside any FAULT
  END_WAIT_MARKER the same ranks wait there until this file exists (at most 300 s): with HEAL_MARKER the same file,
                  until a restarted group is about to ask for its first quorum
  FAULT=kill_at_end  SIGKILL itself at the run's last evaluation, after its last step (first attempt)
  RESTART_AFTER_END=RUN_DIR  with replica groups: a restarted group's ranks (a later attempt), once resumed, touch
                  RUN_DIR/restarted (END_WAIT_MARKER's file, to hold the others' end until then), wait until
                  RUN_DIR/status.json says "finished" (at most 300 s: the others ended the run while this group
                  restarted), write RUN_DIR/checkpoints-at-end.json (the sha256 of each file of RUN_DIR/checkpoints
                  then) and only then join the replica groups
  STEP_DELAY_MS   every optimizer step of every rank, in every attempt, takes this much longer (a slower model),
                  beside any FAULT; also in a SLURM task (a rank that sets RANK itself, after its start)
  TRACE_START=1 every rank, in every attempt, prints how it started, when it starts:
                "[start rank R attempt A] pid P parent Q grandparent G preloaded True|False parent's module M"
                (preloaded: torch's dynamo was imported before the rank's own code ran, i.e. it was forked from a
                process that had imported it; M: what the parent's command line runs with -m),
                then "imported A,B": which of the modules TRACE_MODULES names were imported before the rank's code
  FAULT=trace_io  every checkpoint stream of this rank (of every rank with FAULT_RANK=all) is printed as it opens:
                "[io rank R] writing step_00000003/__0_0.distcp" (what each rank reads, writes and hashes); slow_io
                prints them too
"""

import os
import sys


def replace(module, name: str, new) -> None:
    """module.name = new, in the module and in every module that imported the name from it already (a rank forked
    after the trainer was imported has it before its faults are set up)."""
    old = getattr(module, name)
    for imported in list(sys.modules.values()):
        try:
            if getattr(imported, name, None) is old:
                setattr(imported, name, new)
        except Exception:  # a module with an unusual __getattr__
            pass


def act() -> None:
    """The faults this process's environment asks for."""
    global _taken, _acted
    _acted = True
    if os.environ.get("TRACE_START"):
        parent = os.getppid()
        grandparent = open(f"/proc/{parent}/stat").read().rsplit(")", 1)[1].split()[1]
        words = open(f"/proc/{parent}/cmdline").read().split("\0")
        module = words[words.index("-m") + 1] if "-m" in words[:-1] else "-"
        imported = ",".join(name for name in os.environ.get("TRACE_MODULES", "").split(",") if name in sys.modules)
        os.write(2, f"[start rank {os.environ['RANK']} attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}] pid "
                    f"{os.getpid()} parent {parent} grandparent {grandparent} preloaded {'torch._dynamo' in sys.modules} "
                    f"parent's module {module} imported {imported or '-'}\n".encode())
    if os.environ.get("FAULT") == "take_port" and os.environ.get("RANK") == os.environ.get("FAULT_RANK", "0") \
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        import socket

        _taken = socket.socket()  # a module global: held for the life of this process
        try:
            _taken.bind(("", int(os.environ["MASTER_PORT"])))
            print(f"[fault] took MASTER_PORT {os.environ['MASTER_PORT']}", flush=True)
        except OSError as error:
            print(f"[fault] MASTER_PORT {os.environ['MASTER_PORT']} was held: {error}", flush=True)
            _taken.close()

    elif os.environ.get("FAULT") in ("slow_io", "stuck_io", "trace_io") \
            and os.environ.get("FAULT_RANK", "0") in (os.environ.get("RANK"), "all"):
        # Every checkpoint stream of a training rank is opened under Watchdog.io and reports each chunk to it: the
        # delay goes there, after every chunk (shrunk to 1 kB), for reads, writes and hashing, in both formats.
        import contextlib
        import threading

        import train.checkpoint.io
        import train.observe.watchdog

        fault, first_attempt = os.environ["FAULT"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        delay = int(os.environ.get("FAULT_DELAY_MS", "50")) / 1000 if fault == "slow_io" else 0
        stuck = fault == "stuck_io" and first_attempt
        if fault != "trace_io":
            train.checkpoint.io.CHUNK_BYTES = 1024
        watch_io = train.observe.watchdog.Watchdog.io

        @contextlib.contextmanager
        def slow_io(self, what):
            if not stuck:  # every opened stream is printed (the tests read who reads, writes and hashes what)
                # One write() per line: the ranks share stderr, and a line cut by another rank's would not parse.
                os.write(2, f"[io rank {os.environ.get('RANK')}] {what}\n".encode())
            with watch_io(self, what) as progress:
                last = [0]

                def slow(done):  # FAULT_DELAY_MS per kB moved, however the stream's user splits its calls
                    moved, last[0] = done - last[0], done
                    progress(done)
                    if stuck and what.startswith("writing") and what.endswith(".distcp"):
                        print(f"[rank {os.environ.get('RANK')}] stuck writing {what}", flush=True)
                        threading.Event().wait()
                    if delay:
                        threading.Event().wait(delay * moved / 1024)
                yield slow

        train.observe.watchdog.Watchdog.io = slow_io

    elif os.environ.get("FAULT") == "slow_commit" and os.environ.get("RANK") == os.environ.get("FAULT_RANK", "0"):
        import threading

        import train.checkpoint.dcp

        commit, delay = train.checkpoint.dcp.commit, int(os.environ.get("FAULT_DELAY_MS", "50")) / 1000

        def slow_commit(directory, meta, files):
            threading.Event().wait(delay)
            return commit(directory, meta, files)

        replace(train.checkpoint.dcp, "commit", slow_commit)

    elif (
        os.environ.get("FAULT") not in (None, "", "kill_in_save", "slow_commit", "slow_io", "stuck_io", "take_port", "kill_at_end")
        and os.environ.get("RANK") == os.environ.get("FAULT_RANK", "0")
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        and os.environ.get("REPLICA_GROUP_ID", "0") == os.environ.get("FAULT_GROUP", os.environ.get("REPLICA_GROUP_ID", "0"))
    ):
        import signal
        import subprocess
        import threading

        import train.config
        import train.step

        kind = os.environ["FAULT"]
        if kind == "config":
            def broken_load_config(path):
                raise ValueError(f"injected config error on rank {os.environ['RANK']}")

            replace(train.config, "load_config", broken_load_config)
        elif kind == "slow_data":
            import train.data.in_memory

            epoch, delay = train.data.in_memory.TrainBatches.epoch, int(os.environ.get("FAULT_DELAY_MS", "50")) / 1000

            def slow_epoch(self, *args, **kwargs):
                for batch in epoch(self, *args, **kwargs):
                    threading.Event().wait(delay)
                    yield batch

            train.data.in_memory.TrainBatches.epoch = slow_epoch
        elif kind == "slow_forward":
            import train.step

            init, delay = train.step.ForwardClock.__init__, int(os.environ.get("FAULT_DELAY_MS", "50")) / 1000

            def slow_init(self, model, *args, **kwargs):
                init(self, model, *args, **kwargs)
                # registered after the clock's own pre-hook: the delay falls inside the timed forward
                def stall(module, args):  # returns None: a pre-hook's return value would replace the input
                    if train.step.torch.is_grad_enabled():
                        threading.Event().wait(delay)

                model.register_forward_pre_hook(stall)

            train.step.ForwardClock.__init__ = slow_init
        elif kind == "fail_on_stop":
            import train.stopping

            agreed = train.stopping.StopRequest.agreed

            def failing_agreed(self, step):
                if agreed(self, step):
                    raise OSError(f"[fault] no space left on device for the stop's checkpoint (rank {os.environ['RANK']})")
                return False

            train.stopping.StopRequest.agreed = failing_agreed
        else:
            train_step, calls = train.step.train_step, [0]

            def faulty_train_step(*args, **kwargs):
                calls[0] += 1
                if calls[0] == int(os.environ["FAULT_STEP"]):
                    if kind == "slow_compile":
                        threading.Event().wait(int(os.environ.get("FAULT_DELAY_MS", "50")) / 1000)
                        return train_step(*args, **kwargs)
                    if kind == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    if kind == "leave_child":  # a process in the rank's group that would outlive it
                        child = subprocess.Popen(["sleep", "600"])
                        os.write(2, f"[fault] left child {child.pid}\n".encode())
                        return train_step(*args, **kwargs)
                    if kind == "term":
                        os.kill(os.getpid(), signal.SIGTERM)
                        return train_step(*args, **kwargs)
                    threading.Event().wait()  # hang
                return train_step(*args, **kwargs)

            replace(train.step, "train_step", faulty_train_step)

    if os.environ.get("FAULT") == "kill_in_save" and os.environ.get("RANK") == os.environ.get("FAULT_RANK", "0") \
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        # FAULT=kill_in_save: SIGKILL itself while committing the step directory of step FAULT_STEP (every rank's
        # shards written, the manifest not yet): with checkpoint.async_save, a crash in the middle of a background write.
        import signal

        import train.checkpoint.dcp

        commit = train.checkpoint.dcp.commit

        def killing_commit(directory, meta, files):
            if meta["step"] == int(os.environ["FAULT_STEP"]):
                os.kill(os.getpid(), signal.SIGKILL)
            return commit(directory, meta, files)

        replace(train.checkpoint.dcp, "commit", killing_commit)


    if os.environ.get("STEP_DELAY_MS") and os.environ.get("RANK") is not None:
        delay_steps()



    if os.environ.get("RESTART_AFTER_END") and os.environ.get("RANK") is not None \
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        # A restarted group has resumed (from the checkpoints as they were) and says so; it joins the replica groups
        # only once the others have ended the run: no Manager of it heartbeats before, so none waits for it.
        import hashlib
        import json
        import threading
        import time
        from pathlib import Path

        import train.fault_tolerance

        _build_replicas, _run_dir = train.fault_tolerance.build_replicas, Path(os.environ["RESTART_AFTER_END"])

        def build_replicas_after_end(*args, **kwargs):
            (_run_dir / "restarted").touch()
            deadline, status = time.monotonic() + 300, _run_dir / "status.json"
            while time.monotonic() < deadline and '"finished"' not in (status.read_text() if status.exists() else ""):
                threading.Event().wait(0.05)
            if os.environ["RANK"] == "0":
                digests = {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
                           for path in sorted((_run_dir / "checkpoints").iterdir()) if path.is_file()}
                (_run_dir / "checkpoints-at-end.json").write_text(json.dumps(digests))
            return _build_replicas(*args, **kwargs)

        replace(train.fault_tolerance, "build_replicas", build_replicas_after_end)

    if os.environ.get("HEAL_MARKER") and os.environ.get("RANK") is not None:
        # A restarted replica group writes HEAL_MARKER just before it asks for its first quorum; group 0 holds its
        # quorum of step HEAL_BEFORE_STEP until then (at most 300 s): the heal lands before the run's end however
        # slow the restart is (its imports under load), without a timing assumption.
        import threading
        import time
        from pathlib import Path

        import train.fault_tolerance

        _join, _marker = train.fault_tolerance.ReplicaGroups.join_step, Path(os.environ["HEAL_MARKER"])
        _hold_at, _joins = int(os.environ.get("HEAL_BEFORE_STEP", "0")), [0]
        _restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"

        def join_step(self):
            _joins[0] += 1
            if _restarted:
                _marker.touch()
            elif os.environ.get("REPLICA_GROUP_ID", "0") == "0" and _joins[0] >= _hold_at:
                deadline = time.monotonic() + 300
                while not _marker.exists() and time.monotonic() < deadline:
                    threading.Event().wait(0.05)
            return _join(self)

        train.fault_tolerance.ReplicaGroups.join_step = join_step

    if os.environ.get("QUORUM_DELAY_MS") and os.environ.get("RANK") is not None \
            and os.environ.get("REPLICA_GROUP_ID", "0") == os.environ.get("QUORUM_DELAY_GROUP", "1"):
        # This group is busy elsewhere (alive, heartbeating) for QUORUM_DELAY_MS before it asks for the quorum of
        # its QUORUM_DELAY_AT-th step: the other groups wait for it in theirs.
        import threading

        import train.fault_tolerance

        _join_late, _late_at, _late_joins = train.fault_tolerance.ReplicaGroups.join_step, \
            int(os.environ.get("QUORUM_DELAY_AT", "5")), [0]

        def late_join_step(self):
            _late_joins[0] += 1
            if _late_joins[0] == _late_at:
                os.write(2, f"[fault] group {os.environ.get('REPLICA_GROUP_ID')} busy before its quorum\n".encode())
                threading.Event().wait(int(os.environ["QUORUM_DELAY_MS"]) / 1000)
            return _join_late(self)

        train.fault_tolerance.ReplicaGroups.join_step = late_join_step

    _group = os.environ.get("REPLICA_GROUP_ID", "0")
    _end_delay = int(os.environ.get("END_DELAY_MS", "0")) / 1000 if _group == os.environ.get("END_DELAY_GROUP", "0") else 0
    _end_kill = os.environ.get("FAULT") == "kill_at_end" and os.environ.get("RANK") == os.environ.get("FAULT_RANK", "0") \
        and _group == os.environ.get("FAULT_GROUP", _group) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    _end_marker = os.environ.get("END_WAIT_MARKER") if _group == os.environ.get("END_DELAY_GROUP", "0") else None
    if (_end_delay or _end_kill or _end_marker) and os.environ.get("RANK") is not None:
        import signal
        import threading
        import time

        import train.loop

        _evaluate = train.loop.evaluate_and_save

        def late_evaluate_and_save(run, *args, **kwargs):
            if run.progress.step >= run.plan.stop_step:
                if _end_kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                threading.Event().wait(_end_delay)
                deadline = time.monotonic() + 300
                while _end_marker and not os.path.exists(_end_marker) and time.monotonic() < deadline:
                    threading.Event().wait(0.05)
            return _evaluate(run, *args, **kwargs)

        replace(train.loop, "evaluate_and_save", late_evaluate_and_save)


_acted = False
_delayed = False


def delay_steps() -> None:
    """STEP_DELAY_MS: every optimizer step of this process takes that much longer (once per process)."""
    global _delayed
    if _delayed:
        return
    _delayed = True
    import threading

    import train.step

    _step, _step_delay = train.step.train_step, int(os.environ["STEP_DELAY_MS"]) / 1000

    def delayed_train_step(*args, **kwargs):
        threading.Event().wait(_step_delay)
        return _step(*args, **kwargs)

    replace(train.step, "train_step", delayed_train_step)


def act_in_rank() -> None:
    """A rank forked by a process that set its environment before the fork: act then, once (not again in the
    processes the rank forks itself, such as its loader workers)."""
    if not _acted and os.environ.get("RANK") is not None:
        act()


if os.environ.get("RANK") is not None:
    act()  # a rank, started as its own process
else:  # the launcher, or a process that forks a rank after setting its variables
    os.register_at_fork(after_in_child=act_in_rank)
    if os.environ.get("STEP_DELAY_MS") and os.environ.get("SLURM_STEP_ID") is not None:
        delay_steps()  # a SLURM task: a rank that sets RANK itself, after its start (the other faults need RANK)

if os.environ.get("SIGINT_AT_IMPORT") and os.environ.get("RANK") is None:
    # The launcher gets Ctrl-C (SIGINT) while it imports this module (torch, by default): a user's Ctrl-C in the
    # first second of a launch, at a point that does not depend on timing.
    class _InterruptAtImport:
        def find_spec(self, name, path=None, target=None):
            if name == os.environ["SIGINT_AT_IMPORT"]:
                sys.meta_path.remove(self)
                import signal

                os.kill(os.getpid(), signal.SIGINT)
            return None

    sys.meta_path.insert(0, _InterruptAtImport())
