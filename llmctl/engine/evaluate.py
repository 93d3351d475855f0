"""The validation loss: the mean next-token cross-entropy over a fixed set of sequences, the same on any world size.

The set is the first N = min(eval_batches x G, blocks) blocks of data.val, in order (G = the global batch in
sequences), as Megatron-LM defines its evaluation (eval_iters x global batch). Evaluation batch e is laid out like
a training step: rank r takes sequences e*G + r*mbs*acc ... in `acc` micro-batches of `mbs`, so every rank runs the
same number of forwards (FSDP's collectives need that) and a 1-rank and a 4-rank run with the same global batch see
the same sequences. Slots past N (a validation set smaller than eval_batches x G) carry targets of -100: they run
but count nothing. Each rank sums the per-token losses and counts its tokens in float64; one all-reduce gives the
mean, so the result depends on the world size only through float rounding inside a micro-batch.

Packed instruction data (llmctl.engine.data.PackedExamples): the same layout, each micro-batch with its positions
(documents restart at 0: the block-causal mask) and its masked targets; the mean is over the loss tokens.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmctl.engine.context_parallel import whole
from llmctl.engine.data import IGNORE, Batch, PackedBlocks, PackedExamples, one_row
from llmctl.engine.loss import loss_sum

if TYPE_CHECKING:
    import torch

__all__ = ["IGNORE", "Evaluator"]


@dataclass
class Evaluator:
    blocks: PackedBlocks
    micro_batch_size: int
    grad_accum_steps: int
    dp_rank: int
    dp_size: int
    eval_batches: int
    copies: int = 1
    """Ranks that evaluate the same tokens (a tp group: each holds the whole loss); the sums are divided by it."""

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.dp_size

    @property
    def num_sequences(self) -> int:
        return min(self.eval_batches * self.global_batch, self.blocks.num_blocks)

    def micro_batches(self) -> list[Batch]:
        """This rank's evaluation micro-batches (the same count on every rank)."""
        import numpy as np
        import torch

        g, n, mbs = self.global_batch, self.num_sequences, self.micro_batch_size
        out = []
        for e in range(math.ceil(n / g)):
            first = e * g + self.dp_rank * mbs * self.grad_accum_steps
            for m in range(self.grad_accum_steps):
                idx = np.arange(first + m * mbs, first + (m + 1) * mbs)
                real = idx < n
                if isinstance(self.blocks, PackedExamples):
                    out.append(self._packed(idx, real))
                    continue
                rows = torch.from_numpy(self._rows(idx, real))
                targets = rows[:, 1:].clone()
                targets[torch.from_numpy(~real)] = IGNORE
                out.append(Batch(inputs=rows[:, :-1], targets=targets))
        return out

    def _through(self, pipeline: Any, acc: torch.Tensor, device: torch.device, split: Any) -> None:
        """The micro-batches through a pipeline's schedule, forward only (a run's count at a time: it divides
        grad_accum_steps, so every evaluation batch is whole runs); adds (loss sum, tokens) into `acc`."""
        batches = self.micro_batches()
        m = pipeline.microbatches
        for i in range(0, len(batches), m):
            total, tokens = pipeline.evaluate(batches[i : i + m], device, split)
            acc[0] += total
            acc[1] += tokens

    def _packed(self, idx: Any, real: Any) -> Batch:
        """A micro-batch of packs; slots past the set repeat the last real pack (or pack 0) with no target."""
        import torch

        k = int(real.sum())
        b = self.blocks.batch(int(idx[0]), k) if k else self.blocks.batch(0, 1)
        pad = len(idx) - len(b.inputs)
        if pad:
            rep = [1] * (len(b.inputs) - 1) + [1 + pad]
            b = Batch(*(t.repeat_interleave(torch.tensor(rep), dim=0) for t in (b.inputs, b.targets, b.positions)))
        b.targets[torch.from_numpy(~real)] = IGNORE
        return b

    def _rows(self, idx: Any, real: Any) -> Any:
        import numpy as np

        # Real slots are a prefix of the micro-batch; an all-padding micro-batch runs on block 0.
        rows = self.blocks.samples(int(idx[0]), int(real.sum())) if real.any() else self.blocks.samples(0, 1)
        if len(rows) < len(idx):  # pad with copies of the last row (their targets are ignored)
            rows = np.concatenate([rows, np.repeat(rows[-1:], len(idx) - len(rows), axis=0)])
        return rows

    def run(
        self,
        model: torch.nn.Module,
        loss_impl: str,
        vocab: int,
        device: torch.device,
        split: Any = whole,
        pipeline: Any = None,
    ) -> dict[str, Any]:
        """Mean validation loss and perplexity over the set (every rank returns the same). `split`: how a micro-batch
        is cut over the cp ranks (llmctl.engine.context_parallel; each rank sums and counts its part's tokens).
        `pipeline` (llmctl.engine.pipeline.Pipeline): the micro-batches go through its schedule, forward only, its
        run's count at a time; the ranks of the last stage sum and count."""
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        was_training = model.training
        model.eval()  # no dropout
        acc = torch.zeros(2, dtype=torch.float64, device=device)
        flash = str(getattr(getattr(model, "config", None), "_attn_implementation", "")).startswith("flash")
        try:
            with torch.no_grad():
                if pipeline is not None:
                    self._through(pipeline, acc, device, split)
                for b in self.micro_batches() if pipeline is None else ():
                    if flash and b.positions is not None:
                        b = one_row(b)  # packed documents: flash-attention 2's varlen path needs one row
                    pos = None if b.positions is None else b.positions.to(device)
                    with split(Batch(b.inputs.to(device), b.targets.to(device), pos)) as part:
                        acc[0] += loss_sum(model, loss_impl, part.inputs, part.targets, vocab, part.positions).double()
                        acc[1] += (part.targets != IGNORE).sum()
        finally:
            model.train(was_training)
        dist.all_reduce(acc, op=dist.ReduceOp.SUM)
        total, tokens = (x / self.copies for x in acc.tolist())
        loss = total / tokens
        return {
            "val_loss": loss,
            "val_ppl": math.exp(min(loss, 700.0)),  # exp overflows a float past ~709
            "val_tokens": int(tokens),
            "val_sequences": self.num_sequences,
            "seconds": time.perf_counter() - t0,
        }
