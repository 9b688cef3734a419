"""This project's own single-process training script, from before it used the launcher. Its name is the most
common one there is; the launcher's own `train` package must not be confused with it (and is not).

    python train.py
"""

import torch

from data import SampleFiles
from losses import Huber
from models import ResidualMLP


def main() -> None:
    torch.manual_seed(0)
    model, task, data = ResidualMLP(in_features=10), Huber(), SampleFiles("data/train", noise=0.05)
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for epoch in range(20):
        for features, target in loader:
            loss = task.loss(model(features), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch + 1}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
