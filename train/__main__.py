"""`python -m train RUN_DIR/config.yaml`: run one rank from a resolved config snapshot.

Under plain torchrun (`torchrun --nproc-per-node 2 -m train RUN_DIR/config.yaml`) or your own srun line;
without any launcher it trains as a single process.
"""

import gc

# No cyclic collection until the imports are done (train.host.freeze_imported_objects enables it again): torch's and
# dynamo's imports make millions of lasting objects, and each collection they set off traversed all made so far
# (~0.4 s of every rank's start, measured in benchmarks/README.md).
gc.disable()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from train.contract import NONFINITE_EXIT_CODE  # noqa: E402
from train.dist import exit_without_finalizing  # noqa: E402
from train.finite import NonFiniteLoss  # noqa: E402
from train.host import die_with_parent, name_process, rank_process_name  # noqa: E402
from train.run import main  # noqa: E402
from train.writer import RunDirHeld  # noqa: E402


@record  # a failing rank's traceback reaches the launcher's error report
def cli() -> None:
    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the resolved config snapshot written by the launcher (RUN_DIR/config.yaml)")
    config = parser.parse_args().config
    if not os.path.isfile(config):  # before anything else: a typo, not a crash with torch's traceback
        parser.error(f"{config}: no such file; give the config.yaml of a run directory (the launcher writes "
                     f"RUN_DIR/config.yaml: python -m launcher ... launcher.dry_run=true writes one without training)")
    die_with_parent()
    name_process(rank_process_name(os.environ).encode())  # `pgrep -x 'train rank 0'`, as ps and top show it
    main(config)


if __name__ == "__main__":
    try:
        cli()
    except Exception as error:
        if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
            if isinstance(error, RunDirHeld):  # a refusal, not a crash: the message says what to do
                print(f"error: {error}", file=sys.stderr)
                sys.exit(2)
            raise  # no agent to report it: the traceback goes to stderr, as usual
        # @record wrote the traceback to the error file: the launcher prints the first failing rank's once, and a
        # line for each other rank (a line printed here by every rank was 512 lines at 512 ranks).
        exit_without_finalizing(NONFINITE_EXIT_CODE if isinstance(error, NonFiniteLoss) else 1)
    exit_without_finalizing()
