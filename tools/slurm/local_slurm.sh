#!/usr/bin/env bash
# A one-machine Slurm cluster for tests and CI: controller and node daemon on localhost.
#
#   tools/slurm/local_slurm.sh start     # install Slurm if missing (root), write the config, start
#   eval "$(tools/slurm/local_slurm.sh env)"   # then: sbatch, squeue, scontrol ...
#   tools/slurm/local_slurm.sh status
#   tools/slurm/local_slurm.sh stop      # stop the daemons (by their pid files)
#
# Everything lives under SLURM_LOCAL_DIR (default /tmp/parm-slurm): slurm.conf, state,
# spool, pid and log files; nothing is written to /etc/slurm. Authentication is auth/none
# (no munge), no cgroups, no accounting; one node `localhost` with CPUS (default 4) CPUs,
# declared even on a smaller machine (SlurmdParameters=config_overrides).
set -euo pipefail
DIR="${SLURM_LOCAL_DIR:-/tmp/parm-slurm}"
CPUS="${CPUS:-4}"
CONF="$DIR/slurm.conf"
SLURM_USER="$(id -un)"

install_slurm() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null && return
    if [ "$(id -u)" != 0 ]; then
        echo "Slurm is not installed and installing it needs root" >&2; exit 1
    fi
    echo "installing slurmctld slurmd slurm-client ..."
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        slurmctld slurmd slurm-client >/dev/null 2>&1 || {
        apt-get update >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            slurmctld slurmd slurm-client >/dev/null
    }
}

write_config() {
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
    cat > "$CONF" <<CONF
ClusterName=parmlocal
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=$SLURM_USER
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
    install_slurm
    if alive "$DIR/slurmctld.pid"; then echo "already running ($DIR)"; return; fi
    write_config
    export SLURM_CONF="$CONF"
    slurmctld -f "$CONF"
    slurmd -f "$CONF" -N localhost
    for _ in $(seq 1 60); do   # ~1 s normally
        if sinfo -h -N -o "%T" 2>/dev/null | grep -qE "^(idle|mixed|allocated)"; then
            echo "local Slurm up: SLURM_CONF=$CONF"; return
        fi
        sleep 0.5
    done
    echo "local Slurm did not come up; logs:" >&2
    tail -n 30 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" >&2 || true
    exit 1
}

stop() {
    local name pid
    for name in slurmd slurmctld; do   # node daemon first
        if alive "$DIR/$name.pid"; then
            pid="$(cat "$DIR/$name.pid")"
            kill "$pid"
            for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fi
        rm -f "$DIR/$name.pid"
    done
    echo "local Slurm stopped"
}

status() {
    if alive "$DIR/slurmctld.pid"; then
        SLURM_CONF="$CONF" sinfo -N -l
        SLURM_CONF="$CONF" squeue
    else
        echo "local Slurm not running ($DIR)"; return 3
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    logs) tail -n 50 "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" ;;
    *) echo "local_slurm.sh: error: ${1:+unknown command '$1'; }give one of start, stop, status, env," \
            "logs" >&2
       exit 2 ;;
esac
