"""Meta-device initialisation: the shards a rank fills in hold exactly what a full build gives (same seed, same
values, the generator left in the same state), and what cannot be replayed is refused by name (the trainer then
builds the whole model). Sharded runs with it are in test_strategies.py (fsdp equals ddp) and the memory it saves
in benchmarks/checkpoints.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from train.models.gpt import GPT
from train.parallel.meta_init import Unsupported, build_on_meta, materialise, tied_parameters
from train.models.vision import mlp


class RandomParameter(nn.Module):
    """A parameter drawn at creation (torch.randn), besides layers that draw in place."""

    def __init__(self, scaled: bool = False):
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.offset = nn.Parameter(torch.randn(4) * 0.1 if scaled else torch.randn(4))
        self.out = nn.Linear(4, 2)


BUILDS = {
    "mlp": lambda: mlp(channels=1, image_size=8, num_classes=10, hidden=[32, 16], dropout=0.1),
    "gpt": lambda: GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, bias=True, tie_weights=False),
    "random parameter": RandomParameter,
    "tied gpt": lambda: GPT(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, tie_weights=True),
}


@pytest.mark.parametrize("name", BUILDS)
def test_materialised_weights_and_generator_equal_a_full_build(name):
    torch.manual_seed(3)
    model, recipes = build_on_meta(BUILDS[name])
    assert all(p.is_meta for p in model.parameters())
    materialise(model, recipes, torch.device("cpu"))
    generator_after = torch.get_rng_state()
    torch.manual_seed(3)
    reference = BUILDS[name]()
    assert torch.equal(generator_after, torch.get_rng_state()), "the next draws would differ from a full build's"
    expected = reference.state_dict()
    assert model.state_dict().keys() == expected.keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), f"{key} differs from a full build"
    for group in tied_parameters(reference):  # shared weights stay one tensor, as in the full build
        assert len({id(getattr(module, attribute)) for module, attribute in tied_parameters(model)[0]}) == 1
        assert len(group) == 2


@pytest.mark.parametrize("build, culprit", [
    (lambda: RandomParameter(scaled=True), "offset is computed from other tensors"),
    (lambda: nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4)), "1.num_batches_tracked"),
])
def test_what_cannot_be_replayed_is_refused_by_name(build, culprit):
    with pytest.raises(Unsupported, match=culprit):
        build_on_meta(build)


def test_under_cpu_offload_the_shards_are_materialised_on_the_host():
    """FSDP2 refuses offloaded parameters materialised on the GPU: meta init fills them in on the CPU then."""
    from train.config import TrainerConfig
    from train.parallel.sharded import parameter_device

    gpu = torch.device("cuda", 1)
    assert parameter_device(TrainerConfig(fsdp_cpu_offload=True), gpu) == torch.device("cpu")
    assert parameter_device(TrainerConfig(fsdp_cpu_offload=False), gpu) == gpu
