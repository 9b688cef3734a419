"""The built-in models, in plain torch (torchvision is never needed): ordinary `_target_`s of conf/model/*.yaml.

Each takes the shape of its data explicitly (channels, image size, classes: conf/model/*.yaml interpolates them
from `data.*`) and returns an nn.Sequential of blocks: the units `trainer.strategy=fsdp` shards one by one and
between which `trainer.strategy=pipeline` may cut. A user's model needs none of this (see `blocks`).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn


def mlp(channels: int, image_size: int, num_classes: int, hidden: list[int] = (256, 256), dropout: float = 0.0) -> nn.Sequential:
    """A multilayer perceptron on flattened images: one block per hidden layer, then the classifier."""
    width = channels * image_size**2
    blocks: list[nn.Module] = []
    for i, size in enumerate(hidden):
        blocks.append(nn.Sequential(*([nn.Flatten()] if i == 0 else []), nn.Linear(width, size), nn.ReLU()))
        width = size
    head = [nn.Dropout(dropout), nn.Linear(width, num_classes)]
    return nn.Sequential(*blocks, nn.Sequential(*([nn.Flatten()] if not hidden else []), *head))


def cnn(channels: int, image_size: int, num_classes: int, width: int = 32, dropout: float = 0.0) -> nn.Sequential:
    """A small CNN: two 3x3 conv blocks, each halving the resolution, then a linear classifier."""
    w, side = width, image_size // 4
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(channels, w, 3, padding=1), nn.ReLU(), nn.Conv2d(w, w, 3, padding=1), nn.ReLU(),
                      nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * w * side * side, num_classes)),
    )


def lenet(channels: int, image_size: int, num_classes: int, dropout: float = 0.0) -> nn.Sequential:
    """LeNet-5 (LeCun et al. 1998) with ReLU and max-pooling; the first conv pads so 28x28 inputs work."""
    side = (image_size // 2 - 4) // 2  # conv1 keeps the size, conv2 takes 4, each pool halves
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(channels, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(16 * side * side, 120), nn.ReLU()),
        nn.Sequential(nn.Linear(120, 84), nn.ReLU(), nn.Dropout(dropout), nn.Linear(84, num_classes)),
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


def resnet18(channels: int, image_size: int, num_classes: int, width: int = 64, dropout: float = 0.0) -> nn.Sequential:
    """The CIFAR variant of ResNet-18 (He et al. 2016): a 3x3 stem, no max-pool, four stages of two blocks.
    (Any image size: the head pools globally.)"""
    w = width
    layers: dict[str, nn.Module] = {
        "stem": nn.Sequential(nn.Conv2d(channels, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
    }
    cin = w
    for i, cout in enumerate((w, 2 * w, 4 * w, 8 * w)):
        layers[f"stage{i + 1}a"] = BasicBlock(cin, cout, stride=1 if i == 0 else 2)
        layers[f"stage{i + 1}b"] = BasicBlock(cout, cout, stride=1)
        cin = cout
    layers["head"] = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(cin, num_classes))
    return nn.Sequential(OrderedDict(layers))


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks: the units FSDP shards one by one (and, for an nn.Sequential, where a pipeline may cut).

    In order: the modules a model lists in a `blocks` attribute (an nn.ModuleList or a list of its submodules: how a
    model of any shape declares them); the children of an nn.Sequential (each feeds the next); otherwise the
    children of the model's largest nn.ModuleList (a transformer's layers); otherwise none but the model."""
    declared = getattr(model, "blocks", None)
    if isinstance(declared, (nn.ModuleList, list, tuple)) and all(isinstance(m, nn.Module) for m in declared):
        return list(declared)
    if isinstance(model, nn.Sequential):
        return list(model.children())
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if lists:
        return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))
    return [model]


def pipeline_stages(model: nn.Module) -> list[nn.Module] | None:
    """The consecutive stages a pipeline may cut between, or None if the model cannot be cut: only an
    nn.Sequential, whose children each feed the next, says so."""
    return list(model.children()) if isinstance(model, nn.Sequential) else None
