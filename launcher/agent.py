"""torch.distributed's local elastic agent (what torchrun runs), with two additions our users need:

- before each elastic restart, the cause is printed: which rank failed, how (exit code or signal), and the
  traceback it recorded (via `@record` in `train/__main__.py`); the count of restarts reaches the workers as
  TORCHELASTIC_RESTART_COUNT and the trainer logs it;
- a second SIGINT/SIGTERM while the workers are saving their last checkpoint kills them at once.

`run_agent` is torch's `launch_agent` minus the parts we do not use (metrics, events, health checks).
"""

from __future__ import annotations

import os
import signal
import sys

from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import LaunchConfig

# The agent turns these into SignalException and forwards them to the workers, which save and stop.
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def describe(failure: ProcessFailure) -> str:
    """One failure as a person wants to read it: how it ended, then the recorded error and traceback if any."""
    how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    message = failure.message
    if isinstance(message, dict):  # written by @record: {"message": "Type: text", "extraInfo": {"py_callstack": ...}}
        trace = message.get("extraInfo", {}).get("py_callstack", "")
        message = f"{message.get('message', '')}\n{trace}".rstrip()
    return f"{how} (pid {failure.pid}): {message}"


def root_causes(failures: dict[int, ProcessFailure]) -> list[tuple[int, ProcessFailure]]:
    """The failures that started it: ranks the agent itself stopped (SIGTERM) are consequences, not causes.

    (Error-file timestamps cannot tell: a rank killed by SIGKILL leaves no file and gets a later time.)
    """
    ranked = sorted(failures.items())
    causes = [(rank, f) for rank, f in ranked if f.exitcode != -signal.SIGTERM]
    return causes or ranked


class Agent(LocalElasticAgent):
    def _monitor_workers(self, worker_group):
        result = super()._monitor_workers(worker_group)
        if result.is_failed() and self._remaining_restarts > 0:
            spec = worker_group.spec
            number = spec.max_restarts - self._remaining_restarts + 1
            for rank, failure in root_causes(result.failures):
                print(f"rank {rank} failed, {describe(failure)}", file=sys.stderr, flush=True)
            print(
                f"restarting the workers (restart {number} of {spec.max_restarts}); training resumes from the "
                f"newest checkpoint",
                file=sys.stderr,
                flush=True,
            )
        return result

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # While the workers save and stop (up to `timeout`), another signal kills them instead of waiting.
        for name in SIGNALS_TO_HANDLE.split(","):
            signal.signal(signal.Signals[name], self._kill_workers)
        super()._shutdown(death_sig, timeout)

    def _kill_workers(self, signum: int, frame) -> None:
        print(f"{signal.Signals(signum).name} again: stopping the workers now, without a final checkpoint", file=sys.stderr, flush=True)
        for pid in self._pcontext.pids().values() if self._pcontext else ():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_agent(config: LaunchConfig, entrypoint: str, args: list[str]) -> None:
    """Run the worker group to completion; raise ChildFailedError when it fails for good."""
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = SIGNALS_TO_HANDLE
    # Workers must not reuse the agent's rendezvous store: its keys outlive a restart, and the restarted ranks
    # read their predecessors' addresses and hang in init (pytorch/pytorch#135712). Rank 0 hosts a fresh store
    # per attempt instead, on a port the agent picks.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    parameters = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    spec = WorkerSpec(
        role="trainer",
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(parameters),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
    )
    agent = Agent(spec=spec, logs_specs=config.logs_specs, shutdown_timeout=config.shutdown_timeout)
    close_rendezvous = True
    try:
        result = agent.run()
        if result.is_failed():
            raise ChildFailedError(name="python -m train", failures=result.failures)
    except SignalException:
        close_rendezvous = False  # as torchrun: a signalled agent leaves the rendezvous open for a rerun
        raise
    finally:
        if close_rendezvous:
            spec.rdzv_handler.shutdown()
