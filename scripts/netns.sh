#!/usr/bin/env bash
# Fake "nodes" for bench-net tests: network namespaces on one bridge, each link tbf-shaped both ways.
#
#   scripts/netns.sh up RATE0 [RATE1 ...]   one namespace per rate (Mbit/s, or "none" for an unshaped link)
#   scripts/netns.sh down                   remove every namespace, veth, bridge and route this script made
#
# Namespace i is $NETNS_PREFIX$i with interface fab0 at $NETNS_SUBNET.(i+1)/24 (the same interface name in every
# namespace, so one GLOO_SOCKET_IFNAME=fab0 serves all). The bridge has no address: the root namespace takes no
# part, traffic stays between our namespaces. SAFETY: the blackhole route for the subnet goes in FIRST, so that
# nothing aimed at those addresses can ever leave the machine; `down` removes it last.
# Needs root and iproute2 (`ip`, `tc`). Environment: NETNS_PREFIX (default lbn), NETNS_SUBNET (default 10.99.77).
set -euo pipefail
P=${NETNS_PREFIX:-lbn}
NET=${NETNS_SUBNET:-10.99.77}
BR=${P}br

case "${NET}" in
  10.99.*) ;;
  *) echo "netns.sh: NETNS_SUBNET must be inside 10.99.0.0/16 (got ${NET})" >&2; exit 2 ;;
esac

shape() {  # shape NS(or "") DEV MBIT: tbf with burst = rate x 4 ms (>= rate x 2 ms, else gloo gets ~half rate)
  local ns=$1 dev=$2 mbit=$3
  local burst=$(( mbit * 1000000 / 8 * 4 / 1000 ))
  (( burst < 32768 )) && burst=32768
  if [ -n "$ns" ]; then
    ip netns exec "$ns" tc qdisc replace dev "$dev" root tbf rate "${mbit}mbit" burst "$burst" latency 50ms
  else
    tc qdisc replace dev "$dev" root tbf rate "${mbit}mbit" burst "$burst" latency 50ms
  fi
}

up() {
  [ $# -ge 1 ] || { echo "usage: netns.sh up RATE0 [RATE1 ...]" >&2; exit 2; }
  ip route replace blackhole "${NET}.0/24" metric 4000
  ip link add "$BR" type bridge
  ip link set "$BR" up
  local i=0
  for rate in "$@"; do
    local ns="${P}${i}" host="${P}v${i}"
    ip netns add "$ns"
    ip link add "$host" type veth peer name fab0 netns "$ns"
    ip link set "$host" master "$BR" up
    ip -n "$ns" addr add "${NET}.$((i + 1))/24" dev fab0
    ip -n "$ns" link set fab0 up
    ip -n "$ns" link set lo up
    if [ "$rate" != none ]; then
      shape "$ns" fab0 "$rate"  # node -> bridge
      shape "" "$host" "$rate"  # bridge -> node
    fi
    i=$((i + 1))
  done
}

down() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${P}[0-9]+$" || true); do
    # processes we started inside our namespaces (bench ranks, torchrun agents): by pid, not by name
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
  local link
  for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E "^${P}v[0-9]+$" || true); do
    ip link del "$link" 2>/dev/null || true
  done
  ip link del "$BR" 2>/dev/null || true
  ip route del blackhole "${NET}.0/24" metric 4000 2>/dev/null || true
}

case "${1:-}" in
  up) shift; down; up "$@" ;;
  down) down ;;
  *) echo "usage: netns.sh up RATE0 [RATE1 ...] | down" >&2; exit 2 ;;
esac
