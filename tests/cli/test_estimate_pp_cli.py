"""`llmctl estimate-memory --pp`: every pipeline rank's memory, the heaviest the answer, checked by hand on the
published shape of Llama 3.1 405B's run (torchtitan: 512 H100, tp 8 x pp 8 x FSDP 8)."""

import json

from typer.testing import CliRunner

from llmctl.cli.main import app

ARGV = [
    *("estimate-memory", "llama-3.1-405b", "--gpu", "H100", "--nodes", "64", "--gpus-per-node", "8"),
    *("--tp", "8", "--pp", "8", "--pp-schedule", "interleaved-1f1b", "--seq-len", "8192"),
]
GIB = 1024**3


def run(*extra: str):
    r = CliRunner().invoke(app, [*ARGV, *extra])
    assert r.exit_code == 0, r.output
    return r


def test_405b_interleaved_by_hand():
    """By hand. 126 blocks + embedding + head = 128 "layers" over pp 8 x 2 = 16 stages: 8 each, so stage 0 is the
    embedding + 7 blocks, stage 15 is 7 blocks + norm + head, the others 8 blocks. Rank r runs stages r and r + 8:
    ranks 0 and 7 hold 15 blocks, ranks 1-6 hold 16.

    One block on one tp rank (h 16384, 128 heads / 8 = 16, 8 kv heads / 8 = 1, head dim 128, MLP 53248 / 8 = 6656):
    q 16384 x 2048 + k, v 16384 x 128 x 2 + o 2048 x 16384 = 71,303,168; MLP 3 x 16384 x 6656 = 327,155,712; two
    norms 32,768 (replicated) = 398,491,648. Ranks 1-6: 16 blocks = 6,375,866,368 parameters. Rank 0: 15 blocks +
    the embedding 128256 x 16384 / 8 = 262,668,288 -> 6,240,043,008; rank 7: 15 blocks + head 262,668,288 + final
    norm 16,384 -> 6,240,059,392.

    Rank 1 (the heaviest), FSDP over 512 / 64 = 8: fp32 masters 4 x 6,375,866,368 / 8 = 3,187,933,184, fp32 gradients
    the same, AdamW 8 x / 8 = 6,375,866,368. Under pipelining FSDP2 neither reshards nor reduces per micro-batch: the
    bf16 parameters whole 2 x 6,375,866,368 = 12,751,732,736 and the fp32 gradients whole 4 x = 25,503,465,472.
    One micro-batch per run (grad accumulation 1): interleaved holds min((v - 1) pp + 2 (pp - r - 1) + 1, m v) = 2
    stage-micro-batches, one of stage 1 and one of stage 9 (8 blocks each). A block keeps, b 1, s 8192, tp 8 under
    sequence parallelism (1024 tokens a rank in the norms), bf16: norms 2 x (2 x 1024 x 16384 + 4 x 1024) =
    67,117,056, their fp32 copies 2 x 4 x 1024 x 16384 = 134,217,728; attention input 2 x 8192 x 16384 +
    q/k/v 2 x 8192 x (2048 + 128 + 128) + output 2 x 8192 x 2048 = 339,738,624, logsumexp 4 x 16 x 8192 = 524,288;
    MLP input + gate/up/product 2 x 8192 x 16384 + 3 x 2 x 8192 x 6656 = 595,591,168, silu(gate) 109,051,904:
    1,246,240,768 a block, x 16 = 19,939,852,288, + the rotary tables 2 x 8192 x 128 x 2 = 4,194,304 per stage
    forward x 2 = 19,948,240,896. The boundary, 8192 / 8 x 16384 x 2 = 33,554,432: two stage outputs kept for backward
    (67,108,864), receive buffers for both stages both ways (4 x: 134,217,728), the inputs' gradients (2 x:
    67,108,864). Backward: 3,187,933,184 x 2 + 6,375,866,368 + 12,751,732,736 + 25,503,465,472 + 19,948,240,896 +
    67,108,864 + 134,217,728 + 67,108,864 = 71,223,607,296; + 10% headroom (7,122,360,729) + 1 GiB context =
    79,419,709,849 (73.97 GiB): fits an H100's 79.6 GiB, with 5.6 GiB to spare."""
    d = json.loads(run("--json").output)
    pipe = d["pipeline"]
    assert (pipe["schedule"], pipe["stages_total"], pipe["virtual_stages"], pipe["microbatches"]) == (
        "interleaved-1f1b",
        16,
        2,
        1,
    )
    ranks = pipe["ranks"]
    assert [r["stages"] for r in ranks] == [[r, r + 8] for r in range(8)]
    assert [r["blocks"] for r in ranks] == [15] + [16] * 6 + [15]
    assert [r["params"] for r in ranks] == [6_240_043_008] + [6_375_866_368] * 6 + [6_240_059_392]
    assert pipe["heaviest_rank"] == 1
    heaviest = ranks[1]
    assert heaviest["states_bytes"] == 6_375_866_368
    assert heaviest["params_bytes"] == 3_187_933_184 + 12_751_732_736
    assert heaviest["grads_bytes"] == 3_187_933_184 + 25_503_465_472
    assert heaviest["activations_bytes"] == 19_948_240_896 + 67_108_864 + 134_217_728 + 67_108_864
    assert d["phase_bytes"]["backward"] == 71_223_607_296
    assert d["per_gpu_total_bytes"] == heaviest["per_gpu_total_bytes"] == 79_419_709_849
    assert d["fits"] is True


def test_table_shows_every_stage():
    out = run().output
    assert "Per pipeline rank (interleaved-1f1b, 16 stages, 2 per rank, 1 micro-batch per schedule run" in out
    rows = [line for line in out.splitlines() if line.startswith("│") and ("6.24B" in line or "6.38B" in line)]
    assert len(rows) == 8
    assert "73.97 (heaviest)" in rows[1] and "0, 8" in rows[0] and "7, 15" in rows[7]
    assert "unsharded gradients (pp: accumulated until the schedule's reduce-scatter)" in out


def test_pp1_has_no_pipeline_section():
    r = CliRunner().invoke(app, ["estimate-memory", "llama-3.1-8b", "--gpus", "8", "--json"])
    assert r.exit_code == 0, r.output
    assert "pipeline" not in json.loads(r.output)


def test_strategies_a_pipeline_leaves_no_room_for_say_why():
    """pp 4 on 16 GPUs leaves 4 data-parallel ranks, fewer than a node's hybrid shard group: that row says so, the
    command still answers."""
    r = CliRunner().invoke(
        app,
        [
            *("estimate-memory", "llama-3.1-70b", "--gpu", "H100", "--nodes", "2", "--gpus-per-node", "8"),
            *("--pp", "4", "--grad-accum", "16", "--pp-microbatches", "8", "--checkpointing", "full", "--json"),
        ],
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert "does not divide the 4 data-parallel ranks" in d["min_gpus_by_strategy"]["hybrid_shard"]["note"]
    assert [x["in_flight"] for x in d["pipeline"]["ranks"]] == [4, 3, 2, 1]
