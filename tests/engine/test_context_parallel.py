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
