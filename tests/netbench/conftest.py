"""Fixtures for bench-net tests: free ports, a torch-free env for subprocesses, and network-namespace "nodes".

Namespace safety (scripts/netns.sh's header): scripts/netns.sh adds the blackhole route for the test
subnet before any address is configured, and `down` (run in a finally, even when a test fails) removes every
namespace, veth, the bridge and the route. Traffic goes only between our own namespaces.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # for netbench_helpers (tests run with --import-mode=importlib)
from netbench_helpers import NETNS_SH  # noqa: E402


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "iproute2 (ip, tc) is not installed (scripts/system-deps.sh installs it)"
    probe = subprocess.run(["ip", "netns", "add", "lbnprobe"], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", "lbnprobe"], capture_output=True)
    if probe.returncode != 0:
        return f"this machine does not allow network namespaces: {probe.stderr.strip()[:200]}"
    return None


@dataclass
class NetnsCluster:
    prefix: str
    subnet: str
    names: list[str]

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def exec_argv(self, i: int, argv: list[str]) -> list[str]:
        """argv run inside namespace i (`ip netns exec` keeps the caller's environment)."""
        return ["ip", "netns", "exec", f"{self.prefix}{i}", *argv]


@pytest.fixture
def netns_cluster(request: pytest.FixtureRequest) -> Iterator[Callable[[list[int | str]], NetnsCluster]]:
    """Factory: netns_cluster([1000, 1000]) -> namespaces joined by links shaped to those Mbit/s."""
    reason = _netns_unavailable()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the namespace tests cannot run: {reason}")
        print(f"SKIP netns: {reason}")
        pytest.skip(reason)
    # A prefix and subnet of our own, so that other tests' namespaces (e.g. SLURM's) are never touched.
    prefix = "lbn"
    subnet = "10.99.77"
    env = dict(os.environ, NETNS_PREFIX=prefix, NETNS_SUBNET=subnet)
    made: list[NetnsCluster] = []

    def make(rates_mbit: list[int | str]) -> NetnsCluster:
        subprocess.run(
            ["bash", str(NETNS_SH), "up", *map(str, rates_mbit)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        c = NetnsCluster(prefix, subnet, [f"{prefix}{i}" for i in range(len(rates_mbit))])
        made.append(c)
        return c

    try:
        yield make
    finally:
        subprocess.run(["bash", str(NETNS_SH), "down"], env=env, capture_output=True, timeout=60)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
        assert prefix + "0" not in left and f"{subnet}.0/24" not in routes, "netns teardown left something"
