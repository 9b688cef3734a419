"""Seeing inside a run, in one process: what a tracker draws as a curve, the hang summary's reading of the ranks'
reports, the NCCL flight recorder's settings, and a tracker catching up from metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys

from train.observe.hang import HangReports, flight_recorder_env, summary
from train.observe.metrics import Metrics, curves
from train.observe.watchdog import HANG_EXIT_CODE


def test_curves_are_what_changes_and_the_same_tags_everywhere():
    train = {"loss": 0.5, "lr": 0.1, "samples_per_s": 900.0, "epoch": 1.5, "restarts": 1, "step_time_slowest_rank": 3}
    assert curves("train", train) == {"train/loss": 0.5, "train/lr": 0.1, "train/samples_per_s": 900.0}
    assert curves("eval", {"acc": 0.9, "loss": 0.3, "epoch": 2.0}) == {"eval/acc": 0.9, "eval/loss": 0.3}
    assert curves("checkpoint", {"stall_s": 0.2, "async": 1.0}) == {"train/checkpoint_stall_s": 0.2}
    assert curves("checkpoint", {"load_s": 3.0}) == {} and curves("memory", {"rank0_param_mb": 1.0}) == {}


def report(rank: int, collectives: int, where: str) -> dict:
    return {"rank": rank, "host": "node1", "pid": 100 + rank, "collectives": collectives, "where": where,
            "step": 7, "activity": "training", "idle_s": 300.0, "stacks": f"<stack of rank {rank}>"}


def test_the_summary_names_the_ranks_behind_and_those_that_did_not_answer():
    reports = [report(0, 42, "loss.backward"), report(1, 41, "data.py:10 in next"), report(3, 42, "all_reduce")]
    text = summary(reports, world_size=4)
    assert "3 of 4 ranks answered" in text
    assert "behind: rank 1 (41 collectives done; the others up to 42" in text
    assert "no report from rank 2" in text
    assert "data.py:10 in next <- behind" in text
    assert "stacks of rank 1:\n<stack of rank 1>" in text and "<stack of rank 0>" not in text

    level = summary([report(0, 42, "a"), report(1, 42, "b")], world_size=2)
    assert "no rank is behind in collectives (all at 42)" in level and "stacks of rank 0" in level


def test_ranks_join_one_incident_and_an_earlier_attempts_request_is_not_theirs(tmp_path):
    first, second = HangReports(tmp_path, 0, 2), HangReports(tmp_path, 1, 2)
    incident = first.open_incident()
    assert second.open_incident() == incident and first.opened(incident) and not second.opened(incident)
    second.answer_request({"step": 3})
    assert json.loads((tmp_path / "hang" / incident / "rank1.json").read_text())["step"] == 3
    first.summarise(incident, first.gather(incident, wait_s=0))
    assert not (tmp_path / "hang" / "request").exists()  # answered

    (tmp_path / "hang" / "request").write_text("20200101-000000-rank0\n")  # left by an attempt that died
    later = HangReports(tmp_path, 1, 2)
    later.started += 10  # this attempt started after the request was written
    assert later.open_incident() != "20200101-000000-rank0"


def test_the_flight_recorder_dumps_into_the_run_directory_unless_the_user_set_it(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    env = flight_recorder_env(tmp_path)
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "hang" / "nccl_trace_rank_")
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in env


class Recorder:
    """A tracker that keeps what it is sent (and holds nothing yet: added on resume, or lost it in a crash)."""

    holds_through = -1

    def __init__(self):
        self.sent = []

    def scalars(self, values, step):
        self.sent.append((step, values))

    def text(self, tag, text, step):
        pass

    def close(self):
        pass


def test_a_tracker_behind_the_resumed_step_gets_the_records_up_to_it_from_metrics_jsonl(tmp_path):
    lines = [{"kind": "train", "step": s, "time": 0, "loss": 1 / s, "epoch": s / 4} for s in (2, 4, 6, 8)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    tracker = Recorder()
    metrics = Metrics(tmp_path, start_step=5, trackers=[tracker])  # resumed at step 5: 6 and 8 are dropped
    metrics.log("train", 6, {"loss": 0.1})
    metrics.close()
    assert tracker.sent == [(2, {"train/loss": 0.5}), (4, {"train/loss": 0.25}), (6, {"train/loss": 0.1})]


def test_a_scripts_first_report_at_step_0_is_drawn(tmp_path, monkeypatch):
    """ddp_loop.report(0, ...) of a fresh run was never drawn into the trackers: the follower counted step 0 as drawn."""
    from train.observe import follow

    tracker = Recorder()
    monkeypatch.setattr(follow, "build_trackers", lambda loggers, run: [tracker])
    (tmp_path / "config.yaml").write_text("name: mine\nprogram: {name: script}\ntrainer: {procs_per_node: 1}\n")
    lines = [{"kind": "train", "step": s, "time": 0, "loss": 1.0 + s} for s in (0, 1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    follow.follow(tmp_path, 0, ended=lambda wait_s: True)
    assert [step for step, _ in tracker.sent] == [0, 1, 2]


def tensorboard_steps(run_dir) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return [event.step for event in events.Scalars("train/loss")]


def test_tensorboard_holds_what_it_flushed_and_is_given_the_rest_after_a_kill(tmp_path):
    """Issue 61, F10: a script's follower ended by a SLURM requeue before drawing its last reports left TensorBoard
    without them for good (steps 29-33 missing while metrics.jsonl had them): the tracker claimed to hold every step
    up to the one resumed from. It now holds what it flushed (RUN_DIR/trackers/), and the resumed attempt's catch-up
    draws the rest from metrics.jsonl. And a fresh run holds nothing: a script's step 0 is drawn."""
    from train.observe.trackers import TensorBoard, TrackedRun

    lines = [{"kind": "train", "step": s, "time": 0, "loss": 1.0 / (s + 1)} for s in range(0, 34)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    first = Metrics(tmp_path, start_step=-1, trackers=[TensorBoard(TrackedRun(tmp_path, "run", 0, {}))], cut_back=False)
    for record in lines[:29]:  # drawn as a follower draws them (steps 0-28); 29-33 reported, then the requeue's kill
        first.draw("train", record["step"], {"loss": record["loss"]})
    # (no close: the process was killed)
    again = Metrics(tmp_path, start_step=33, trackers=[TensorBoard(TrackedRun(tmp_path, "run", 33, {}))], cut_back=False)
    again.close()
    assert tensorboard_steps(tmp_path) == list(range(0, 34))  # each once, 0 included


class FakeStore:
    """The calls of a c10d store that train/observe/peers.py makes, in memory; `answers=False`: it hangs up."""

    def __init__(self):
        self.keys, self.answers = {}, True

    def _up(self):
        if not self.answers:
            raise RuntimeError("Connection reset by peer")

    def add(self, key, value):
        self._up()
        self.keys[key] = int(self.keys.get(key, b"0")) + value
        self.keys[key] = str(self.keys[key]).encode()
        return int(self.keys[key])

    def check(self, keys):
        self._up()
        return all(k in self.keys for k in keys)

    def get(self, key):
        self._up()
        return self.keys[key]

    def set(self, key, value):
        self._up()
        self.keys[key] = value.encode() if isinstance(value, str) else value


def test_a_rank_gone_without_closing_its_sockets_ends_the_others_wait(monkeypatch):
    """A node that vanished (power, network) during a checkpoint wait left the survivors waiting up to 24 h: nothing
    broke their connection. Rank 0 names a rank whose sign of life stood still for the limit; a waiting rank ends."""
    from train.observe import peers as module

    clock = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    store = FakeStore()
    ranks = [module.Peers(r, 3, limit_s=30, connect=lambda: store) for r in range(3)]
    for _ in range(3):  # every rank ticks: alive
        clock[0] += 5
        assert all(p.tick(waiting=True) is None for p in ranks)
    # Rank 0 saw rank 2's count move last at its round's next look (t=1020); rank 2 is gone from t=1015.
    for _ in range(7):  # up to 30 s of no sign of life: not past the limit
        clock[0] += 5
        assert [p.tick(waiting=True) for p in ranks[:2]] == [None, None]
    clock[0] += 5
    ended = [p.tick(waiting=True) for p in ranks[:2]]
    assert all("rank(s) [2] showed no sign of life for 35 s" in reason for reason in ended), ended
    assert ranks[1].tick(waiting=False) is None  # a rank not waiting on the others is not ended by this


def test_a_rank_that_cannot_reach_rank_0s_store_for_the_limit_ends_its_wait(monkeypatch):
    from train.observe import peers as module

    clock = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    store = FakeStore()
    waiting = module.Peers(1, 2, limit_s=30, connect=lambda: store)
    assert waiting.tick(waiting=True) is None
    store.answers = False  # rank 0's node gone: its store with it
    clock[0] += 20
    assert waiting.tick(waiting=True) is None  # one unanswered call is no verdict
    store.answers = True
    clock[0] += 20
    assert waiting.tick(waiting=True) is None  # it answered again: the watch goes on with a fresh client
    store.answers = False
    clock[0] += 31
    assert "has not answered for 31 s" in waiting.tick(waiting=True)


def test_a_rank_that_never_ticked_is_not_judged(monkeypatch):
    from train.observe import peers as module

    clock = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    store = FakeStore()
    first = module.Peers(0, 2, limit_s=30, connect=lambda: store)
    for _ in range(20):  # rank 1 still starting for 100 s: the start-up's own watch covers it
        clock[0] += 5
        assert first.tick(waiting=True) is None


def test_a_rank_whose_store_call_failed_once_reads_the_store_again_later(tmp_path, monkeypatch):
    """One unanswered call made a rank read RUN_DIR/hang/request alone for good: it missed the request the others
    posted in the store and was reported silent."""
    from train.observe import hang

    clock = [1000.0]
    monkeypatch.setattr(hang.time, "monotonic", lambda: clock[0])
    store = FakeStore()
    reports = hang.HangReports(tmp_path, 1, 2, store=store, connect=lambda: store)
    store.answers = False
    assert reports._fresh_request() is None and reports.store is None  # fell back to the file
    store.answers = True
    store.set(hang.REQUEST, "20261128-000000-rank0")
    assert reports._fresh_request() is None  # not asked again at once (a frozen server costs a wait per call)
    clock[0] += hang.STORE_RETRY_S
    assert reports._fresh_request() == "20261128-000000-rank0"


def test_store_calls_reuse_one_thread_and_a_stuck_call_is_left_to_its_own(monkeypatch):
    """The watchdogs' store calls started and ended a thread each, every tick. A fork while one started or ended (a
    DataLoader starting an evaluation's workers) inherited CPython's thread-state lock held, and the worker blocked
    forever on it (python/cpython#112275, Python up to 3.11.x): CI's image-folder run hung at an evaluation."""
    import threading

    from conftest import wait_for
    from train.observe.hang import StoreCalls

    started, start = [], threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda thread: started.append(thread.name) or start(thread))
    calls, store = StoreCalls("test-store-calls"), {"a": 1}
    for _ in range(50):
        assert calls(store, lambda s: s["a"], 5) == (True, 1)
    assert started == ["test-store-calls"]  # one thread for 50 calls, started with the caller
    release = threading.Event()
    assert calls(store, lambda s: release.wait(), 0.2) == (False, None)  # a frozen server: unanswered in time
    assert calls(store, lambda s: s["a"], 5) == (True, 1)  # answered by a fresh thread
    assert calls(store, lambda s: s["missing"], 5) == (False, None)  # a call that fails is unanswered too
    assert started == ["test-store-calls"] * 2

    def serving() -> int:
        return sum(t.name == "test-store-calls" for t in threading.enumerate())

    release.set()  # the stuck call returns: its thread ends, the fresh one stays
    wait_for(lambda: serving() == 1, timeout=10, what="the stuck thread to end once its call returned")


def test_a_hang_tells_its_reason_to_the_owner_before_it_ends_the_rank(tmp_path):
    # A SLURM task is its own rank, with no agent to see exit code 70 and say why: the watchdog tells the task first.
    said = tmp_path / "said.txt"
    program = ("import time\nfrom train.observe.watchdog import Watchdog\n"
               f"Watchdog(1, 0.4, on_hang=lambda reason: open({str(said)!r}, 'w').write(reason))\n"
               "time.sleep(120)\n")
    ended = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=100)
    assert ended.returncode == HANG_EXIT_CODE, ended.stderr[-2000:]
    assert "[rank 1] no progress for" in said.read_text() and "trainer.hang_timeout_s=0.4" in said.read_text()


def test_the_done_lines_give_the_final_and_the_best_figure_and_what_to_do_next(tmp_path):
    """A newcomer reads the best accuracy and the final one apart, how to watch the run, and how to train on: to the
    end of its schedule (a max_steps run resumes) or longer (a new run from its weights: longer epochs reshape the
    lr schedule)."""
    from types import SimpleNamespace

    from train.observe.console import run_summary

    (tmp_path / "tb").mkdir()
    best = tmp_path / "checkpoints" / "best.pt"
    plan = SimpleNamespace(stop_step=40, total_steps=96, global_batch=32, replicas=2)
    progress = SimpleNamespace(step=40, best_metric=0.92, best_step=32)
    cut = run_summary(plan, progress, "acc", best, 40, 4.0, 0, final={"acc": 0.9, "loss": 0.3}, run_dir=tmp_path)
    assert "; final acc 90.00%, best acc 92.00% at step 32: " + str(best) in cut
    assert f"next: watch it: tensorboard --logdir {tmp_path / 'tb'}; train on to the end of its schedule (step 96): " \
           "the same command with trainer.max_steps=-1 (it resumes from step 40)" in cut
    plan.stop_step = progress.step = 96
    whole = run_summary(plan, progress, "acc", best, 96, 4.0, 0, final={"acc": 0.9}, run_dir=tmp_path)
    assert f"train longer: a new run from these weights, with checkpoint.init_from={best}" in whole
