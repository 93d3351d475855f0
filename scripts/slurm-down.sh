#!/usr/bin/env bash
# Stop the single-host SLURM started by scripts/slurm-up.sh and remove its folder.
# Kills only processes it can trace to that cluster: the daemons named in its pid files and their
# descendants (slurmstepd, job processes). Safe to run twice, or when nothing is running.
set -uo pipefail

DIR=${LLMCTL_SLURM_DIR:-/tmp/llmctl-slurm}
log() { echo "slurm-down: $*"; }

[ -d "$DIR" ] || { log "nothing to stop ($DIR absent)"; exit 0; }
CONF=$DIR/etc/slurm.conf
export SLURM_CONF=$CONF

# Process tree from /proc (no procps needed): "pid ppid" per line.
ptable() {
  local f line ppid
  for f in /proc/[0-9]*/stat; do
    read -r line <"$f" 2>/dev/null || continue
    read -r _ ppid _ <<<"${line##*) }"   # after "pid (comm) ": "state ppid ..."
    echo "${f//[^0-9]/} $ppid"
  done
}
descendants() {  # all descendants of pid $1, from the table taken before anything was killed
  local k
  while read -r k; do
    [ -n "$k" ] && { echo "$k"; descendants "$k"; }
  done < <(awk -v p="$1" '$2 == p {print $1}' <<<"$TABLE")
}

pids=()
for f in "$DIR"/run/slurmd-*.pid "$DIR"/run/slurmctld.pid "$DIR"/munge/munged.pid; do
  [ -s "$f" ] || continue
  p=$(cat "$f")
  kill -0 "$p" 2>/dev/null && pids+=("$p")
done

# Cancel jobs first so slurmd can clean up its steps, then stop the daemons.
if [ -f "$CONF" ] && command -v scancel >/dev/null 2>&1 && [ ${#pids[@]} -gt 0 ]; then
  jobs=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
  if [ -n "$jobs" ]; then
    # shellcheck disable=SC2086
    timeout 10 scancel $jobs 2>/dev/null || true
    sleep 2
  fi
fi

TABLE=$(ptable)
all=()
for p in "${pids[@]}"; do
  all+=("$p")
  while read -r d; do [ -n "$d" ] && all+=("$d"); done < <(descendants "$p")
done
# Job step daemons may already have been re-parented to init; find them by their spool folder use.
for comm in /proc/[0-9]*/comm; do
  [ "$(cat "$comm" 2>/dev/null)" = slurmstepd ] || continue
  s=${comm#/proc/}; s=${s%/comm}
  cwd=$(readlink "/proc/$s/cwd" 2>/dev/null || true)
  if [[ "$cwd" == "$DIR"/* ]]; then
    all+=("$s")
    while read -r d; do [ -n "$d" ] && all+=("$d"); done < <(descendants "$s")
  fi
done

if [ ${#all[@]} -gt 0 ]; then
  log "stopping ${#all[@]} processes"
  kill -TERM "${all[@]}" 2>/dev/null || true
  for _ in $(seq 50); do
    left=()
    for p in "${all[@]}"; do kill -0 "$p" 2>/dev/null && left+=("$p"); done
    [ ${#left[@]} -eq 0 ] && break
    sleep 0.2
  done
  [ ${#left[@]} -gt 0 ] && kill -KILL "${left[@]}" 2>/dev/null
fi
rm -rf "$DIR"
log "stopped and removed $DIR"
