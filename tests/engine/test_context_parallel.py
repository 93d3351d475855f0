"""Context parallelism in the engine: torch's ring attention (with the CPU kernel registered in its ring handlers,
llmctl.engine.context_parallel) trains exactly as data parallelism does.

Each case of tests/engine/parallel_runs.py (one 4-rank torchrun with the tensor-parallel cases) trains 5 steps with
cp ranks sharing a micro-batch against FSDP2 over 4 ranks with the same global batch (fp32: losses, gradient norms
and every parameter's gradient within 1e-5): cp 2 and 4, with and without the head-tail load balance, with the
all-gather and the all-to-all rotation, FSDP2 2 x CP 2, HSDP x CP, TP 2 x CP 2, for Llama, Qwen 3 (q/k norms) and
Mixtral (MoE). The ring itself is checked on its own: attention and its gradients against whole-sequence SDPA on 2
ranks, each rank's positions are the load balancer's chunks, and the ring's steps really ran (the kernel is called
cp times per rank in forward, not once on the whole sequence).
"""

from __future__ import annotations

import pytest

from tests.engine.parallel_runs import CP_CASES, assert_trains_like_reference

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")

from llmctl.errors import InputError  # noqa: E402


@pytest.mark.parametrize("case", list(CP_CASES))
def test_cp_trains_like_data_parallel(parallel_cases: dict, case: str) -> None:
    ref, cp = parallel_cases[case]
    assert_trains_like_reference(ref, cp)


@pytest.mark.parametrize("case", ["llama-cp2", "llama-cp4-alltoall", "llama-tp2-cp2"])
def test_cp_ranks_hold_a_shard_of_the_fsdp_group(parallel_cases: dict, case: str) -> None:
    """FSDP shards the states over data-parallel ranks x cp: at 4 ranks every rank of a cp run holds a quarter of the
    parameter, gradient and AdamW bytes (the estimate's lines, to 0.5%), as the reference does."""
    from llmctl.engine.dryrun import estimated_lines
    from llmctl.engine.model import model_spec_for
    from llmctl.spec.planfile import load_plan

    ref, cp = parallel_cases[case]
    plan = load_plan(parallel_cases["_plans"][case][1])
    est = estimated_lines(model_spec_for(plan.model), plan.setup)
    for kind in ("parameters", "gradients", "optimizer"):
        for r, rank in enumerate(cp["state_bytes"]):
            assert abs(rank[kind] / est[kind] - 1) <= 0.005, (case, kind, r, rank[kind], est[kind])
    if "tp" not in case:  # without tp nothing is replicated: the same bytes as the 4-way FSDP reference
        assert cp["state_bytes"] == ref["state_bytes"]


def test_the_ring_runs_and_matches_whole_sequence_attention(parallel_cases: dict) -> None:
    """SDPA inside the split (4 ranks, one cp group) equals whole-sequence SDPA at the rank's positions, output and
    q/k/v gradients (1e-5, fp32). The head-tail balance gives rank i chunks i and 7-i of 8; each rank's ids and
    targets are cut at the same positions. The CPU kernel ran as the ring's steps: 4 forward blocks on every rank
    with the balance (every step has work); without it rank i skips the steps whose keys are all in its future."""
    ring = parallel_cases["_ring"]
    assert len(ring) == 4
    for rank, r in enumerate(ring):
        for mode in ("balanced", "unbalanced"):
            assert r[mode]["max_diff"] <= 1e-5, (rank, mode, r[mode]["max_diff"])
            assert r[mode]["ids_match"], (rank, mode)
        chunk = 4  # 32 tokens in 8 chunks
        head, tail = rank, 7 - rank
        assert r["balanced"]["positions"] == [
            *range(head * chunk, head * chunk + chunk),
            *range(tail * chunk, tail * chunk + chunk),
        ]
        assert r["unbalanced"]["positions"] == list(range(rank * 8, rank * 8 + 8))
        assert r["balanced"]["calls"] == {"forward": 4, "backward": 4}
        assert r["unbalanced"]["calls"] == {"forward": rank + 1, "backward": rank + 1}


def test_attention_selection_with_cp() -> None:
    from llmctl.engine.model import select_attention

    assert select_attention("auto", True, True, cp=2)[0] == "sdpa"  # flash-attn's own kernel has no ring
    assert select_attention("auto", True, True, cp=1)[0] == "flash_attention_2"
    with pytest.raises(InputError, match="flash does not run context parallelism"):
        select_attention("flash", True, True, cp=2)


def test_the_split_cuts_ids_targets_and_positions_per_rank_in_one_process() -> None:
    """SequenceSplit on each rank of a 2-rank cp mesh, one rank at a time in this process (torch's fake process group:
    the cut itself is local, no collective runs): with the head-tail balance rank r holds chunks r and 3-r of 4, without
    it the r-th half; its ids, targets and positions are cut at the same places; while the block is open torch's ring
    runs with the plan's balance and rotation; the caller's batch is left whole."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import _cp_options, _RotateMethod
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from llmctl.engine.context_parallel import SequenceSplit
    from llmctl.engine.data import Batch

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    chunks = {True: {0: (0, 3), 1: (1, 2)}, False: {0: (0, 1), 1: (2, 3)}}  # 16 tokens: 4 chunks of 4
    rotation = {"allgather": _RotateMethod.ALL_GATHER, "alltoall": _RotateMethod.ALL_TO_ALL}
    for rank in (0, 1):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        try:
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
            for balance, rotate in ((True, "alltoall"), (False, "allgather"), (False, "alltoall")):
                ids = torch.arange(17).expand(2, 17) * 10  # a token's id says where it came from
                inputs, targets = ids[:, :-1], ids[:, 1:]
                with SequenceSplit(mesh["cp"], balance, rotate)(Batch(inputs, targets)) as part:
                    assert _cp_options.enable_load_balance is balance and _cp_options.rotate_method == rotation[rotate]
                    want = [t for c in chunks[balance][rank] for t in range(4 * c, 4 * c + 4)]
                    assert part.positions.tolist() == [want, want], (rank, balance)
                    assert part.inputs.tolist() == [[10 * t for t in want]] * 2, (rank, balance)
                    assert part.targets.tolist() == [[10 * t + 10 for t in want]] * 2, (rank, balance)
                assert torch.equal(inputs, torch.arange(16).expand(2, 16) * 10)  # the caller's batch untouched
                assert torch.equal(targets, torch.arange(1, 17).expand(2, 16) * 10)
        finally:
            dist.destroy_process_group()
