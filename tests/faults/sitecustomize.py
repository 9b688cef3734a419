"""Test-only fault injection. Python imports this file at start-up in every process whose PYTHONPATH lists this
directory; it acts only in the training worker of rank FAULT_RANK, and only in the first attempt (so an elastic
restart runs clean):

  FAULT=kill    SIGKILL itself at the start of optimizer step FAULT_STEP
  FAULT=hang    block forever at the start of optimizer step FAULT_STEP
  FAULT=config  fail while loading the config snapshot (a bad rank at start-up)
  FAULT=slow_data  wait FAULT_DELAY_MS (default 50) before each training batch of this rank: a data stall
"""

import os

if (
    os.environ.get("FAULT")
    and os.environ.get("RANK") == os.environ.get("FAULT_RANK", "0")
    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
):
    import signal
    import threading

    import train.config
    import train.step

    kind = os.environ["FAULT"]
    if kind == "config":
        def broken_load_config(path):
            raise ValueError(f"injected config error on rank {os.environ['RANK']}")

        train.config.load_config = broken_load_config
    elif kind == "slow_data":
        import train.batches

        epoch, delay = train.batches.TrainBatches.epoch, int(os.environ.get("FAULT_DELAY_MS", "50")) / 1000

        def slow_epoch(self, *args, **kwargs):
            for batch in epoch(self, *args, **kwargs):
                threading.Event().wait(delay)
                yield batch

        train.batches.TrainBatches.epoch = slow_epoch
    else:
        train_step, calls = train.step.train_step, [0]

        def faulty_train_step(*args, **kwargs):
            calls[0] += 1
            if calls[0] == int(os.environ["FAULT_STEP"]):
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                threading.Event().wait()  # hang
            return train_step(*args, **kwargs)

        train.step.train_step = faulty_train_step
