"""What the suite's CPU goes to (a pytest plugin: tests/conftest.py pytest_plugins). The suite is CPU-bound on CI's
2 cores, so what to make cheaper is read in CPU, not in durations, which include waits: each test's own and its
processes' CPU as the junit property `cpu_s` (`python tests/file_seconds.py --cpu junit.xml`), with when and on which
worker it ran (`--lanes`); after the run, how busy the cores were and what the test clusters' daemons took.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from train.host import descendants


def cpu_times() -> tuple[float, float]:
    """(busy, all) seconds of every core since boot (/proc/stat's first line, in clock ticks)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle and iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


SESSION_CPU = pytest.StashKey[tuple]()


def pytest_sessionstart(session):
    session.config.stash[SESSION_CPU] = cpu_times()


@pytest.hookimpl(trylast=True)  # after the conformance matrix's table (tests/conftest.py)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if SESSION_CPU in config.stash and Path("/proc/stat").exists():
        # Whether the cores were the limit: the suite is CPU-bound when this is near 100% (tests/lanes.py)
        (busy0, all0), (busy1, all1) = config.stash[SESSION_CPU], cpu_times()
        terminalreporter.write_line(f"the machine's cores were busy {100 * (busy1 - busy0) / max(all1 - all0, 1e-9):.0f}% "
                                    f"of this session ({busy1 - busy0:.0f} s of CPU, {os.cpu_count()} cores)")
        outside = cpu_outside_the_tests()
        if outside:
            terminalreporter.write_line("CPU of the test clusters since they started (their jobs' processes "
                                        "included): " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in outside))


def cpu_outside_the_tests() -> list[tuple[str, float]]:
    """The CPU of the Ray and SLURM test clusters' processes alive now (their daemons, and through them the jobs
    they ran and reaped), pytest's own excluded: what the tests' own `cpu_s` cannot see."""
    ours, hz, found = {os.getpid(), *descendants(os.getpid())}, os.sysconf("SC_CLK_TCK"), {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in ours:
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()
        kind = "Ray" if "ray" in command or name in ("raylet", "gcs_server") else "SLURM" if "slurm" in name else None
        if kind:
            found[kind] = found.get(kind, 0.0) + sum(int(x) for x in fields[11:15]) / hz  # utime stime cutime cstime
    return sorted(found.items(), key=lambda item: -item[1])


def cpu_used() -> float:
    """This process's CPU and that of its children it waited for (and theirs), in seconds."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


SETUP_CPU = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures: the module and session fixtures it is the first to ask for (reference runs,
    servers) count in its `cpu_s`, not in nobody's."""
    item.stash[SETUP_CPU] = cpu_used()


@pytest.fixture(autouse=True)
def _cpu_seconds(request, record_property):
    """The CPU a test took, its own process's and that of the processes it started and waited for (launchers and,
    through them, their ranks; not what a Ray or SLURM daemon runs for it), with its fixtures' setup, as the junit
    property `cpu_s`. The suite is CPU-bound on 2 cores (wall ~ the tests' seconds / 3 workers), so what to make
    cheaper is read here, not from the durations, which include waits: `python tests/file_seconds.py --cpu
    junit.xml`."""
    before, started = request.node.stash.get(SETUP_CPU, cpu_used()), time.time()
    yield
    record_property("cpu_s", round(cpu_used() - before, 1))
    # when and where it ran: the workers' timelines (which lane waited, which ended last)
    record_property("started", round(started, 1))
    record_property("worker", os.environ.get("PYTEST_XDIST_WORKER", "-"))
