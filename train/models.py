"""Models, in plain torch (torchvision is never needed), looked up by name in MODELS.

Each builder takes the model config and the data spec (channels, image size, classes), so one config works
for any data set of the right shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from train.config import ModelConfig
from train.data import DataSpec


def build_mlp(cfg: ModelConfig, spec: DataSpec) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = spec.channels * spec.image_size**2
    for hidden in cfg.hidden:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers += [nn.Dropout(cfg.dropout), nn.Linear(width, spec.num_classes)]
    return nn.Sequential(*layers)


def build_cnn(cfg: ModelConfig, spec: DataSpec) -> nn.Module:
    """A small CNN: two 3x3 conv blocks, each halving the resolution, then a linear classifier."""
    w = cfg.width
    side = spec.image_size // 4
    return nn.Sequential(
        nn.Conv2d(spec.channels, w, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(w, w, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(cfg.dropout),
        nn.Linear(2 * w * side * side, spec.num_classes),
    )


def build_lenet(cfg: ModelConfig, spec: DataSpec) -> nn.Module:
    """LeNet-5 (LeCun et al. 1998) with ReLU and max-pooling; the first conv pads so 28x28 inputs work."""
    side = (spec.image_size // 2 - 4) // 2  # conv1 keeps the size, conv2 takes 4, each pool halves
    return nn.Sequential(
        nn.Conv2d(spec.channels, 6, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * side * side, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Dropout(cfg.dropout),
        nn.Linear(84, spec.num_classes),
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


class ResNet18(nn.Module):
    """The CIFAR variant of ResNet-18 (He et al. 2016): a 3x3 stem, no max-pool, four stages of two blocks."""

    def __init__(self, cfg: ModelConfig, spec: DataSpec):
        super().__init__()
        w = cfg.width
        self.stem = nn.Sequential(nn.Conv2d(spec.channels, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
        stages, cin = [], w
        for i, cout in enumerate((w, 2 * w, 4 * w, 8 * w)):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(cfg.dropout), nn.Linear(cin, spec.num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


MODELS: dict[str, Callable[[ModelConfig, DataSpec], nn.Module]] = {
    "mlp": build_mlp,
    "cnn": build_cnn,
    "lenet": build_lenet,
    "resnet18": ResNet18,
}


def build_model(cfg: ModelConfig, spec: DataSpec) -> nn.Module:
    return MODELS[cfg.name](cfg, spec)
