#!/usr/bin/env bash
# A Ray cluster of two nodes on this machine, for the tests of launcher=ray and for trying it out:
# the head on 127.0.0.2 (GCS port 6390, Jobs API and dashboard on http://127.0.0.2:8265) and a worker on 127.0.0.3,
# each a node of its own to Ray (two raylets on one address would look like one node). The cluster has its own
# environment, as a real cluster's image would: a venv with torch, Ray, torchft and this project's dependencies, and
# links to this checkout's packages (the same code).
#
#   ray-cluster/test-cluster.sh install       # the cluster's venv (~1 min, once)
#   ray-cluster/test-cluster.sh start         # both nodes; prints the address to use (RAY_ADDRESS)
#   ray-cluster/test-cluster.sh kill-worker   # SIGKILL the worker node's processes (a lost node)
#   ray-cluster/test-cluster.sh start-worker  # the worker node again
#   ray-cluster/test-cluster.sh stop
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
ROOT=${RAY_TEST_CLUSTER:-/tmp/ray-test-cluster}
VENV=$ROOT/venv
HEAD=127.0.0.2 WORKER=127.0.0.3 GCS_PORT=6390 DASHBOARD_PORT=8265
CPUS_PER_NODE=${RAY_TEST_CPUS:-2}
# Ray rewrites 127.0.0.1 to the machine's outside address: the nodes use 127.0.0.2 and up. No usage reports, no
# merged log lines, and a small object store (the default claims a third of the memory). Each node's dashboard agent
# samples every process of the machine for its metrics every 5 s: once a minute here, where nobody reads them (the
# idle cluster took ~5% of a core, beside the test suite on 2 cores).
# A lost node (kill-worker) is declared dead after 5 failed health checks: one a second, not every 3 s. Each node's
# log monitor lists its log folder for new files every 0.5 s, not every 0.1 s (Ray does the latter below 1,000 files:
# the two monitors took ~27 s of CPU in a CI run); the lines of files it knows are still read every 0.1 s.
# No worker processes started ahead of need: each raylet started one per CPU when a job's driver connected, and the
# two a job never used stayed as ray::IDLE until killed (~2 s of CPU per job: their imports of Ray).
export RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0 REPORTER_UPDATE_INTERVAL_MS=60000 RAY_health_check_period_ms=1000 \
  RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0 RAY_prestart_worker_first_driver=0 RAY_enable_worker_prestart=0 PATH="$VENV/bin:$PATH"
NODE_OPTS=(--num-cpus="$CPUS_PER_NODE" --num-gpus=0 --object-store-memory=200000000 --disable-usage-stats)

wait_for_nodes() {  # $1: how many alive nodes to wait for
  for _ in $(seq 60); do
    alive=$(python - <<PY 2>/dev/null || echo 0
import ray.util.state as s
print(sum(n.state == "ALIVE" for n in s.list_nodes(address="http://$HEAD:$DASHBOARD_PORT")))
PY
)
    [ "$alive" = "$1" ] && return 0
    sleep 1
  done
  echo "the Ray test cluster did not reach $1 alive node(s)" >&2
  return 1
}

case "${1:-}" in
  install)
    # The project's dependencies, and its packages as links to this checkout (the same code, as an editable install
    # gives, without building metadata in the checkout while .ci/run's own install does; not the checkout itself on
    # the path, which `python -m launcher` takes off it when run from there). torchft: replica groups; the s3 extra:
    # checkpoint.store on S3 (the nodes' own s3fs: a node without it cannot reach the store).
    python3 -m venv "$VENV"
    mapfile -t deps < <(python3 -c 'import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print(*project["dependencies"], *project["optional-dependencies"]["s3"], sep="\n")' "$REPO/pyproject.toml")
    "$VENV/bin/pip" install -q torch==2.13.0 'ray[default]==2.60.0' 'torchft==0.2.0' "${deps[@]}"
    mkdir -p "$VENV/checkout"
    ln -sfn "$REPO/launcher" "$VENV/checkout/launcher"
    ln -sfn "$REPO/train" "$VENV/checkout/train"
    ln -sfn "$REPO/ddp_loop.py" "$VENV/checkout/ddp_loop.py"  # program=script's runner (pyproject's py-modules)
    echo "$VENV/checkout" >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ddp_launcher.pth"
    ;;
  start)
    ray start --head --node-ip-address=$HEAD --port=$GCS_PORT --dashboard-host=$HEAD --dashboard-port=$DASHBOARD_PORT \
      "${NODE_OPTS[@]}" >"$ROOT/head.log" 2>&1
    ray start --address=$HEAD:$GCS_PORT --node-ip-address=$WORKER --temp-dir="$ROOT/worker" "${NODE_OPTS[@]}" >"$ROOT/worker.log" 2>&1
    wait_for_nodes 2
    echo "Ray test cluster: 2 nodes; RAY_ADDRESS=http://$HEAD:$DASHBOARD_PORT"
    ;;
  kill-worker)
    # Its raylet (whose workers and agents end with it) and its log monitor, which outlives the raylet, polling its
    # folder: each kill and start-worker left one more behind.
    pkill -KILL -f "raylet.*--node_ip_address=$WORKER" && echo "killed the raylet of $WORKER"
    pkill -KILL -f "log_monitor.py.*--session-dir=$ROOT/worker/" || true
    ;;
  start-worker)
    ray start --address=$HEAD:$GCS_PORT --node-ip-address=$WORKER --temp-dir="$ROOT/worker" "${NODE_OPTS[@]}" >>"$ROOT/worker.log" 2>&1
    wait_for_nodes 2
    ;;
  stop)
    ray stop --force >/dev/null 2>&1 || true
    ;;
  *)
    echo "usage: $0 install|start|kill-worker|start-worker|stop" >&2
    exit 2
    ;;
esac
