"""The price of an expert-parallel all-to-all (llmctl.plan.network.alltoall_time): hand-derived numbers on a network
without a measurement (links in GB/s, alphas given), one case per way an ep group can sit on the nodes."""

from __future__ import annotations

import pytest

from llmctl.errors import InputError
from llmctl.plan import comm as cm
from llmctl.plan.network import alltoall_time

S = 8e8  # bytes each rank sends in all: ep chunks of S/ep, its own included
# 100 GB/s per GPU inside a node, 400 Gbit/s = 50 GB/s of NICs per node of 8 GPUs: 6.25 GB/s each
NET = cm.Network(intra_gbytes_s=100.0, inter_node_gbytes_s=50.0, alpha_intra_s=1e-6, alpha_inter_s=1e-5)


def test_inside_one_node_the_ep_group_crosses_nvlink_only() -> None:
    # ep 8 on a node of 8: 7/8 of S = 7e8 bytes at 100 GB/s = 7 ms, + 7 messages x 1 us
    assert alltoall_time(NET, S, 8, 8) == pytest.approx(7e-3 + 7e-6)
    assert alltoall_time(NET, S, 8, 8) == pytest.approx(cm.collective_time_s("all_to_all", 8, S, 100.0, 1e-6))
    # ep 2: half of S, 4e8 / 1e11 = 4 ms + 1 us; a single node needs no inter-node bandwidth at all
    assert alltoall_time(cm.Network(100.0, None, 1e-6, 1e-5), S, 2, 8) == pytest.approx(4e-3 + 1e-6)


def test_over_two_nodes_half_the_bytes_leave_through_a_gpus_share_of_the_nics() -> None:
    # ep 16 over 2 nodes of 8: 7/16 of S to node-mates (3.5e8 B / 100 GB/s = 3.5 ms) while 8/16 of S leaves the node
    # through 50/8 = 6.25 GB/s per GPU (4e8 / 6.25e9 = 64 ms): the NICs set the time; + 15 messages x 10 us
    assert alltoall_time(NET, S, 16, 8) == pytest.approx(0.064 + 15e-5)


def test_one_rank_per_node_sends_all_but_its_own_chunk_over_the_nics() -> None:
    # ep 4, one rank on each of 4 nodes: 3/4 of S = 6e8 B / 6.25e9 = 96 ms, + 3 x 10 us
    assert alltoall_time(NET, S, 4, 8, ep_in_node=1) == pytest.approx(0.096 + 3e-5)


def test_a_group_strided_by_tensor_parallelism_has_half_a_node_on_each() -> None:
    # ep 8 over 2 nodes, 4 ranks on each (tp 2): 4/8 of S off the node (4e8 / 6.25e9 = 64 ms), 3/8 over NVLink
    assert alltoall_time(NET, S, 8, 8, ep_in_node=4) == pytest.approx(0.064 + 7e-5)


def test_the_links_run_together_the_slower_sets_the_time() -> None:
    # a measured curve where the intra-node link is the slow one: ep 16, 8 per node, NVLink 2 GB/s, NICs 100 GB/s per
    # GPU: 3.5e8 / 2e9 = 175 ms against 4e8 / 1e11 = 4 ms: the max (175 ms), not the sum
    seen = []

    def curve(collective: str, scope: str, size: float) -> float:
        seen.append((collective, scope, size))
        return {"intra": 2.0, "inter": 100.0}[scope]

    net = cm.Network(100.0, 50.0, 0.0, 0.0, curve=curve)
    assert alltoall_time(net, S, 16, 8) == pytest.approx(0.175)
    assert seen == [("all_to_all", "intra", S), ("all_to_all", "inter", S)]  # read at S, its own sweeps


def test_nothing_moves_and_a_group_that_does_not_fit_is_refused() -> None:
    assert alltoall_time(NET, S, 1, 8) == alltoall_time(NET, 0, 8, 8) == 0.0
    with pytest.raises(InputError, match="cannot put 3 ranks on each node"):
        alltoall_time(NET, S, 8, 8, ep_in_node=3)
    with pytest.raises(InputError, match="no inter-node bandwidth"):
        alltoall_time(cm.Network(100.0, None), S, 16, 8)
