"""Exact distributed evaluation: a data set whose size does not divide by the world size is evaluated by real
gloo processes and must give exactly the single-process numbers (DistributedSampler's padding would not)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from conftest import run_ranks
from train.data.build import build_eval_batches
from train.config import DataConfig, TrainerConfig
from train.data.sets import TensorData
from train.dist import DistEnv, exit_without_finalizing
from train.evaluate import evaluate
from train.parallel.strategy import Strategy
from train.tasks import Classification

N = 101  # prime: no world size above 1 divides it


def make_case():
    g = torch.Generator().manual_seed(0)
    data = TensorData(torch.randn(N, 1, 4, 4, generator=g), torch.randint(3, (N,), generator=g), (0.0,), (1.0,))
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3), torch.nn.BatchNorm1d(3))
    model.eval()(torch.randn(8, 1, 4, 4))  # non-trivial BatchNorm running statistics
    return data, model


def reference(indices: list[int] | None = None) -> dict[str, float]:
    """One process's metrics over the samples at `indices` (all of them by default), computed here by hand."""
    data, model = make_case()
    chosen = torch.tensor(range(N) if indices is None else indices)
    with torch.no_grad():
        logits = model.eval()(data.normalize(data.images[chosen]))
    labels = data.labels[chosen]
    return {
        "loss": F.cross_entropy(logits, labels, reduction="sum").item() / len(chosen),
        "acc": (logits.argmax(1) == labels).sum().item() / len(chosen),
    }


class Samples(torch.utils.data.Dataset):
    """The same samples as a map-style data set (served by a DataLoader)."""

    def __init__(self, data: TensorData):
        self.images, self.labels = data.normalize(data.images), data.labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def _worker(rank: int, world: int, batch_size: int, lockstep: bool, source: str, store_path: str, limit: int,
            out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        data, model = make_case()
        if rank != 0:  # rank 0's buffers are the truth; evaluate() must broadcast them
            for buffer in model.buffers():
                buffer.add_(7)
        env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
        strategy = Strategy(model, TrainerConfig(), env, torch.device("cpu"))
        cpu = torch.device("cpu")
        dataset = data if source == "memory" else Samples(data)
        cfg = DataConfig(eval_batch_size=batch_size, max_eval_samples=limit)
        batches = build_eval_batches(cfg, dataset, rank, world, cpu, lockstep)
        out[rank] = evaluate(strategy, Classification(), batches, device=cpu, autocast=contextlib.nullcontext)
    finally:
        dist.destroy_process_group()
    exit_without_finalizing()  # as the trainer's ranks: a gloo thread can abort a finished process in finalization


# (3, 11, lockstep): shares of 34, 34 and 33 samples make 4, 4 and 3 batches; the last rank repeats one, uncounted.
@pytest.mark.parametrize("source", ["memory", "loader"])
@pytest.mark.parametrize("world,batch_size,lockstep", [(2, 16, False), (3, 16, False), (3, 11, True)])
def test_distributed_eval_equals_single_process_eval(tmp_path, world, batch_size, lockstep, source):
    results = run_ranks(_worker, world, world, batch_size, lockstep, source, str(tmp_path / "store"), 0)
    expected = reference()
    for rank in range(world):
        assert results[rank]["acc"] == expected["acc"]  # every sample counted exactly once: a duplicate would move it
        assert results[rank]["loss"] == pytest.approx(expected["loss"], rel=1e-6)


@pytest.mark.parametrize("source", ["memory", "loader"])
@pytest.mark.parametrize("world", [1, 3])
def test_max_eval_samples_scores_the_same_samples_spread_over_the_set_at_any_world_size(tmp_path, world, source):
    """data.max_eval_samples=40 of 101: samples 0, 2, 5, ..., 98 (i * 101 // 40), whatever the world size; in lockstep
    on 3 ranks (14, 13 and 13 samples in batches of 13) the last two repeat one batch, uncounted."""
    results = run_ranks(_worker, world, world, 13, world > 1, source, str(tmp_path / "store"), 40)
    spread = [i * N // 40 for i in range(40)]
    assert spread[:4] == [0, 2, 5, 7] and spread[-1] == 98
    expected, whole = reference(spread), reference()
    assert expected["acc"] != whole["acc"]  # a subset that scores differently: a test that could fail
    for rank in range(world):
        assert results[rank]["acc"] == expected["acc"]
        assert results[rank]["loss"] == pytest.approx(expected["loss"], rel=1e-6)


def test_a_padded_sampler_would_have_counted_samples_twice():
    """Why the above matters: DistributedSampler pads 101 samples to 102 on 2 ranks."""
    total = sum(len(DistributedSampler(range(N), num_replicas=2, rank=r, shuffle=False)) for r in range(2))
    assert total == N + 1


class PositionedStream(torch.utils.data.IterableDataset):
    """A stream that keeps its position, as a stateful one does (examples/diabetes' SampleStream): iterated again
    without set_epoch it continues from where it ended, i.e. yields nothing."""

    def __init__(self, data: TensorData):
        self.samples = Samples(data)
        self.position = 0

    def set_epoch(self, epoch: int) -> None:
        self.position = 0

    def __iter__(self):
        while self.position < len(self.samples):
            self.position += 1
            yield self.samples[self.position - 1]


@contextlib.contextmanager
def lone_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_stream_is_evaluated_from_its_start_every_time_and_an_empty_evaluation_says_so():
    """The second evaluation of a stream that keeps its position got no batch and died with KeyError: 'count'."""
    data, model = make_case()
    stream, cpu = PositionedStream(data), torch.device("cpu")
    cfg = DataConfig(eval_batch_size=16, num_workers=0)
    with lone_process_group():
        strategy = Strategy(model, TrainerConfig(), DistEnv(0, 0, 1, 1), cpu)
        first, second = (evaluate(strategy, Classification(), build_eval_batches(cfg, stream, 0, 1, cpu, False), cpu,
                                  contextlib.nullcontext) for _ in range(2))
        assert first == second and first["acc"] == reference()["acc"]
        with pytest.raises(RuntimeError, match="the evaluation counted no sample on any rank: data.eval gave no batch"):
            evaluate(strategy, Classification(), iter([]), cpu, contextlib.nullcontext)
        limited = DataConfig(eval_batch_size=16, num_workers=0, max_eval_samples=8)
        with pytest.raises(ValueError, match=r"data.max_eval_samples=8: data.eval \(PositionedStream\) is a stream"):
            build_eval_batches(limited, stream, 0, 1, cpu, False)
