"""A custom loss: the Huber loss (quadratic near zero, linear beyond `delta`: robust to outliers). A task gives the
training loss and, for evaluation, sums that add up exactly across ranks."""

import torch
import torch.nn.functional as F

from train.tasks import Task


class Huber(Task):
    main_metric, mode = "mse", "min"  # best.pt: the lowest mean squared error

    def __init__(self, delta: float = 1.0):
        super().__init__()
        self.delta = delta

    def loss(self, output, targets):
        return F.huber_loss(output.float(), targets, delta=self.delta)

    def sums(self, output, targets):
        error = output.float() - targets
        return {
            "huber": F.huber_loss(output.float(), targets, delta=self.delta, reduction="sum"),
            "squared": error.square().sum(),
            "count": torch.tensor(error.numel(), device=error.device),
        }

    def metrics(self, totals):
        count = max(totals["count"], 1)
        return {"loss": totals["huber"] / count, "mse": totals["squared"] / count}
