#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, for tests: slurmctld, slurmdbd (MariaDB accounting, which
# submitit needs to see job states), munge, and two slurmd (n1 at 127.0.0.2, n2 at 127.0.0.3), each in its own
# UTS/mount namespace so that it has its own hostname and sees a hosts file that names n1 and n2.
#
#   slurm/test-cluster.sh install   apt packages (Debian: slurmctld slurmd slurm-client munge slurmdbd mariadb)
#   slurm/test-cluster.sh start     write the configs under $SLURM_TEST_DIR and start every daemon
#   slurm/test-cluster.sh stop      stop them
#   slurm/test-cluster.sh env       print `export SLURM_CONF=...` for the shell that submits jobs
#
# Needs root (daemons, namespaces). Everything listens on loopback only in practice; do not run it on a machine
# whose ports are exposed. Ports: slurmctld 6817, slurmdbd 6819, slurmd 6821/6822. See ../shared/slurm-test-cluster.md for what was measured.
set -euo pipefail

DIR=${SLURM_TEST_DIR:-/tmp/slurm-test-cluster}
CONF=$DIR/etc/slurm.conf
CONTROLLER=$(hostname -s)

log() { echo "[test-cluster] $*" >&2; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: poll until COMMAND succeeds
    local limit=$1 what=$2
    shift 2
    for _ in $(seq $((limit * 5))); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.2
    done
    log "gave up waiting for $what"
    return 1
}

install() {
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
    apt-get install -y -qq --no-install-recommends slurmdbd mariadb-server >/dev/null
}

write_configs() {
    mkdir -p "$DIR"/{etc,state,spool,log,run}
    cat >"$DIR/etc/hosts" <<EOF
127.0.0.1 localhost $CONTROLLER
127.0.0.2 n1
127.0.0.3 n2
EOF
    cat >"$CONF" <<EOF
ClusterName=test
SlurmctldHost=$CONTROLLER(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=5
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobRequeue=1
# Preemption as many clusters set it: a higher-priority partition takes the nodes, a job on the lower one gets
# SIGTERM (not the --signal: no PreemptParameters=send_user_signal), GraceTime seconds to save, then SIGKILL.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=n1 NodeHostname=n1 NodeAddr=127.0.0.2 Port=6821 CPUs=2 RealMemory=8000 State=UNKNOWN
NodeName=n2 NodeHostname=n2 NodeAddr=127.0.0.3 Port=6822 CPUs=2 RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=60
PartitionName=urgent Nodes=n1,n2 MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
EOF
    cat >"$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
EOF
    chmod 600 "$DIR/etc/slurmdbd.conf"
}

start() {
    command -v slurmctld >/dev/null || { log "SLURM is not installed: run $0 install"; exit 1; }
    stop >/dev/null 2>&1 || true
    rm -rf "$DIR"  # fresh state: job ids restart at 1
    write_configs
    export SLURM_CONF=$CONF

    mkdir -p /run/munge && chown munge:munge /run/munge
    runuser -u munge -- /usr/sbin/munged --force
    wait_for 10 munge munge -n

    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
    (mariadbd --user=mysql --skip-networking >"$DIR/log/mariadb.log" 2>&1 &)
    wait_for 30 mariadb mysql -e "SELECT 1"
    # Fresh accounting too: job ids restart at 1, and sacct must not answer with an earlier cluster's job 1.
    mysql -e "DROP DATABASE IF EXISTS slurm_acct_db;
              CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
              GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"

    slurmdbd
    wait_for 30 slurmdbd sacctmgr -n list cluster
    sacctmgr -i add cluster test >/dev/null 2>&1 || true

    slurmctld
    wait_for 30 slurmctld scontrol ping
    for node in n1 n2; do
        unshare --uts --mount --propagation private \
            sh -c "hostname $node && mount --bind '$DIR/etc/hosts' /etc/hosts && exec slurmd -N $node"
    done
    wait_for 60 "both nodes idle" sh -c '[ "$(sinfo -h -N -t idle -o %N | sort -u | wc -l)" = 2 ]'
    log "up: $(sinfo -h -N -o '%N %T' | sort -u | tr '\n' ' ') (export SLURM_CONF=$CONF)"
}

stop() {
    export SLURM_CONF=$CONF
    for pidfile in "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid" "$DIR/run/slurmdbd.pid"; do
        [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
    pkill -x slurmd 2>/dev/null || true
    pkill -x slurmstepd 2>/dev/null || true
    pkill -x slurmctld 2>/dev/null || true
    pkill -x slurmdbd 2>/dev/null || true
    mysqladmin shutdown 2>/dev/null || pkill -x mariadbd 2>/dev/null || true
    pkill -x munged 2>/dev/null || true
    log "stopped"
}

case ${1:-} in
    install) install ;;
    start) start ;;
    stop) stop ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 install|start|stop|env" >&2; exit 2 ;;
esac
