"""What each task of a SLURM job runs: submitit's job processing (load the pickled launcher.backends.slurm_job.SlurmTask, run it,
write its result for the submitter), then an end without the interpreter's finalization, as a local worker ends
(train.dist.exit_without_finalizing says why: a gloo thread can abort a finished rank there, "terminate called
without an active exception", and SLURM then records a job that trained to its end as FAILED).

submitit runs `<python> -u -m submitit.core._submit FOLDER`; launcher.backends.slurm gives it `<python> -u -P -m
launcher.backends.slurm_task` as its python, so this module gets submitit's arguments and takes the folder from the end.
"""

import sys
import traceback

from submitit.core.submission import process_job

from train.dist import exit_without_finalizing
from train.host import untracked_imports


def main(argv: list[str]) -> None:
    with untracked_imports():  # what unpickling the task imports anyway
        import torch  # noqa: F401
    try:
        process_job(argv[-1])
    except SystemExit as stop:  # submitit's own exit after it requeued a preempted job: its code stands
        exit_without_finalizing(stop.code if isinstance(stop.code, int) else 1)
    except BaseException:  # submitit has written the error as the task's result; the traceback goes to the log
        traceback.print_exc()
        exit_without_finalizing(1)
    exit_without_finalizing(0)


if __name__ == "__main__":
    main(sys.argv)
