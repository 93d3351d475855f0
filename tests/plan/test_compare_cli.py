"""`llmctl plan --compare` through typer's CliRunner: the table, --json rows, --plot, --prices, and one line + exit 2
for every bad flag or file."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmctl.cli import compare_plot
from llmctl.cli.compare_options import parse_budget, parse_deadline
from llmctl.cli.main import app
from llmctl.errors import InputError

runner = CliRunner()
BASE = ["plan", "llama-3.2-1b", "--tokens", "5B", "--compare", "A100-80GB,L4,H100-SXM"]


def one_line_error(args: list[str], needle: str) -> str:
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    assert needle in lines[0], lines[0]
    return lines[0]


def test_json_rows_and_picks() -> None:
    r = runner.invoke(app, [*BASE, "--deadline", "1d", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert {row["gpu"] for row in d["comparison"]} == {"A100-80GB", "L4", "H100-SXM"}
    for row in d["comparison"]:
        assert {"gpu", "gpus", "nodes", "days", "cost_usd", "tokens_per_s", "excluded"} <= set(row)
        if row["excluded"] is None:
            assert row["days"] <= 1.0
            # cost = GPUs x hours x price per GPU-hour, hours = tokens / tokens/s
            hours = 5e9 / row["tokens_per_s"] / 3600
            assert row["cost_usd"] == pytest.approx(row["gpus"] * hours * row["usd_per_gpu_hour"])
            assert row["price_source"] and row["price_date"]
    kept = [row for row in d["comparison"] if row["excluded"] is None]
    assert d["cheapest"] == min(kept, key=lambda row: row["cost_usd"])["gpu"]
    assert d["fastest"] == min(kept, key=lambda row: row["days"])["gpu"]
    assert d["prices"].startswith("prices: on-demand") and "days old" in d["prices"]


def test_table_names_the_picks_and_the_prices() -> None:
    r = runner.invoke(app, BASE)
    assert r.exit_code == 0, r.output
    assert "cheapest:" in r.output and "fastest:" in r.output
    assert "prices: on-demand, shipped table (prices.yaml)" in r.output
    assert "full search of" in r.output and "llmctl plan llama-3.2-1b --tokens 5B --gpu" in r.output


def test_prices_file_replaces_an_entry(tmp_path: Path) -> None:
    f = tmp_path / "my-prices.yaml"
    f.write_text(
        "gpus:\n  L4:\n    on_demand:\n      usd_per_gpu_hour: 0.01\n      source: my quote\n      date: 2026-01-02\n"
    )
    r = runner.invoke(app, [*BASE, "--prices", str(f), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    l4 = next(row for row in d["comparison"] if row["gpu"] == "L4")
    assert l4["usd_per_gpu_hour"] == 0.01 and l4["price_source"] == "my quote"
    assert d["cheapest"] == "L4"  # a cent an hour makes it the cheapest
    assert f"L4: from {f}" in d["prices"]


def test_budget_excludes(tmp_path: Path) -> None:
    r = runner.invoke(app, [*BASE, "--budget", "1", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert all(row["excluded"] and row["excluded"].startswith("over budget") for row in d["comparison"])
    assert d["cheapest"] is None


def test_excluded_rows_are_one_line_with_the_full_reason_below_and_a_legend() -> None:
    """Issue 49: each "excluded:" reason wrapped over 7-9 lines of the table and "fits on 8 (1 offl)" had no legend.
    Now a row's cell says why in a few words with a footnote number; the full reason is listed under the table (and
    in --json); a legend says what the abbreviations mean; a stale price shows its year."""
    args = ["plan", "llama-3.2-1b", "--tokens", "5B", "--compare", "A100-80GB,L4,V100-16GB", "--budget", "1"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    body = [ln for ln in lines if ln.startswith("│")]
    assert len(body) == 3, r.output  # one line per row: nothing wraps
    assert all("over budget" in ln for ln in body) and sum("[1] over budget" in ln for ln in body) == 1
    v100 = next(ln for ln in body if ln.startswith("│V100-16GB"))
    assert "3.06 (2017)" in v100
    legend = next(ln for ln in lines if ln.startswith("legend: "))
    assert "fits on: the fewest GPUs that fit without CPU offload, '(N offl)' where N fit with it" in legend
    assert "mbMxA micro-batch M x A accumulation steps" in legend and "$/GPU-h (YYYY): a price from that year" in legend
    notes = [ln for ln in lines if ln.startswith("[")]
    assert [n.split(":")[0] for n in notes] == [f"[{i}] {g}" for i, g in enumerate(_excluded_order(r.output), 1)]
    assert all(n.split(": ", 1)[1].startswith("over budget: $") and n.endswith(" > $1") for n in notes), notes
    assert "stale (over 2 years old, check them): V100-16GB from 2017-10-25" in r.output

    d = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    for row in d["comparison"]:
        assert row["excluded_short"] == "over budget" and row["excluded"].startswith("over budget: $")
        age = (date.today() - date.fromisoformat(row["price_date"])).days
        assert row["price_stale"] is (age > 730) and (row["gpu"] != "V100-16GB" or row["price_stale"])


def _excluded_order(output: str) -> list[str]:
    """GPU names of the table's rows, top to bottom."""
    return [ln[1:].split("│")[0].strip() for ln in output.splitlines() if ln.startswith("│")]


def test_plot_written(tmp_path: Path) -> None:
    out = tmp_path / "cmp.png"
    r = runner.invoke(app, [*BASE, "--deadline", "2d", "--plot", str(out)])
    assert r.exit_code == 0, r.output
    assert out.stat().st_size > 10_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_data_pareto() -> None:
    from llmctl.plan import compare as cmp
    from tests.plan.test_compare import OPTIONS, SEQ, FakePrices

    kinds = [cmp.resolve_gpu(k) for k in ("A100-80GB", "L4")]
    result = cmp.compare(
        "llama-3.2-1b", OPTIONS, SEQ, kinds, cmp.Ask(5 * 10**9, max_gpus=16), FakePrices({"A100-80GB": 2, "L4": 0.5})
    )
    plot = compare_plot.compare_plot(result)
    pts = [(d, c) for s in plot.series for d, c, _ in s.points]
    assert plot.pareto and set(plot.pareto) <= set(pts)
    for d, c in pts:  # every point is on the front or beaten on both by a point of it
        assert (d, c) in plot.pareto or any(pd <= d and pc <= c for pd, pc in plot.pareto)
    for s in plot.series:
        assert s.pick in s.points


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--deadline", "soon"], "--deadline 'soon': not a duration"),
        (["--budget", "lots"], "--budget 'lots': not an amount of USD"),
        (["--budget", "0"], "--budget must be a positive amount"),
        (["--price-basis", "spot"], "--price-basis 'spot'"),
        (["--interconnect", "ib-nd"], "unknown interconnect"),
        (["--gpu", "h100"], "--compare chooses the GPU kind, count and price itself: drop --gpu"),
        (["--nodes", "2"], "drop --nodes"),
        (["--price", "2"], "drop --price"),
        (["--plot", "x.svg"], "must end in .png"),
    ],
)
def test_bad_flags_one_line(extra: list[str], needle: str) -> None:
    one_line_error([*BASE, *extra], needle)


def test_unknown_kind_and_missing_tokens() -> None:
    one_line_error(["plan", "llama-3.2-1b", "--tokens", "1B", "--compare", "h100,rtx9999"], "unknown GPU kind")
    one_line_error(["plan", "llama-3.2-1b", "--compare", "all"], "--compare needs --tokens")
    one_line_error(["plan", "llama-3.2-1b", "--gpu", "h100", "--deadline", "3d"], "--deadline applies to a comparison")


def test_bad_prices_file(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("gpus:\n  L4:\n    on_demand:\n      usd_per_gpu_hour: -1\n      source: x\n      date: 2026-01-02\n")
    line = one_line_error([*BASE, "--prices", str(f)], str(f))
    assert "usd_per_gpu_hour" in line
    one_line_error([*BASE, "--prices", str(tmp_path / "missing.yaml")], "missing.yaml")


def test_parsers() -> None:
    assert parse_deadline("30d") == 30 * 86400
    assert parse_deadline("12h") == 12 * 3600
    assert parse_deadline("2w") == 14 * 86400
    assert parse_deadline("90min") == 90 * 60
    assert parse_budget("500k") == 500_000
    assert parse_budget("$1.2M") == pytest.approx(1_200_000)
    assert parse_budget("2e6") == 2_000_000
    with pytest.raises(InputError):
        parse_deadline("0d")
    with pytest.raises(InputError):
        parse_budget("-5")


def test_lora_comparison_plans_adapters_without_offload() -> None:
    """--finetune lora: every row plans adapters (no CPU offload: the engine runs adapters without it), and the 8B
    model fits on fewer 24 GB cards than full training needs."""
    args = ["plan", "llama-3.1-8b", "--tokens", "1B", "--compare", "L4,A100-80GB", "--json"]
    full = json.loads(runner.invoke(app, args).stdout)
    r = runner.invoke(app, [*args, "--finetune", "lora"])
    assert r.exit_code == 0, r.output
    lora = json.loads(r.stdout)
    for row in lora["comparison"]:
        assert row["excluded"] is None, row["excluded"]
        assert row["fewest_gpus_that_fit"] == row["fewest_gpus_without_offload"]  # no offload with adapters
        assert "CPU offload" not in row["setup"]
    by = {row["gpu"]: row for row in full["comparison"]}
    l4 = next(row for row in lora["comparison"] if row["gpu"] == "L4")
    assert l4["fewest_gpus_that_fit"] < by["L4"]["fewest_gpus_without_offload"]


def test_row_command_reproduces_the_row() -> None:
    """The `llmctl plan` a row names carries every flag the row was planned with (shape, network, sequence, batch):
    run with the full search it predicts at least the row's tokens/s, and here (a 1B model, where the pins are what
    the full search picks anyway) the same."""
    args = ["plan", "llama-3.2-1b", "--tokens", "5B", "--seq-len", "1024", "--global-batch", "256"]
    r = runner.invoke(app, [*args, "--compare", "A100-80GB,L4", "--deadline", "12h", "--json"])
    assert r.exit_code == 0, r.output
    rows = [row for row in json.loads(r.stdout)["comparison"] if row["excluded"] is None]
    assert rows and any(row["nodes"] > 1 for row in rows)
    for row in rows:
        cmd = row["command"].split()[1:]
        assert "--seq-len" in cmd and "--global-batch" in cmd
        full = runner.invoke(app, [*cmd, "--json", "--no-write"])
        assert full.exit_code == 0, full.output
        chosen = json.loads(full.stdout)["chosen"]
        assert chosen["gpus"] == row["gpus"]
        assert chosen["tokens_per_s"] == pytest.approx(row["tokens_per_s"], rel=1e-6)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--seq-len", "0"], "--seq-len must be a positive integer"),
        (["--precision", "fp9"], "unknown precision 'fp9'"),
        (["--global-batch", "0"], "global batch must be >= 1"),
        (["--memory-margin", "2"], "--memory-margin must be a fraction"),
        (["--overlap", "3"], "--overlap must be in [0, 1]"),
        (["--micro-batch", "0"], "--micro-batch must be >= 1"),
        (["--gpus-per-node", "0"], "--gpus-per-node must be a positive integer"),
        (["--tp", "3"], "--tp 3 does not divide"),
        (["--calibrate", "/nope/metrics.jsonl"], "/nope/metrics.jsonl"),
        (["--data", "x"], "--data: a comparison writes no plan file"),
        (["-o", "p.yaml"], "-o: a comparison writes no plan file"),
        (["--no-write"], "--no-write: a comparison writes no plan file"),
    ],
)
def test_a_bad_flag_is_one_line_not_a_table_of_excluded_rows(extra: list[str], needle: str) -> None:
    """A flag no kind can take is the user's mistake: one line, exit 2 (before, every row was excluded with it and
    the command exited 0)."""
    one_line_error([*BASE, *extra], needle)


def test_a_flag_some_kinds_cannot_take_excludes_only_them() -> None:
    r = runner.invoke(
        app, ["plan", "llama-3.2-1b", "--tokens", "1B", "--compare", "H100-SXM,RTX-6000-Ada", "--tp", "8", "--json"]
    )
    assert r.exit_code == 0, r.output
    rows = {row["gpu"]: row for row in json.loads(r.stdout)["comparison"]}
    assert rows["H100-SXM"]["excluded"] is None and rows["H100-SXM"]["plan"]["tp"] == 8
    assert "--tp 8 does not divide" in rows["RTX-6000-Ada"]["excluded"]  # 4 GPUs per node
