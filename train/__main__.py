"""`python -m train RUN_DIR/config.yaml`: run one rank from a resolved config snapshot.

Under plain torchrun (`torchrun --nproc-per-node 2 -m train RUN_DIR/config.yaml`) or your own srun line;
without any launcher it trains as a single process.
"""

import argparse

from torch.distributed.elastic.multiprocessing.errors import record

from train.dist import die_with_parent, exit_without_finalizing
from train.run import main


@record  # a failing rank's traceback reaches the launcher's error report
def cli() -> None:
    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the resolved config snapshot written by the launcher (RUN_DIR/config.yaml)")
    die_with_parent()
    main(parser.parse_args().config)


if __name__ == "__main__":
    cli()
    exit_without_finalizing()
