"""Write scikit-learn's bundled diabetes data (442 patients, 10 features, a disease-progression score) as one .npy
file per sample under data/train and data/eval, standardised with the training statistics: the layout of a data
set too big to load at once, which data.SampleFiles reads lazily, sample by sample.

    python prepare.py [--eval-samples 88] [--out data]
"""

import argparse
from pathlib import Path

import numpy as np
from sklearn.datasets import load_diabetes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval-samples", type=int, default=88)
    parser.add_argument("--out", default="data")
    args = parser.parse_args()
    x, y = load_diabetes(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    evals, train = order[: args.eval_samples], order[args.eval_samples :]
    mean, std = x[train].mean(0), x[train].std(0)
    y_mean, y_std = y[train].mean(), y[train].std()
    for split, rows in (("train", train), ("eval", evals)):
        directory = Path(args.out) / split
        directory.mkdir(parents=True, exist_ok=True)
        for i, row in enumerate(rows):
            sample = np.append((x[row] - mean) / std, (y[row] - y_mean) / y_std).astype(np.float32)
            np.save(directory / f"{i:05d}.npy", sample)
    print(f"{len(train)} training and {len(evals)} evaluation samples in {args.out}/")


if __name__ == "__main__":
    main()
