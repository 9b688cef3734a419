"""The user's model: a small MLP of their own. It fails on purpose where their environment says so (MATRIX_FAIL_AT:
the forward call at which rank MATRIX_FAIL_RANK raises; of replica group MATRIX_FAIL_GROUP where there are groups),
as a user's own bug would: the matrix's failing rank."""

import os

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, features: int = 16, width: int = 32, classes: int = 4):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                  nn.Linear(width, classes))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.training and self.calls == int(os.environ.get("MATRIX_FAIL_AT", "0")) \
                and os.environ.get("RANK") == os.environ.get("MATRIX_FAIL_RANK") \
                and os.environ.get("REPLICA_GROUP_ID", "-") == os.environ.get("MATRIX_FAIL_GROUP", "-"):
            raise ValueError(f"the user's model broke at its forward call {self.calls}")
        return self.body(x)
