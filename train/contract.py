"""The contract between the launcher and every rank, in one place: what a rank finds in its environment besides
torchrun's env:// variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT, ...), and the files of a run directory that both sides read or write. The launcher sets
and the ranks read these names from here; nothing else of the launcher reaches a rank (docs/code.md).

ddp_loop.py, which runs beside a user's own modules (a `train.py` of theirs first on its path), imports nothing of
this package and keeps copies of the names it reads; tests/test_structure.py holds them equal to these.
"""

# --- a rank's environment, set by the launcher (launcher/backends/) -------------------------------------------------
PARENT_ENV = "TRAIN_DIE_WITH_PARENT"  # the launcher's pid: a rank dies with it (train/host.py die_with_parent)
USER_PATH_ENV = "TRAIN_USER_PATH"  # the user's module folders, appended after this package's (train/build.py)
ATTEMPT_ENV = "TRAIN_ATTEMPT"  # the count of rounds the nodes met in, the same on every node: names the attempt
MEETING_STORE_ENV = "TRAIN_RENDEZVOUS_STORE"  # HOST:PORT of the nodes' rendezvous store, where rank 0 says where
# this attempt's own store is (train/dist.py attempt_store); the launcher's agent sets both (launcher/backends/agent.py)
LEASE_KEY_ENV = "TRAIN_LEASE_KEY"  # the key of the run directory's lease this launch holds (train/writer.py)
REPLICA_GROUP_ENV = "REPLICA_GROUP_ID"  # trainer.fault_tolerance=replicas: this rank's group (torchft's name)
START_STORE_ENV = "REPLICA_GROUPS_STORE"  # where the replica groups meet at their start (train/fault_tolerance.py)
START_TIMEOUT_ENV = "REPLICA_GROUPS_START_TIMEOUT_S"  # how long they wait there for each other (launcher.rdzv_timeout_s)
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's Lighthouse, for its Manager (torchft's own name)
# The Lighthouse (launcher/backends/lighthouse.py) waits this long for a group that heartbeats but has not asked for
# the step's quorum yet (saving, evaluating, restarting), then forms the quorum without it; a group's Manager waits
# for its quorum that long plus trainer.timeout_s (train/fault_tolerance.py).
STRAGGLER_WAIT_S = 10
# program=script: read by ddp_loop.py (and by a script itself)
RUN_DIR_ENV = "LAUNCHER_RUN_DIR"  # the run directory the launcher holds
DEVICE_ENV = "LAUNCHER_DEVICE"  # cuda (meaning cuda:LOCAL_RANK) or cpu
TRACKERS_ENV = "LAUNCHER_TRACKERS"  # "1": ddp_loop.report() feeds the run's trackers
HANG_ENV = "LAUNCHER_HANG_TIMEOUT_S"  # trainer.hang_timeout_s, for ddp_loop's hang watch (0: none)
ON_HANG_ENV = "LAUNCHER_ON_HANG"  # program.on_hang: auto | report | end

# --- a rank's exit code the launcher reads ---------------------------------------------------------------------------
NONFINITE_EXIT_CODE = 65  # EX_DATAERR: a loss not finite (train/finite.py), not a crash to restart from (it would
# come back at the same step); the launch ends with it too (docs/watching.md)

# --- the run directory: written by one side, read by the other ----------------------------------------------------
CONFIG_FILE = "config.yaml"  # the resolved snapshot the ranks build from (launcher writes, ranks read)
STATUS_FILE = "status.json"  # running, finished, failed (with the first error), stopped (ranks and launcher write)
STATUS_LOCK = ".status.lock"  # held around a read and rewrite of status.json (several nodes report at once)
LEASE_FILE = "lease.json"  # who holds the directory (launcher writes and renews, ranks check before writing)
ALIVE_FILE = ".alive"  # its time: the last sign of life of any replica group's (or script's) ranks
METRICS_FILE = "metrics.jsonl"  # rank 0's metrics; jobs status and a script's tracker follower read it
PLAN_FILE = "plan.json"  # the plan rank 0 made (world, batch, steps)
HANG_DIR = "hang"  # hang reports: one folder per incident, each rank's stacks and a summary
