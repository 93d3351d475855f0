"""`llmctl plan` through typer's CliRunner: exit codes, --json keys, plan.yaml, bench-net and metrics inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.spec import bench
from llmctl.spec.planfile import load_plan

runner = CliRunner()
SEED = [  # the seed's data-parallel question (pinned --pp 1: with pipelines searched, PP 2 wins on its slow link)
    "plan",
    "llama-2-7b",
    "--pp",
    "1",
    "--gpu",
    "A100-80GB",
    "--nodes",
    "2",
    "--gpus-per-node",
    "4",
    "--inter-gbps",
    "50",
    "--seq-len",
    "1024",
    "--tp",
    "1",  # the seed's story is data parallelism; TP on the seed: tests/plan/test_tp_cli.py
    "--cp",
    "1",  # and CP: tests/plan/test_cp_cli.py
    "--global-batch",
    "128",
]
KEYS = {
    "strategy",
    "nodes",
    "micro_batch",
    "grad_accum",
    "checkpointing",
    "attention",
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "mfu",
    "memory_per_gpu_bytes",
}
MiB = 2**20


def invoke(args: list[str]):
    return runner.invoke(app, args, catch_exceptions=False)


def test_json_has_chosen_and_candidates_and_writes_a_valid_plan(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    r = invoke([*SEED, "--json", "-o", str(out), "--tokens", "2B", "--price", "1.5"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert set(data["chosen"]) >= KEYS and data["candidates"]
    assert all(set(c) >= KEYS for c in data["candidates"])
    assert data["chosen"]["strategy"] == "hybrid_shard" and data["chosen"]["checkpointing"] == "selective"
    assert data["memory_choice"].startswith("selective checkpointing: micro-batch 16 fits")
    assert data["chosen"]["budget_cost_usd"] > 0 and len(data["why_lost"]) == len(data["candidates"]) - 1
    plan = load_plan(out)
    assert plan.parallel.sharding == "hybrid_shard" and plan.hardware.nodes == 2 and plan.hardware.nproc_per_node == 4
    assert plan.training.micro_batch_size * plan.training.grad_accum_steps * plan.world_size == 128
    assert plan.training.token_budget == 2_000_000_000
    assert plan.training.activation_checkpointing == "selective"
    assert plan.training.loss_chunk_tokens == data["chosen"]["loss_chunk_tokens"]
    assert plan.predicted.tokens_per_s == pytest.approx(data["chosen"]["tokens_per_s"], rel=1e-3)
    assert plan.predicted.memory_per_gpu_bytes == data["chosen"]["memory_per_gpu_bytes"]


def test_table_output_explains_the_losers(tmp_path: Path) -> None:
    r = invoke([*SEED, "-o", str(tmp_path / "p.yaml")])
    assert r.exit_code == 0, r.output
    assert "chosen" in r.output and "why the others lost" in r.output
    assert "FULL_SHARD over 2 nodes" in r.output and "exposed communication" in r.output
    assert f"plan written to {tmp_path / 'p.yaml'}" in r.output


def test_never_clobbers_an_existing_plan(tmp_path: Path) -> None:
    """An existing -o file is refused before the plan is searched or shown: one line, exit 2, the file untouched."""
    out = tmp_path / "plan.yaml"
    out.write_text("mine\n")
    for extra in ([], ["--json"]):
        r = invoke([*SEED, "-o", str(out), *extra])
        assert r.exit_code == 2 and "chosen" not in r.output and r.stdout == ""  # nothing of the plan is printed
        assert r.output.strip().splitlines() == [
            f"llmctl: error: {out} already exists; nothing was planned "
            f"(pass --force to replace it, or -o another path (e.g. -o {tmp_path / 'plan-new.yaml'}))"
        ]
        assert out.read_text() == "mine\n"
    r = invoke([*SEED, "-o", str(out), "--force", "--json"])
    assert r.exit_code == 0 and load_plan(out).parallel.sharding == "hybrid_shard"


def test_output_in_a_missing_folder_is_refused_first(tmp_path: Path) -> None:
    """-o into a folder that does not exist is refused as --plot's is (never created), before any plan is shown."""
    out = tmp_path / "no" / "such" / "p.yaml"
    for extra in ([], ["--json"]):
        r = invoke([*SEED, "-o", str(out), *extra])
        assert r.exit_code == 2 and r.stdout == ""
        assert r.output.strip().splitlines() == [f"llmctl: error: -o {out}: folder {out.parent} does not exist"]
    assert not (tmp_path / "no").exists()
    r = invoke([*SEED, "-o", str(tmp_path)])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        f"llmctl: error: -o {tmp_path}: is a folder (give the plan file's name, e.g. -o {tmp_path / 'plan.yaml'})"
    ]
    # --params writes no plan file: an existing plan.yaml is no reason to refuse it.
    (tmp_path / "plan.yaml").write_text("mine\n")
    r = invoke(["plan", "--params", "7B", "--gpu", "A100-80GB", "-o", str(tmp_path / "plan.yaml"), "--json"])
    assert r.exit_code == 0, r.output


def test_cluster_file(tmp_path: Path) -> None:
    cl = tmp_path / "cluster.yaml"
    cl.write_text("gpu: A100-80GB\nnodes: 2\ngpus_per_node: 4\ninter_node_gbps: 50\nprice_per_gpu_hour: 2\n")
    r = invoke(
        [
            "plan",
            "llama-2-7b",
            "--cluster",
            str(cl),
            "--seq-len",
            "1024",
            "--tp",
            "1",
            "--pp",
            "1",
            "--json",
            "--no-write",
        ]
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["chosen"]["strategy"] == "hybrid_shard"
    # the file is the main input; a flag overrides its value
    r = invoke(["plan", "llama-2-7b", "--cluster", str(cl), "--nodes", "4", "--json", "--no-write"])
    assert r.exit_code == 0 and json.loads(r.stdout)["nodes"] == 4, r.output
    cl.write_text("gpu: A100-80GB\nnodes: 2\ngpus_per_node: 4\ninter_node_gbps: -5\n")
    r = invoke(["plan", "llama-2-7b", "--cluster", str(cl), "--no-write"])
    assert r.exit_code == 2 and "inter_node_gbps" in r.output, r.output
    r = invoke(["plan", "llama-2-7b", "--cluster", str(cl), "--inter-gbps", "50", "--json", "--no-write"])
    assert r.exit_code == 0, r.output  # the flag replaced the file's bad value


def test_examples_cluster_files_plan(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2] / "examples" / "clusters"
    files = sorted(root.glob("plan-*.yaml"))
    assert files
    for f in files:
        r = invoke(["plan", "llama-2-7b", "--cluster", str(f), "--json", "--no-write"])
        assert r.exit_code == 0, (f, r.output)


def bench_report(
    nodes: int = 2, g: int = 4, intra: float = 240.0, world: float = 6.25, inter: float = 6.25 / 4
) -> bench.BenchReport:
    def pts(bw: float) -> list[bench.SizePoint]:
        return [bench.SizePoint.measured("all_reduce", 2, s * MiB, [s * MiB / (bw * 1e9)] * 3) for s in (16, 64, 256)]

    results = [
        bench.CollectiveResult(
            group="world",
            collective="all_reduce",
            ranks_per_group=nodes * g,
            concurrent_groups=1,
            groups_per_node=1,
            points=pts(world if nodes > 1 else intra),
        )
    ]
    if nodes > 1:
        results += [
            bench.CollectiveResult(
                group="intra_node",
                collective="all_reduce",
                ranks_per_group=g,
                concurrent_groups=nodes,
                groups_per_node=1,
                points=pts(intra),
            ),
            bench.CollectiveResult(
                group="inter_node",
                collective="all_reduce",
                ranks_per_group=nodes,
                concurrent_groups=g,
                groups_per_node=g,
                points=pts(inter),
            ),
        ]
    return bench.BenchReport(
        created_utc="2026-11-22T05:00:00+00:00",
        backend="nccl",
        device="cuda",
        dtype="bfloat16",
        world_size=nodes * g,
        ranks_per_node=g,
        nodes=[bench.NodeInfo(name=f"n{i}", node_rank=i, ranks=list(range(i * g, (i + 1) * g))) for i in range(nodes)],
        versions={},
        env={},
        config=bench.BenchConfig(
            sizes_bytes=[16 * MiB, 64 * MiB, 256 * MiB],
            iters=3,
            warmup=1,
            collectives=["all_reduce"],
            slow_fraction=0.7,
        ),
        results=results,
    )


def test_net_bench_json_drives_the_plan(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    bench.dump_bench(bench_report(), path)
    args = [
        "plan",
        "llama-2-7b",
        "--gpu",
        "A100-80GB",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--net",
        str(path),
        "--seq-len",
        "1024",
        "--global-batch",
        "128",
        "--tp",
        "1",
        "--pp",
        "1",
        "--json",
        "--no-write",
    ]
    r = invoke(args)
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["chosen"]["strategy"] == "hybrid_shard"
    assert data["network"]["intra_busbw_gbytes_s"] == pytest.approx(240.0)
    assert data["network"]["inter_node_gbytes_s"] == pytest.approx(6.25)
    # a fast measured network: FULL_SHARD over both nodes is competitive
    bench.dump_bench(bench_report(world=200.0, inter=50.0), path)
    data = json.loads(invoke(args).stdout)
    full2 = [c for c in data["candidates"] if c["strategy"] == "full_shard" and c["nodes"] == 2]
    assert full2 and full2[0]["tokens_per_s"] >= 0.9 * data["chosen"]["tokens_per_s"]


def test_net_and_inter_gbps_conflict_and_single_node_bench_needs_inter(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    bench.dump_bench(bench_report(), path)
    r = invoke([*SEED, "--net", str(path), "--no-write"])  # SEED carries --inter-gbps 50
    assert r.exit_code == 2 and "conflicts with the inter-node bandwidth measured" in r.output
    bench.dump_bench(bench_report(nodes=1), path)
    base = [
        "plan",
        "llama-2-7b",
        "--gpu",
        "A100-80GB",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--net",
        str(path),
        "--seq-len",
        "1024",
        "--no-write",
    ]
    r = invoke(base)
    assert r.exit_code == 2 and "measured on one node" in r.output
    r = invoke([*base, "--inter-gbps", "50", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["network"]["inter_node_gbytes_s"] == pytest.approx(6.25)


def test_global_batch_in_tokens(tmp_path: Path) -> None:
    r = invoke([*SEED[:-2], "--global-batch-tokens", str(256 * 1024), "--json", "--no-write"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["global_batch_seqs"] == 256
    c = data["chosen"]
    assert c["micro_batch"] * c["grad_accum"] * c["gpus"] // (c["tp"] * c["cp"] * c.get("pp", 1)) == 256
    r = invoke([*SEED, "--global-batch-tokens", "1024", "--no-write"])
    assert r.exit_code == 2 and "not both" in r.output


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not valid JSON"),
        ('{"schema": "other"}', "is not a bench-net report"),
        ('{"schema": "llmctl.bench-net", "schema_version": 1}', "invalid bench-net report"),
    ],
)
def test_malformed_bench_json_is_one_line(tmp_path: Path, content: str, message: str) -> None:
    p = tmp_path / "bench.json"
    p.write_text(content)
    r = invoke([*SEED, "--net", str(p), "--no-write"])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("llmctl: error:")


def test_bench_with_other_gpus_per_node_is_inconsistent(tmp_path: Path) -> None:
    p = tmp_path / "bench.json"
    bench.dump_bench(bench_report(g=8), p)
    r = invoke([*SEED, "--net", str(p), "--no-write"])
    assert r.exit_code == 2 and "measured 8 GPUs per node but the cluster has 4" in r.output


def test_calibrate_from_engine_metrics(tmp_path: Path) -> None:
    m = tmp_path / "metrics.jsonl"
    lines = [{"event": "start", "step": 0}] + [
        {
            "event": "step",
            "step": i,
            "tokens_per_s": 15000.0,
            "tokens_per_s_predicted": 20000.0,
            "mfu": 0.3,
            "mfu_predicted": 0.4,
        }
        for i in range(1, 5)
    ]
    m.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    r = invoke([*SEED, "--calibrate", str(m), "--json", "--no-write"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["calibration"]["factor"] == pytest.approx(0.75)
    assert data["efficiency"]["calibration"] == pytest.approx(0.75)
    m.write_text('{"event": "step"}\nnot json\n')
    r = invoke([*SEED, "--calibrate", str(m), "--no-write"])
    assert r.exit_code == 2 and "line 2: not valid JSON" in r.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "llama-2-7b", "--nodes", "2"], "no GPU kind given"),
        (["plan", "llama-2-7b", "--gpu", "Z9000"], "unknown GPU kind"),
        (["plan", "llama-2-7b", "--gpu", "A100-80GB", "--nodes", "0"], "--nodes must be a positive integer"),
        (
            ["plan", "llama-2-7b", "--gpu", "A100-80GB", "--nodes", "2", "--gpus-per-node", "4"],
            "no inter-node bandwidth",
        ),
        ([*SEED, "--strategy", "hybrid_shard", "--nodes", "1"], None),
        ([*SEED, "--global-batch", "5"], "does not split evenly"),
        ([*SEED, "--overlap", "2"], "--overlap must be in [0, 1]"),
        ([*SEED, "--objective", "speed"], "unknown objective"),
        ([*SEED, "--micro-batch", "128"], "--micro-batch 128: full_shard on 1 node: micro-batch 128 does not divide"),
        ([*SEED, "--strategy", "zero1"], "not run by llmctl's engine"),
        (
            [*SEED, "--pp-microbatches=0"],
            "--pp-microbatches must be a positive integer, got 0",
        ),  # was a ZeroDivisionError
        ([*SEED, "--precision", "fp8"], "A100-80GB has no float8 tensor cores"),
        (
            ["plan", "llama-2-7b", "--gpu", "V100-32GB", "--gpus-per-node", "8", "--precision", "bf16-mixed"],
            "no native bf16",  # asked for by name; auto is fp16-mixed there (tests/cli/test_precision_cli.py)
        ),
        (
            ["plan", "llama-3.1-405b", "--gpu", "H100", "--nodes", "2", "--gpus-per-node", "8", "--inter-gbps", "3200"],
            "the smallest cluster of H100-SXM that fits is",
        ),
    ],
)
def test_bad_input_is_one_line_and_nonzero(args: list[str], message: str | None, tmp_path: Path) -> None:
    r = invoke([*args, "-o", str(tmp_path / "p.yaml")])
    assert r.exit_code != 0
    if message is None:  # the contradiction --nodes 2 ... --nodes 1 is resolved by click (last wins)
        assert "hybrid_shard" in r.output and "2 nodes" in r.output
        return
    assert message in r.output, r.output
    assert r.output.strip().count("\n") == 0, r.output


def test_params_model_plans_but_writes_no_plan(tmp_path: Path) -> None:
    r = invoke(
        [
            "plan",
            "--params",
            "7B",
            "--gpu",
            "A100-80GB",
            "--gpus-per-node",
            "8",
            "--json",
            "-o",
            str(tmp_path / "p.yaml"),
        ]
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["plan_path"] is None and "--params" in data["plan_note"]
    assert not (tmp_path / "p.yaml").exists()


CHECK = """
import sys, time
t = time.perf_counter()
sys.argv = ["llmctl", "plan", "llama-3.1-70b", "--gpu", "H100-SXM", "--nodes", "1024", "--gpus-per-node", "8",
            "--inter-gbps", "3200", "--seq-len", "4096", "--json", "--no-write"]
from llmctl.cli.main import main
try:
    main()
except SystemExit as e:
    code = e.code
else:
    code = 0
print("TORCH=" + str("torch" in sys.modules), "CODE=" + str(code), "SECONDS=%.3f" % (time.perf_counter() - t),
      file=sys.stderr)
"""


def test_plan_for_1024_nodes_is_torch_free_and_fast() -> None:
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("TORCH=False CODE=0"), r.stderr[-2000:]
    data = json.loads(r.stdout)
    assert data["chosen"]["tokens_per_s"] > 0
    # The child's CPU seconds, not wall time: a loaded machine (CI beside other jobs) stretches the wall clock 4x
    # without the plan doing more work. The speed claim (< 1 s, side by side) lives in benchmarks/plan_speed.py.
    assert cpu < 5, cpu


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("gpu: A100-80GB\nnodes: 0\ngpus_per_node: 4\n", "nodes: Input should be greater than or equal to 1"),
        ("gpu: A100-80GB\nnodes: 2\ngpus_per_node: 4\nnics: 8\n", "nics: unknown key"),
        ("- a\n- b\n", "must be a YAML mapping"),
        ("gpu: [unclosed\n", "not valid YAML"),
    ],
)
def test_malformed_cluster_file_is_one_line(tmp_path: Path, content: str, message: str) -> None:
    p = tmp_path / "cluster.yaml"
    p.write_text(content)
    r = invoke(["plan", "llama-2-7b", "--cluster", str(p), "--no-write"])
    assert r.exit_code == 2 and message in r.output and r.output.strip().count("\n") == 0, r.output


def test_a_model_folder_with_weights_is_planned_as_a_fine_tune(tmp_path: Path) -> None:
    """A config.json alone is random init (model.config); next to *.safetensors it is model.weights."""
    import json

    from llmctl.spec.planfile import load_plan

    folder = tmp_path / "my-model"
    folder.mkdir()
    cfg = {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 320,
        "max_position_embeddings": 2048,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    args = ["plan", str(folder), "--gpu", "A100-80GB", "--gpus-per-node", "1", "--seq-len", "256"]
    r = invoke([*args, "-o", str(tmp_path / "random.yaml")])
    assert r.exit_code == 0, r.output
    m = load_plan(tmp_path / "random.yaml").model
    assert m.config == str(folder) and m.weights is None
    (folder / "model.safetensors").write_bytes(b"")  # presence is what the planner looks at; the engine reads it
    r = invoke([*args, "-o", str(tmp_path / "finetune.yaml")])
    assert r.exit_code == 0, r.output
    m = load_plan(tmp_path / "finetune.yaml").model
    assert m.weights == str(folder) and m.config is None
