#!/usr/bin/env bash
# Start a real single-host SLURM with fake nodes (node1, node2, ...: $LLMCTL_SLURM_NODES, default 2) for llmctl's
# tests and demos.
#
#   sudo scripts/slurm-up.sh            # installs Debian's slurm-wlm + munge if missing, starts, waits for idle
#   export SLURM_CONF=/tmp/llmctl-slurm/etc/slurm.conf   # (printed at the end) so sbatch/squeue find it
#   scripts/slurm-down.sh               # stops everything this script started and removes its folder
#
# Idempotent: a daemon whose pid file points at a live process is left alone. Everything lives under
# $LLMCTL_SLURM_DIR (default /tmp/llmctl-slurm): config, munge key and socket, state, spool, logs, pid files.
# It uses its own ports and munge socket, so it does not touch a system-wide SLURM or munge.
# Choices that work here (see the environment notes): proctrack/linuxproc, task/none, select/cons_tres,
# no accounting storage, `slurmd -N nodeI` with a distinct Port per node, all nodes on this one host.
# JobRequeue=0: a batch job is requeueable only when it asks (the sbatch template's `#SBATCH --requeue`, submitit's
# requeue parameter), so the requeue tests fail if llmctl's own request goes missing (SLURM's default is 1).
set -euo pipefail

DIR=${LLMCTL_SLURM_DIR:-/tmp/llmctl-slurm}
CTLD_PORT=${LLMCTL_SLURM_PORT:-6917}
NODES=()
for i in $(seq "${LLMCTL_SLURM_NODES:-2}"); do NODES+=("node$i"); done
CPUS_PER_NODE=${LLMCTL_SLURM_CPUS:-2}
WAIT_S=${LLMCTL_SLURM_WAIT_S:-60}

log() { echo "slurm-up: $*"; }
die() { echo "slurm-up: error: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (slurmd and munged need it)"

need=()
command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld)
command -v slurmd >/dev/null 2>&1 || need+=(slurmd)
command -v sbatch >/dev/null 2>&1 || need+=(slurm-client)
command -v munged >/dev/null 2>&1 || need+=(munge)
if [ ${#need[@]} -gt 0 ]; then
  command -v apt-get >/dev/null 2>&1 || die "missing ${need[*]} and no apt-get to install them"
  log "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

mkdir -p "$DIR"/{etc,state,log,run}
chmod 0755 "$DIR"
HOST=$(hostname -s)
CONF=$DIR/etc/slurm.conf
MUNGE=$DIR/munge
SOCK=$MUNGE/munge.socket

# munge: own key, socket, pid and log, run as the munge user (munged refuses insecure ownership).
if ! alive "$MUNGE/munged.pid"; then
  mkdir -p "$MUNGE"
  if [ ! -s "$MUNGE/munge.key" ]; then
    dd if=/dev/urandom of="$MUNGE/munge.key" bs=1024 count=1 status=none
  fi
  chown -R munge:munge "$MUNGE"
  chmod 0711 "$MUNGE"
  chmod 0400 "$MUNGE/munge.key"
  rm -f "$SOCK" "$SOCK.lock"
  runuser -u munge -- munged --socket="$SOCK" --key-file="$MUNGE/munge.key" \
    --pid-file="$MUNGE/munged.pid" --log-file="$MUNGE/munged.log" --seed-file="$MUNGE/munged.seed"
  for _ in $(seq 50); do [ -S "$SOCK" ] && break; sleep 0.1; done
  [ -S "$SOCK" ] || die "munged did not create $SOCK (see $MUNGE/munged.log)"
  log "munged started"
fi
# The socket folder must be reachable by slurm's daemons (root) and by job steps.
chmod 0711 "$MUNGE"

node_lines=""
i=0
for n in "${NODES[@]}"; do
  i=$((i + 1))
  # Distinct loopback addresses per fake node, so the rendezvous really uses the first node's NodeAddr.
  node_lines+="NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.$i Port=$((CTLD_PORT + i)) CPUs=$CPUS_PER_NODE"
  node_lines+=" RealMemory=2000 State=UNKNOWN"$'\n'
done

cat >"$CONF.new" <<EOF
# Written by llmctl scripts/slurm-up.sh: a single-host test cluster with fake nodes.
ClusterName=llmctl
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCK
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SlurmdTimeout=60
InactiveLimit=0
KillWait=30
MinJobAge=600
JobRequeue=0
$node_lines
PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP
EOF
if ! cmp -s "$CONF.new" "$CONF"; then mv "$CONF.new" "$CONF"; else rm -f "$CONF.new"; fi
export SLURM_CONF=$CONF

if ! alive "$DIR/run/slurmctld.pid"; then
  slurmctld -f "$CONF"
  log "slurmctld started"
fi
for n in "${NODES[@]}"; do
  mkdir -p "$DIR/spool/$n"
  if ! alive "$DIR/run/slurmd-$n.pid"; then
    slurmd -f "$CONF" -N "$n"
    log "slurmd $n started"
  fi
done

for _ in $(seq $((WAIT_S * 2))); do
  states=$(sinfo -h -N -o '%T' 2>/dev/null | sort -u | tr '\n' ' ' || true)
  if [ "$states" = "idle " ] || [ "$states" = "mixed " ] || [ "$states" = "allocated " ]; then
    break
  fi
  sleep 0.5
done
case "$states" in
  "idle " | "mixed " | "allocated ") ;;
  *) die "nodes not ready after ${WAIT_S}s (states: ${states:-none}; logs in $DIR/log)" ;;
esac
sinfo -N
log "ready. Use: export SLURM_CONF=$CONF"
