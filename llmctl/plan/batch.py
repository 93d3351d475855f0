"""The global batch a plan trains when none is asked for: a number of tokens by model size, from published runs
(`DEFAULT_BATCH_TOKENS`), turned into whole sequences at the plan's sequence length, so that long sequences get
fewer sequences a step. Torch-free."""

from __future__ import annotations

from typing import NamedTuple

M_TOKENS = 2**20
"""What the sources' "M" of tokens is: GPT-3's 0.5M is 256 sequences of 2,048 tokens (524,288), Llama 3's 4M is
1,024 sequences of 4,096 (4,194,304)."""


class BatchRow(NamedTuple):
    params: int
    """The size of the published model (a model of at least this many parameters takes the row)."""
    m_tokens: float
    """Its batch, in the source's millions of tokens (`M_TOKENS`)."""
    source: str

    @property
    def tokens(self) -> int:
        return round(self.m_tokens * M_TOKENS)


_GPT3 = "GPT-3's Table 2.1 (Brown et al. 2020, arXiv 2005.14165)"
DEFAULT_BATCH_TOKENS: tuple[BatchRow, ...] = (
    # Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1: "Sizes, architectures, and learning
    # hyper-parameters (batch size in tokens and learning rate) of the models which we trained": GPT-3 Small 125M
    # 0.5M, Medium 350M 0.5M, Large 760M 0.5M, XL 1.3B 1M, 2.7B 1M, 6.7B 2M, 13B 2M, 175B 3.2M.
    BatchRow(125_000_000, 0.5, _GPT3),
    BatchRow(350_000_000, 0.5, _GPT3),
    BatchRow(760_000_000, 0.5, _GPT3),
    BatchRow(1_300_000_000, 1, _GPT3),
    BatchRow(2_700_000_000, 1, _GPT3),
    BatchRow(6_700_000_000, 2, _GPT3),
    BatchRow(13_000_000_000, 2, _GPT3),
    BatchRow(175_000_000_000, 3.2, _GPT3),
    # Grattafiori et al. 2024, "The Llama 3 Herd of Models" (arXiv 2407.21783), section 3.4.1: "we use an initial
    # batch size of 4M tokens and sequences of length 4,096, and double these values to a batch size of 8M sequences
    # of 8,192 tokens after pre-training 252M tokens. We double the batch size again to 16M after pre-training on
    # 2.87T tokens." The initial 4M: the batch a run starts with.
    BatchRow(
        405_000_000_000, 4, "Llama 3's section 3.4.1 (Grattafiori et al. 2024, arXiv 2407.21783), its initial batch"
    ),
)
"""Default global batch in tokens by model size (total parameters), never fitted: a model takes the row of the
largest published model no bigger than it (below 125M, GPT-3 Small's)."""


def default_row(params: int) -> BatchRow:
    """The row of `DEFAULT_BATCH_TOKENS` a model of `params` parameters takes."""
    fitting = [r for r in DEFAULT_BATCH_TOKENS if r.params <= params]
    return fitting[-1] if fitting else DEFAULT_BATCH_TOKENS[0]


CPU_BATCH_SEQS = 16
"""A plan on the host's cores (`--gpu cpu`) trains the shipped CPU examples' 16 sequences a step (examples/tiny-cpu.yaml:
micro-batch 8 on each of 2 ranks): the table's 0.5M tokens would be 4,096 sequences of 128 tokens a step there,
minutes a step on a laptop for a plan that is there to try the flow (presets/cpu.yaml)."""
ADAPTER_BATCH_SEQS = 128
"""LoRA/QLoRA: the table is pre-training's (Llama-3.1-8B's 2M tokens is 1,024 sequences of 2,048 a step), which
fine-tuning does not train; adapters keep llmctl's earlier default of 128 sequences, not from a published run (the
plan says so: --global-batch sets it)."""
KINDS = ("pretrain", "cpu", "finetune")


def kind_of(on_cpu: bool, adapters: bool) -> str:
    """Which default a request takes: a CPU plan's, fine-tuning's (adapters), or the table's."""
    return "cpu" if on_cpu else "finetune" if adapters else "pretrain"


def default_sequences(params: int, seq_len: int, kind: str = "pretrain") -> int:
    """Sequences a step before the rounding to the data-parallel ranks."""
    if kind == "cpu":
        return CPU_BATCH_SEQS
    if kind == "finetune":
        return ADAPTER_BATCH_SEQS
    return -(-default_row(params).tokens // seq_len)


def default_global_batch(params: int, seq_len: int, ranks: int, kind: str = "pretrain") -> int:
    """Sequences a step by default: the row's tokens over `seq_len` (a CPU plan's or fine-tuning's count for those
    kinds), rounded up to a multiple of `ranks` (the data-parallel ranks every setup of the search can split it
    over), at least one each."""
    seqs = default_sequences(params, seq_len, kind)
    return -(-max(seqs, ranks) // ranks) * ranks


def _m(tokens: int) -> str:
    """2,097,152 -> '2.1M' (decimal, as the other counts the plan prints)."""
    return f"{tokens / 1e6:.3g}M" if tokens >= 1e6 else f"{tokens / 1e3:.3g}k"


def _size(params: int) -> str:
    return f"{params / 1e9:.3g}B" if params >= 1e9 else f"{params / 1e6:.3g}M"


def explain(
    params: int,
    seq_len: int,
    global_batch: int,
    ranks: int,
    given: bool,
    step_time_s: float | None = None,
    kind: str = "pretrain",
) -> str:
    """The global batch, where it came from and how long a step of it takes: '1,024 sequences of 2,048 tokens
    (2.1M tokens) a step, 21.6 s on the chosen setup: the default at 8.03B parameters, 2M tokens, the batch of the
    6.7B model in GPT-3's Table 2.1 ...; --global-batch or --global-batch-tokens sets it'. `given`: the batch was
    set by --global-batch or --global-batch-tokens."""
    tokens = global_batch * seq_len
    out = f"{global_batch:,} sequences of {seq_len:,} tokens ({_m(tokens)} tokens) a step"
    if step_time_s is not None:
        out += f", {step_time_s:.3g} s on the chosen setup"
    if given:
        return out + ": as asked (--global-batch or --global-batch-tokens)"
    row = default_row(params)
    if kind == "cpu":
        out += f": the default of a CPU plan, the shipped CPU examples' {CPU_BATCH_SEQS} sequences (examples/tiny-cpu.yaml)"
    elif kind == "finetune":
        out += (
            f": the default with adapters, {ADAPTER_BATCH_SEQS} sequences (the pre-training table by model size does "
            "not apply to fine-tuning; not from a published run)"
        )
    else:
        out += (
            f": the default at {_size(params)} parameters, {row.m_tokens:g}M tokens, the batch of the "
            f"{_size(row.params)} model in {row.source}"
        )
    seqs = default_sequences(params, seq_len, kind)
    if global_batch != seqs:
        out += f" ({seqs:,} sequences, rounded up to a multiple of the {ranks:,} data-parallel ranks)"
    return out + "; --global-batch or --global-batch-tokens sets it"
