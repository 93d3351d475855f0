"""`llmctl estimate-memory` through the real CLI: output, JSON contract, bad input -> one line + exit code."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, list(args))


def test_table_output_and_alias():
    r = run("estimate-memory", "llama-2-7b", "--gpu", "A100-80GB", "--gpus", "8", "--seq-len", "1024")
    assert r.exit_code == 0, r.output
    for text in (
        "6,738,415,616 parameters",
        "18 bytes/param classic budget",
        "optimizer states (adamw)",
        "peak phase: backward",
        "A100-80GB",
        "largest micro-batch",
        "full_shard",
        "hybrid_shard",
    ):
        assert text in r.output
    assert run("estimate", "llama-2-7b").exit_code == 0


def test_json_contract():
    r = run("estimate-memory", "llama-2-7b", "--gpu", "H100-SXM", "--gpus", "8", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["params"] == 6_738_415_616
    assert d["bytes_per_param"] == 18
    assert d["per_gpu_total_bytes"] == d["peak_reserved_bytes"] + d["per_gpu_bytes"]["CUDA context + NCCL"]
    # per_gpu_bytes lists what is live at the peak phase: it sums to the total.
    assert sum(d["per_gpu_bytes"].values()) == d["per_gpu_total_bytes"]
    assert d["fits"] is True and d["max_micro_batch"] >= 1
    assert d["min_gpus"] == d["min_gpus_by_strategy"]["full_shard"]["gpus"]


def test_json_without_gpu_has_no_fit_fields():
    d = json.loads(run("estimate-memory", "gpt2", "--json").output)
    assert "fits" not in d and d["params"] == 124_439_808


def test_params_states_assumed_shape():
    r = run("estimate-memory", "--params", "13B")
    assert r.exit_code == 0
    assert "assumed shape" in r.output and "13,000,000,000 parameters" in r.output


def test_lists():
    r = run("estimate-memory", "--list-models")
    assert r.exit_code == 0 and "llama-3.1-405b" in r.output and "405,853,388,800" in r.output
    r = run("estimate-memory", "--list-gpus")
    assert r.exit_code == 0 and "MI300X" in r.output and "989.5" in r.output


def test_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    png = tmp_path / "mem.png"
    r = run("estimate-memory", "llama-2-7b", "--nodes", "2", "--gpus-per-node", "8", "--plot", str(png))
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["llama2-7b"], "did you mean: llama-2-7b"),
        (["gpt2", "--micro-batch", "0"], "--micro-batch must be a positive integer"),
        (["gpt2", "--seq-len", "-5"], "--seq-len must be a positive integer"),
        (["gpt2", "--gpus", "12"], "not a whole number of nodes"),
        (["gpt2", "--gpus", "6", "--tp", "4"], "cannot be split into tp=4"),
        (["gpt2", "--strategy", "hybrid_shard", "--gpus", "8"], "hybrid_shard needs at least 2 nodes"),
        (["gpt2", "--strategy", "zero9"], "unknown strategy"),
        (["gpt2", "--gpu", "H1000"], "unknown GPU kind"),
        (["gpt2", "--precision", "bf16", "--gpu", "V100-32GB"], "no native bf16"),
        (["--params", "lots"], "cannot read parameter count"),
        ([], "no model given"),
        (["gpt2", "--plot", "out.jpg"], "must end in .png"),
        (["gpt2", "--checkpointing", "some"], "unknown checkpointing 'some' (choose one of: none | selective"),
        (["gpt2", "--checkpointing", "partial:1"], "partial:1 checkpoints every layer (write full)"),
        (["gpt2", "--checkpointing", "partial:0"], "needs 2 <= K <= 1000"),
        (["gpt2", "--loss-chunk", "-3"], "loss chunk must be >= 0 tokens"),
    ],
)
def test_bad_input_one_line_exit_2(args, needle):
    r = run("estimate-memory", *args)
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("llmctl: error: "), r.output
    assert needle in lines[0]


def test_malformed_config_json(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": ')
    r = run("estimate-memory", str(bad))
    assert r.exit_code == 2 and "is not valid JSON" in r.output
    assert bad.read_text() == '{"model_type": "llama", "hidden_size": '  # the user's file is untouched


def test_debug_env_shows_traceback(monkeypatch):
    from llmctl.errors import UnknownNameError

    monkeypatch.setenv("LLMCTL_DEBUG", "1")
    r = run("estimate-memory", "nope-model")
    assert isinstance(r.exception, UnknownNameError)


@pytest.mark.parametrize("cmd", [[], ["estimate-memory"], ["estimate"], ["plan"], ["launch"], ["bench-net"]])
def test_help_exits_zero(cmd):
    r = run(*cmd, "--help")
    assert r.exit_code == 0, r.output
    assert "Usage" in r.output and "internal error" not in r.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["foo"], "No such command 'foo'"),
        (["estimat"], "Did you mean 'estimate'"),
        (["estimate", "llama-2-7b", "--bogus"], "No such option: --bogus"),
        (["estimate", "llama-2-7b", "--seq-len", "abc"], "Invalid value for '--seq-len'"),
        (["--bogus"], "No such option: --bogus"),
    ],
)
def test_usage_errors_are_one_line_exit_2(args: list[str], message: str) -> None:
    """Usage errors keep click's message (and its suggestions) but read like every other bad input: one line,
    exit 2, never 'internal error'."""
    proc = subprocess.run(
        [sys.executable, "-m", "llmctl", *args], capture_output=True, text=True, timeout=60, check=False
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("llmctl: error: ") and message in lines[0], proc.stderr
    assert "internal error" not in proc.stderr


def test_help_and_no_arguments() -> None:
    ok = subprocess.run([sys.executable, "-m", "llmctl", "estimate", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "Usage" in ok.stdout
    bare = subprocess.run([sys.executable, "-m", "llmctl"], capture_output=True, text=True)
    assert bare.returncode == 2 and "Usage" in bare.stdout + bare.stderr


def test_checkpointing_modes_and_the_fewest_gpus_for_each():
    """Issue 11: --checkpointing selective | partial:K | full and --loss-chunk; the fewest-GPUs table per mode."""
    base = ["estimate", "llama-3.1-8b", "--gpu", "H100-SXM", "--gpus", "8", "--seq-len", "8192", "--json"]
    d = json.loads(run(*base, "--checkpointing", "selective", "--loss-chunk", "512").output)
    assert d["setup"]["checkpointing"] == "selective" and d["setup"]["loss_chunk_tokens"] == 512
    names = [c["name"] for c in d["components"]]
    assert "activations (selective checkpointing)" in names and "loss chunk of 512 tokens (backward)" in names
    assert "loss log-softmax (fp32, b*s*V)" not in names
    table = d["min_gpus_by_checkpointing"]
    assert list(table) == ["none", "selective", "partial:2", "full"]
    acts = [table[m]["activations_bytes"] for m in ("none", "partial:2", "selective", "full")]
    assert acts == sorted(acts, reverse=True) and acts[-1] > 0
    gpus = [table[m]["gpus"] for m in ("none", "partial:2", "selective", "full")]
    assert all(g is not None for g in gpus) and gpus == sorted(gpus, reverse=True)
    d4 = json.loads(run(*base, "--checkpointing", "partial:4").output)
    assert "partial:4" in d4["min_gpus_by_checkpointing"] and d4["setup"]["checkpointing"] == "partial:4"
    text = run(*base[:-1], "--checkpointing", "partial:4").output
    assert "Fewest GPUs per checkpointing mode (full_shard, mb 1)" in text and "partial:4" in text


def test_grad_accum_puts_the_gradients_in_the_forward() -> None:
    """--grad-accum 1 (the default): the engine frees the gradients after each step, so none live in the forward or
    the loss's backward; with 2 the first micro-batch's gradients are there when the second runs."""
    one, two = (
        json.loads(run("estimate-memory", "llama-3.2-1b", "--micro-batch", "2", "--grad-accum", n, "--json").stdout)
        for n in ("1", "2")
    )
    grads = next(c["bytes"] for c in one["components"] if c["name"].startswith("gradients"))
    assert grads == 4 * one["params"]
    for phase in ("forward", "loss_backward"):
        assert two["phase_bytes"][phase] - one["phase_bytes"][phase] == grads, phase
    assert two["phase_bytes"]["backward"] == one["phase_bytes"]["backward"]
    for bad in ("0", "-1", "1000001"):
        r = run("estimate-memory", "llama-3.2-1b", "--grad-accum", bad)
        assert r.exit_code == 2 and "--grad-accum" in r.output and len(r.output.strip().splitlines()) == 1, r.output


@pytest.mark.parametrize(("cp", "kernel"), [("1", "flash"), ("8", "sdpa")])
def test_attention_auto_is_the_kernel_the_engine_picks(cp, kernel):
    """Issue 49: the ring's refusal of flash says "use attention auto", so auto must estimate (flash on an H100 in
    bf16, SDPA under a ring) and equal the estimate of that kernel named."""
    args = ["estimate-memory", "llama-3.1-8b", "--gpu", "H100", "--gpus", "8", "--cp", cp, "--seq-len", "32k", "--json"]
    auto = CliRunner().invoke(app, [*args, "--attention", "auto"])
    named = CliRunner().invoke(app, [*args, "--attention", kernel])
    assert auto.exit_code == 0 and named.exit_code == 0, auto.output
    assert json.loads(auto.stdout) == json.loads(named.stdout)
