"""`llmctl plan`'s own options (Annotated aliases, as llmctl.cli.options): the cluster, its network and the batch."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from llmctl.cli.options import decimal_count

ClusterOpt = Annotated[
    Optional[str],
    typer.Option(
        "--cluster",
        help="Cluster YAML: gpu, nodes, gpus_per_node, inter/intra_node_gbps, price_per_gpu_hour, node_memory_gib.",
    ),
]
NetOpt = Annotated[Optional[str], typer.Option("--net", help="bench-net JSON (measured busbw).")]
IntraGbpsOpt = Annotated[
    Optional[float],
    typer.Option("--intra-gbps", help="Per-GPU intra-node bus bandwidth, Gbit/s (default: catalog link x 0.8)."),
]
InterGbpsOpt = Annotated[
    Optional[float],
    typer.Option(
        "--inter-gbps",
        help="Per-node inter-node bandwidth, Gbit/s, all NICs together (e.g. 50, or 3200 for 8 x 400G).",
    ),
]
GlobalBatchOpt = Annotated[
    Optional[int],
    typer.Option(
        "--global-batch",
        parser=decimal_count,
        metavar="N",
        help="Global batch in sequences, held fixed (default: the published batch in tokens for the model's size, "
        "GPT-3's Table 2.1 or Llama 3's, over --seq-len, up to a multiple of the data-parallel ranks).",
    ),
]
GlobalBatchTokensOpt = Annotated[
    Optional[int],
    typer.Option(
        "--global-batch-tokens",
        parser=decimal_count,
        metavar="N",
        help="Global batch in tokens, e.g. 4M = 4,000,000 (rounded down to whole sequences).",
    ),
]
EpochsOpt = Annotated[
    Optional[float],
    typer.Option(
        "--epochs",
        metavar="N",
        help="Train for N passes over the --data folder (made by `llmctl data prepare`): steps = N x its sequences / "
        "the global batch (instead of --tokens).",
        show_default=False,
    ),
]
