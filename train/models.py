"""Models, in plain torch (torchvision is never needed), looked up by name in MODELS.

Each builder takes the model config and the data spec (channels, image size, classes), so one config works
for any data set of the right shape, and returns an nn.Sequential of blocks: the blocks are what
`trainer.strategy=fsdp` shards one by one and where `trainer.strategy=pipeline` may cut the model into stages.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

from train.config import ModelConfig
from train.data import DataSpec


def build_mlp(cfg: ModelConfig, spec: DataSpec) -> nn.Sequential:
    width = spec.channels * spec.image_size**2
    blocks: list[nn.Module] = []
    for i, hidden in enumerate(cfg.hidden):
        blocks.append(nn.Sequential(*([nn.Flatten()] if i == 0 else []), nn.Linear(width, hidden), nn.ReLU()))
        width = hidden
    head = [nn.Dropout(cfg.dropout), nn.Linear(width, spec.num_classes)]
    return nn.Sequential(*blocks, nn.Sequential(*([nn.Flatten()] if not cfg.hidden else []), *head))


def build_cnn(cfg: ModelConfig, spec: DataSpec) -> nn.Sequential:
    """A small CNN: two 3x3 conv blocks, each halving the resolution, then a linear classifier."""
    w = cfg.width
    side = spec.image_size // 4
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(spec.channels, w, 3, padding=1), nn.ReLU(), nn.Conv2d(w, w, 3, padding=1), nn.ReLU(),
                      nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Dropout(cfg.dropout), nn.Linear(2 * w * side * side, spec.num_classes)),
    )


def build_lenet(cfg: ModelConfig, spec: DataSpec) -> nn.Sequential:
    """LeNet-5 (LeCun et al. 1998) with ReLU and max-pooling; the first conv pads so 28x28 inputs work."""
    side = (spec.image_size // 2 - 4) // 2  # conv1 keeps the size, conv2 takes 4, each pool halves
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(spec.channels, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(16 * side * side, 120), nn.ReLU()),
        nn.Sequential(nn.Linear(120, 84), nn.ReLU(), nn.Dropout(cfg.dropout), nn.Linear(84, spec.num_classes)),
    )


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def build_resnet18(cfg: ModelConfig, spec: DataSpec) -> nn.Sequential:
    """The CIFAR variant of ResNet-18 (He et al. 2016): a 3x3 stem, no max-pool, four stages of two blocks."""
    w = cfg.width
    layers: dict[str, nn.Module] = {
        "stem": nn.Sequential(nn.Conv2d(spec.channels, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
    }
    cin = w
    for i, cout in enumerate((w, 2 * w, 4 * w, 8 * w)):
        layers[f"stage{i + 1}a"] = BasicBlock(cin, cout, stride=1 if i == 0 else 2)
        layers[f"stage{i + 1}b"] = BasicBlock(cout, cout, stride=1)
        cin = cout
    layers["head"] = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(cfg.dropout), nn.Linear(cin, spec.num_classes))
    return nn.Sequential(OrderedDict(layers))


MODELS: dict[str, Callable[[ModelConfig, DataSpec], nn.Module]] = {
    "mlp": build_mlp,
    "cnn": build_cnn,
    "lenet": build_lenet,
    "resnet18": build_resnet18,
}


def build_model(cfg: ModelConfig, spec: DataSpec) -> nn.Sequential:
    return MODELS[cfg.name](cfg, spec)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's declared blocks: the units FSDP shards one by one, and between which a pipeline may split.

    Every model here is an nn.Sequential of blocks, each feeding the next; another model has none (one block).
    """
    return list(model.children()) if isinstance(model, nn.Sequential) else [model]
