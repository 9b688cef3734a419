"""Which pytest-xdist worker runs which test file: two lanes for the files that compute, one for those that wait.

The suite is CPU-bound on 2 cores, but a few files mostly wait: the Ray and SLURM files for a cluster's job to be
scheduled, a node to be declared lost, a requeue; the slow-I/O files for checkpoint reads and writes slowed on purpose
(~330 s of a ~15 min run, ~95 s of it CPU in the test processes). Under `-n 2` such a file holds one of the two
workers while it waits, and a core idles (the cores were ~81% busy). With `-n 3` and these lanes, the last worker
runs only the waiting files, beside two workers that run the rest: the waits overlap with computing instead of taking
a worker's turn (pytest 14:20 -> 12:06 on a fresh clone with the cluster files alone in the lane, 2026-11-26). Three
workers taking any file were no faster than two (three computing files at once slow each other and the timed tests).

A computing lane takes a waiting file when no other file is left (the waiting lane is busy with another). The
waiting lane, with no waiting file left, takes the shortest file left (the computing lanes take the longest), so the
lanes meet in the middle of the queue, and it never idles while files are left: a worker runs its last test only
once it is sent more or shut down, and an idle one kept test_slurm's module fixture, the cluster's lock, which
test_sweep's SLURM test waited for on another worker (the run hung). With fewer than 3 workers every worker takes
any file, longest first.
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

# Their tests wait: on the test clusters' jobs; on checkpoint I/O slowed on purpose (FAULT=slow_io, slow_commit).
WAITING = ("tests/test_ray.py", "tests/test_slurm.py", "tests/test_resume.py", "tests/test_checkpoint_io.py",
           "tests/conformance/test_matrix.py")  # its cluster cells wait for the clusters' locks and jobs


def waiting_lane(nodes: list) -> object | None:
    """The worker that runs the waiting files: the last one (gw2 of -n 3), where there are at least 3."""
    if len(nodes) < 3:
        return None
    return max(nodes, key=lambda node: int(node.gateway.id.removeprefix("gw")))


class Lanes(LoadFileScheduling):
    def _assign_work_unit(self, node) -> None:
        scopes = list(self.workqueue)  # longest first (tests/file_seconds.py)
        if not scopes:
            return
        waits = [scope for scope in scopes if scope in WAITING]
        computing = [scope for scope in scopes if scope not in WAITING]
        if node is waiting_lane(self.nodes):
            chosen = waits[0] if waits else scopes[-1]
        else:
            chosen = computing[0] if computing else scopes[0]
        work_unit = self.workqueue.pop(chosen)
        self.assigned_work.setdefault(node, {})[chosen] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])
