"""Per-step fault tolerance across replica groups (trainer.fault_tolerance=replicas), with torchft.

The world is split into trainer.replica_groups groups, each a torch.distributed world of its own (its own agent,
its own env:// variables, REPLICA_GROUP_ID and TORCHFT_LIGHTHOUSE from the launcher) that trains a copy of the model
under ddp, or under fsdp sharded over the group's processes (rank r of every group then holds the same shards, and
exchanges them with rank r of the others). Across groups, torchft's Manager forms a quorum before every step (the
Lighthouse), averages the gradients over the groups that take part, and commits the step only if all of them got
through it. A group that fails restarts alone, from the run's last checkpoint, and heals from a live group at its
first quorum (the model, optimizer, schedule and step sent over, not read from disk; torchft's transport sends a
DTensor's shard to the same rank), while the others never stop.

While a group is missing, its share of each global batch is skipped, not redistributed: the step's gradient is the
mean over the samples of the groups present (the global batch shrinks by their share; the lr is unchanged).
Determinism: a run is bitwise the uninterrupted one only while every group takes part; after a failure the
replicas are identical to each other (checked at the end), not to a run that never failed.

`Alone` is the null object of a run without replica groups: one group, every step committed, nothing to send.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch
from train.contract import (  # noqa: F401  (the launcher-rank contract)
    REPLICA_GROUP_ENV, START_STORE_ENV, START_TIMEOUT_ENV, STRAGGLER_WAIT_S)


log = logging.getLogger("train")


def groups(trainer) -> int:
    """How many replica groups the world is split into (1 without fault tolerance)."""
    return trainer.replica_groups if trainer.fault_tolerance == "replicas" else 1


def replica_group() -> int:
    """This process's replica group (0 without fault tolerance)."""
    return int(os.environ.get(REPLICA_GROUP_ENV, "0"))


class Alone:
    """No replica groups: every step is committed; nothing is exchanged."""

    participants = 1

    def join_step(self) -> bool:
        return False

    def average_gradients(self, parameters, bad: torch.Tensor, stop: bool) -> tuple[None, bool]:
        return None, stop  # no other group's verdict: the loss's own (train/finite.py)

    def commit(self) -> bool:
        return True

    def writes(self) -> bool:
        return True

    def writes_records(self) -> bool:
        return True

    def identical(self, model: torch.nn.Module) -> bool | None:
        return None

    def close(self) -> None:
        pass


class ReplicaGroups:
    """This rank's seat in the replica groups: rank r of a group exchanges with rank r of every other group."""

    def __init__(self, trainer, state_dict, load_state_dict, timeout_s: float, world_size: int):
        from torchft import Manager, ProcessGroupGloo

        # torchft warns at every reconfiguration that it cannot reset NCCL's flight recorder: these groups are gloo's
        logging.getLogger("torchft.manager").addFilter(
            lambda record: "Unable to reset NCCL flight recorder" not in record.getMessage())
        self.group = replica_group()
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=timeout_s)),
            min_replica_size=trainer.min_replicas,
            state_dict=state_dict,
            load_state_dict=self._heal,
            replica_id=f"group{self.group}",
            use_async_quorum=False,  # a returning group heals before its step's forward, not during it
            init_sync=False,  # every group builds the same initial weights (seeded) or resumes the same checkpoint
            timeout=timedelta(seconds=timeout_s),
            # A quorum waits for the groups that are alive but busy elsewhere (a save, an evaluation, a restarted
            # group's start): the Lighthouse forms it without them after STRAGGLER_WAIT_S. A wait shorter than that
            # failed a restarted group whose quorum the Lighthouse was still forming.
            quorum_timeout=timedelta(seconds=timeout_s + STRAGGLER_WAIT_S),
        )
        self._load, self._healed, self._joined = load_state_dict, False, False
        self._fewest: int | None = None  # the fewest groups in a step since the last log
        # Every group joins before the first quorum: a group still starting would be left out of it, and the first
        # one to start would train alone and heal the others (or finish before they start).
        # Bounded as the nodes' rendezvous is (a group's start: imports, the data, the model), not by the exchange
        # timeout: with trainer.timeout_s=2, a group slow to start under load failed the other at this meeting.
        meet_every_group(trainer.replica_groups * world_size, float(os.environ.get(START_TIMEOUT_ENV) or timeout_s))

    def _heal(self, state) -> None:
        self._load(state)
        self._healed = True

    @property
    def participants(self) -> int:
        return self.manager.num_participants()

    def fewest_since_log(self) -> int:
        """The fewest groups that took part in a step since the last call: a dip between log steps is not missed."""
        fewest, self._fewest = self._fewest, None
        return self.participants if fewest is None else fewest

    def join_step(self) -> bool:
        """The quorum of this step; True if this group healed from a live one (its state replaced: the step moved)."""
        self._healed = False
        self.manager.start_quorum()
        self._joined = True
        return self._healed

    def average_gradients(self, parameters, bad: torch.Tensor, stop: bool) -> tuple[torch.Tensor, bool]:
        """The mean of each gradient over the groups taking part (one flat buffer, one all-reduce). Under fsdp a
        rank holds its shard of each gradient, and rank r of every group holds the same shard: the shards are
        averaged, rank with rank.

        Two verdicts travel in the same buffer, so that every group acts on them at the same step: `bad` (this rank's
        loss was not finite: a NaN averaged into every group's gradients must be skipped by all, not stepped on by the
        groups whose own loss was finite) and `stop` (this rank had a stop signal: every group stops after this
        step, train/stopping.py). Returned: whether any group's rank r said so (a host sync: the all-reduce is
        waited for anyway)."""
        grads = [local(p.grad) for p in parameters if p.grad is not None]
        like = grads[0] if grads else bad.float()
        verdicts = torch.stack([bad.reshape(()).to(like), torch.tensor(float(stop)).to(like)])
        flat = torch.cat([*(g.reshape(-1) for g in grads), verdicts])
        self.manager.allreduce(flat).wait()
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        heard = flat[offset:] > 0  # a mean over the groups: above 0 if any said 1
        return heard[0].to(bad.device), bool(heard[1].item())

    def commit(self) -> bool:
        """Whether every group of the quorum got through this step (else it is dropped everywhere)."""
        self._healed = False  # this step used the quorum a heal came with
        committed = self.manager.should_commit()
        participants = self.manager.num_participants()
        self._fewest = participants if self._fewest is None else min(self._fewest, participants)
        return committed

    def writes(self) -> bool:
        """Whether this group writes the run's checkpoints now: the first group of the last step's quorum, the same
        answer in every group. Group 0 while it takes part; while it is down (or gone for good), the first live one:
        a run whose group 0 never came back finished with no checkpoint after its failure."""
        return self.manager.participating_rank() == 0

    def writes_records(self) -> bool:
        """Whether this group's rank 0 writes the run's records now (metrics.jsonl's lines, the console's): the group
        that writes the checkpoints, so that a run whose group 0 is down or gone keeps its record; before the first
        quorum (the plan, a resume), group 0."""
        return self.writes() if self._joined else self.group == 0

    def identical(self, model: torch.nn.Module) -> bool:
        """Whether the groups taking part hold the same weights: each parameter's sum, its largest and smallest over
        the groups (one all-reduce of the sums and their negatives, MAX), equal to this group's own. (An average
        over the groups is not exact: three equal sums averaged can come back an ulp apart, a false "DIFFERENT".)

        A group that comes back as the others end heals in their last quorum (this check's) straight to the end:
        it checks in that quorum too, not in a new one that the others, waiting in this all-reduce, never join."""
        from torch.distributed import ReduceOp

        with torch.no_grad():
            sums = torch.stack([local(p.detach()).double().sum() for p in model.parameters()])
            bounds = torch.cat([sums, -sums])
            if not self._healed:
                self.manager.start_quorum()
            self.manager.allreduce(bounds, reduce_op=ReduceOp.MAX).wait()
        largest, smallest = bounds[:len(sums)], -bounds[len(sums):]
        return bool(torch.equal(largest, sums) and torch.equal(smallest, sums))

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient: a DTensor's local shard (fsdp), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def meet_every_group(ranks: int, timeout_s: float) -> None:
    """Wait until `ranks` processes (every rank of every group) have started, at the launcher's store; a group that
    restarts later finds the count reached and goes on."""
    address = os.environ.get(START_STORE_ENV)
    if not address:
        return
    host, _, port = address.rpartition(":")
    store = torch.distributed.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                                       wait_for_workers=False)
    store.add("started", 1)
    deadline = time.monotonic() + timeout_s
    while (started := store.add("started", 0)) < ranks:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{started} of the {ranks} ranks of the replica groups started within "
                               f"{timeout_s:.0f} s (launcher.rdzv_timeout_s): a group failed to start; see its output.")
        time.sleep(0.05)


def build_replicas(trainer, state_dict, load_state_dict, timeout_s: float, world_size: int):
    """The replica groups of trainer.fault_tolerance=replicas (`world_size`: one group's), or Alone."""
    if groups(trainer) == 1:
        return Alone()
    return ReplicaGroups(trainer, state_dict, load_state_dict, timeout_s, world_size)
