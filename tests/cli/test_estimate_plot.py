"""`llmctl estimate-memory --plot`: the figure itself, read back from matplotlib's artists (Agg): the GPU's usable
memory as a line at the figure the fit check uses, the GPU and the setup in the title, each bar's model states
labelled as they are held (replicated, sharded, sharded within a shard group) and the legend claiming neither."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from llmctl.cli import estimate_plot
from llmctl.cli.main import app
from llmctl.plan import memory as mem
from llmctl.spec import hardware, models
from llmctl.spec.setup import TrainSetup
from llmctl.units import GIB

pytest.importorskip("matplotlib", reason="--plot needs matplotlib")

H100 = hardware.resolve_gpu("H100-SXM")
SETUP = TrainSetup(nodes=2, gpus_per_node=8, micro_batch_size=2, seq_len=4096, checkpointing="full")


@pytest.fixture(scope="module")
def llama():
    return models.from_preset("llama-2-7b")


@pytest.fixture
def draw(llama):
    """figure(...) for a setup; every figure is closed after the test."""
    import matplotlib.pyplot as plt

    made = []

    def make(setup=SETUP, gpu=H100, spec=llama):
        fig = estimate_plot.figure(estimate_plot.memory_plot(spec, setup, gpu))
        made.append(fig)
        return fig.axes[0]

    yield make
    for fig in made:
        plt.close(fig)


def ticks(ax) -> dict[str, str]:
    """strategy -> its whole tick label."""
    return {t.get_text().split("\n")[0]: t.get_text() for t in ax.get_xticklabels()}


def bar_totals_gib(ax) -> list[float]:
    """Each bar's stacked height, summed from the rectangles matplotlib drew (one container per component)."""
    n = len(ax.get_xticklabels())
    totals = [0.0] * n
    for container in ax.containers:
        for i, rect in enumerate(container.patches):
            totals[i] += rect.get_height()
    return totals


def gpu_lines(ax) -> list:
    return [line for line in ax.get_lines() if line.get_gid() == "gpu-memory"]


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_the_gpu_line_is_the_memory_the_fit_check_uses(draw, llama, strategy) -> None:
    ax = draw(replace(SETUP, strategy=strategy))
    (line,) = gpu_lines(ax)
    y = line.get_ydata()
    assert y[0] == y[1] == pytest.approx(H100.memory_bytes / GIB)
    assert line.get_label() == f"H100-SXM: {H100.memory_bytes / GIB:.1f} GiB usable"
    # A bar is under the line exactly when the fit check says that setup fits (and here one does, one does not).
    verdicts = {}
    for name, total in zip(ticks(ax), bar_totals_gib(ax)):
        setup = replace(SETUP, strategy=name)
        est = mem.estimate(llama, setup)
        assert total == pytest.approx(est.device_bytes / GIB)  # the bars stack to the whole per-GPU total
        verdicts[name] = mem.fits(est, H100.memory_bytes)
        assert (total <= y[0]) == verdicts[name], name
    assert verdicts["full_shard"] and not verdicts["no_shard"]


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_the_title_names_the_gpu_and_the_setup(draw, strategy) -> None:
    ax = draw(replace(SETUP, strategy=strategy))
    title = ax.get_title()
    for needle in (
        "llama-2-7b",
        "H100-SXM",
        f"strategy {strategy}",
        "2 nodes x 8 GPUs",
        "micro-batch 2",
        "seq len 4096",
        "checkpointing full",
        "bf16-mixed",
        "adamw",
    ):
        assert needle in title, (needle, title)
    bold = [t.get_text().split("\n")[0] for t in ax.get_xticklabels() if t.get_fontweight() == "bold"]
    assert bold == [strategy]  # the asked strategy's bar stands out


def test_each_bar_says_how_its_states_are_held(draw) -> None:
    labels = ticks(draw())
    assert list(labels) == ["no_shard", "shard_grad_op", "full_shard", "hybrid_shard"]  # FSDP2 has no zero1
    states = "parameters, gradients, optimizer states"
    assert " ".join(labels["no_shard"].split()) == f"no_shard {states}: replicated on 16 GPUs"
    assert "sharded" not in labels["no_shard"]
    assert " ".join(labels["full_shard"].split()) == f"full_shard {states}: sharded over 16"
    assert " ".join(labels["hybrid_shard"].split()) == (
        f"hybrid_shard {states}: sharded over 8 (shard group), replicated x2"
    )


def test_zero_bars_tell_each_state_apart(draw) -> None:
    """The ZeRO ledger: stage 1 and 2 leave some states whole, so one bar holds states of both kinds."""
    labels = ticks(draw(replace(SETUP, engine="zero")))
    # ZeRO-1 partitions the fp32 master copy with the optimizer states (it lives in the optimizer's partition).
    assert " ".join(labels["zero1"].split()) == (
        "zero1 master weights, optimizer states: sharded over 16 bf16 weights, gradients: replicated on 16 GPUs"
    )
    assert " ".join(labels["shard_grad_op"].split()) == (
        "shard_grad_op master weights, gradients, optimizer states: sharded over 16 bf16 weights: replicated on 16 GPUs"
    )
    assert " ".join(labels["full_shard"].split()) == (
        "full_shard master weights, bf16 weights, gradients, optimizer states: sharded over 16"
    )


def test_the_legend_claims_no_sharding(draw) -> None:
    ax = draw(replace(SETUP, strategy="no_shard"))
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[0] == "H100-SXM: 79.6 GiB usable"
    assert "parameters (fp32 master)" in legend  # the ledger's "(fp32 master, sharded)" without the claim
    assert not any(re.search(r"\bsharded\b", text) for text in legend), legend  # "unsharded layers" is true
    assert not any("bf16 weights" in text for text in legend)  # zero bytes in every bar (FSDP2): not drawn
    # One stacking order that keeps each bar's own: states at the bottom, FSDP's buffers (absent from the no_shard
    # bar, drawn first) next, context on top.
    assert legend[1:8] == [
        "parameters (fp32 master)",
        "gradients (fp32)",
        "optimizer states (adamw)",
        "unsharded layers (FSDP all-gather)",
        "unsharded final norm + LM head",
        "unsharded layers (FSDP2 on one rank)",
        "unsharded layer gradients (reduce-scatter)",
    ]
    assert legend[-2:] == ["allocator headroom", "CUDA context + NCCL"]


def test_without_a_gpu_there_is_no_line(draw) -> None:
    ax = draw(gpu=None)
    assert gpu_lines(ax) == []
    assert "no GPU kind given" in ax.get_title()


def test_one_gpu_holds_one_copy(draw, llama) -> None:
    one = TrainSetup(gpus_per_node=1)
    labels = ticks(draw(one, spec=models.from_preset("gpt2")))
    assert list(labels) == ["no_shard", "shard_grad_op", "full_shard"]
    assert all(" ".join(label.split()).endswith(": one copy (1 GPU)") for label in labels.values()), labels


def test_a_hybrid_setup_with_a_shard_size_draws_the_others_too(draw) -> None:
    """--shard-size belongs to hybrid_shard alone: the other bars are drawn without it, not refused."""
    ax = draw(replace(SETUP, strategy="hybrid_shard", shard_size=4))
    labels = ticks(ax)
    assert "sharded over 4 (shard group), replicated x4" in " ".join(labels["hybrid_shard"].split())
    assert "sharded over 16" in " ".join(labels["full_shard"].split())


def test_the_cli_draws_the_gpu_it_was_given(tmp_path, monkeypatch) -> None:
    """Through `llmctl estimate-memory --gpu ... --plot`: the figure saved is the one with the GPU's line."""
    import matplotlib.pyplot as plt

    drawn = []
    real = estimate_plot.figure

    def spy(plot):
        fig = real(plot)
        drawn.append(fig)
        return fig

    monkeypatch.setattr(estimate_plot, "figure", spy)
    png = tmp_path / "mem.png"
    args = ["estimate-memory", "llama-2-7b", "--gpu", "A100-40GB", "--nodes", "2", "--gpus-per-node", "8"]
    r = CliRunner().invoke(app, [*args, "--strategy", "no_shard", "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = drawn
    ax = fig.axes[0]
    (line,) = gpu_lines(ax)
    assert line.get_ydata()[0] == pytest.approx(40.0) and line.get_label() == "A100-40GB: 40.0 GiB usable"
    assert "A100-40GB" in ax.get_title() and "strategy no_shard" in ax.get_title()
    plt.close(fig)
