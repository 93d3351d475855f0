"""Parallelism as degrees (torch-free): the one type from which the device mesh, the data-parallel rank and size,
tokens per step, each state's shard degree and each collective's group are derived.

Modelled on torchtitan's `ParallelDims` (pytorch/torchtitan, torchtitan/distributed/parallel_dims.py): the world is
`pp x dp_replicate x dp_shard x cp x tp` ranks, laid out in that order (tp innermost, so a tensor-parallel group is
consecutive ranks inside a node), and node after node (torchrun's rank order).

Sharding strategies are the friendly spelling of degrees, turned into degrees in one place (`from_strategy`):
- `full_shard` (FSDP FULL_SHARD, ZeRO-3): (dp_replicate, dp_shard) = (1, dp)
- `hybrid_shard` (FSDP HYBRID_SHARD, HSDP): (dp / shard, shard) with shard = the data-parallel ranks of one node
- `no_shard` (DDP): (dp, 1)
- `shard_grad_op` (ZeRO-2) and `zero1` (ZeRO-1): (1, dp) with fewer kinds of state split (`zero_stage`)
where dp = world / (tp x cp x pp). Expert parallelism (ep) borrows ranks from dp_shard x cp.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from llmctl.errors import InputError, RuleError, UnknownNameError

# Strategy -> (how the data-parallel ranks are split, ZeRO stage: which states dp_shard splits)
# (Rajbhandari et al. 2020, "ZeRO": stage 1 optimizer states, 2 + gradients, 3 + parameters).
_STRATEGIES: dict[str, tuple[str, int]] = {
    "no_shard": ("replicate", 0),
    "zero1": ("shard", 1),
    "shard_grad_op": ("shard", 2),
    "full_shard": ("shard", 3),
    "hybrid_shard": ("hybrid", 3),
}
STRATEGIES: tuple[str, ...] = tuple(_STRATEGIES)
ENGINE_STRATEGIES: tuple[str, ...] = ("full_shard", "hybrid_shard", "no_shard")
"""What llmctl's engine (FSDP2) runs."""
STRATEGY_ALIASES = {
    "ddp": "no_shard",
    "zero2": "shard_grad_op",
    "zero3": "full_shard",
    "full": "full_shard",
    "hybrid": "hybrid_shard",
    "fsdp": "full_shard",
    "hsdp": "hybrid_shard",
}


def sequence_split_problem(seq_len: int, tp: int, cp: int, load_balance: bool = True) -> str | None:
    """Why a sequence of `seq_len` tokens cannot be split over cp ranks (into 2cp chunks with the head-tail load
    balance) and then each rank's part over tp ranks (sequence parallelism), or None (`ParallelDims.sequence_problem`
    for a whole layout; this for degrees the planner has not made a layout of yet)."""
    chunks = 2 * cp if cp > 1 and load_balance else cp
    if seq_len % (chunks * tp) == 0:
        return None
    if cp == 1:
        return f"seq len {seq_len} is not divisible by tp {tp} (sequence parallelism splits it evenly)"
    how = f"{chunks} chunks for cp {cp}" + (" (head-tail load balance)" if load_balance else "")
    if tp > 1:
        how += f", each rank's part split again by tp {tp}"
    return f"seq len {seq_len} is not divisible by {chunks * tp} ({how})"


LAYOUT = ("tp", "cp", "pp", "gpus_per_node")
SHARD = ("shard_size", "strategy")
"""The decisions a layout error names (llmctl.spec.rules)."""

# Where a collective's group runs: inside one node; one ring over ranks of several nodes; or one of the concurrent
# groups that have one rank per node (HYBRID's cross-node all-reduce) and so share each node's NICs.
SCOPES = ("intra", "cross", "inter")


def canonical_strategy(name: str, allowed: tuple[str, ...] = STRATEGIES) -> str:
    """The one spelling of a strategy (`full_shard`, ...), from any accepted spelling (FULL, full, zero3, fsdp)."""
    v = name.strip().lower().replace("-", "_")
    v = STRATEGY_ALIASES.get(v, v)
    if v not in allowed:
        raise UnknownNameError(f"unknown strategy {name!r}", hint="choose one of: " + ", ".join(allowed))
    return v


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each kind of parallelism. Their product is the world size."""

    dp_replicate: int = 1
    """Data-parallel groups holding full replicas of the (sharded) states; gradients are all-reduced across them."""
    dp_shard: int = 1
    """Data-parallel ranks one replica's states are sharded over (FSDP's shard group)."""
    tp: int = 1
    """Tensor-parallel degree (with sequence parallelism: activations divide by tp too)."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    zero_stage: int = 3
    """Which states dp_shard splits: 1 optimizer states, 2 + gradients, 3 + parameters (FSDP). 0: none."""
    cp: int = 1
    """Context-parallel degree: the sequence split over cp ranks (between dp_shard and tp in the layout, as
    torchtitan's mesh (dp_replicate, dp_shard, cp, tp)); a cp group shares one micro-batch."""
    ep: int = 1
    """Expert-parallel degree: ranks borrowed from dp_shard x cp (torchtitan), not a factor of the world size."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InputError(f"parallel degree {name} must be a positive integer, got {v!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise InputError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if (self.dp_shard * self.cp) % self.ep:
            raise InputError(
                f"ep {self.ep} must divide the ranks it borrows from: dp_shard {self.dp_shard} x cp {self.cp} = "
                f"{self.dp_shard * self.cp}"
            )

    # --- from the friendly spelling --------------------------------------------------------------------------
    @classmethod
    def from_strategy(
        cls,
        strategy: str,
        nodes: int,
        gpus_per_node: int,
        tp: int = 1,
        pp: int = 1,
        shard_size: int | None = None,
        cp: int = 1,
        ep: int = 1,
    ) -> ParallelDims:
        """Degrees for a strategy on nodes x gpus_per_node ranks. `shard_size` (hybrid only) overrides the shard
        group's size (default: the data-parallel ranks of one node, gpus_per_node / tp)."""
        strategy = canonical_strategy(strategy)
        for label, v in (("nodes", nodes), ("gpus per node", gpus_per_node), ("tp", tp), ("pp", pp), ("cp", cp)):
            if v < 1:
                raise InputError(f"{label} must be a positive integer, got {v}")
        world = nodes * gpus_per_node
        if world % (tp * pp * cp):
            cp_part = f" x cp={cp}" if cp > 1 else ""
            raise RuleError(f"{world} GPUs cannot be split into tp={tp}{cp_part} x pp={pp} groups", decisions=LAYOUT)
        dp = world // (tp * pp * cp)
        layout, stage = _STRATEGIES[strategy]
        if shard_size is not None and layout != "hybrid":
            raise RuleError(f"a shard size is only meaningful with hybrid_shard, not {strategy}", decisions=SHARD)
        if layout == "replicate":
            return cls(dp, 1, tp, pp, stage, cp=cp, ep=ep)
        if layout == "shard":
            return cls(1, dp, tp, pp, stage, cp=cp, ep=ep)
        if shard_size is None:
            if gpus_per_node % (tp * cp):
                msg = f"hybrid_shard: tp={tp} x cp={cp} does not divide {gpus_per_node} GPUs per node"
                raise RuleError(msg, decisions=LAYOUT)
            shard_size = gpus_per_node // (tp * cp)
        if shard_size < 1 or dp % shard_size:
            raise RuleError(
                f"hybrid_shard: a shard group of {shard_size} does not divide the {dp} data-parallel ranks",
                decisions=SHARD,
            )
        return cls(dp // shard_size, shard_size, tp, pp, stage, cp=cp, ep=ep)

    # --- derived ---------------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    # --- which dimensions are on (torchtitan's `*_enabled`): code asks these, not `tp > 1` ----------------------
    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    def tags(self) -> list[str]:
        """The dimensions beyond data parallelism that are on, as short tags in mesh order (['cp2', 'tp4']): plan
        names and tables."""
        return [f"{n}{getattr(self, n)}" for n in ("pp", "cp", "tp", "ep") if getattr(self, n) > 1]

    @property
    def batch_sharers(self) -> int:
        """Ranks that share one micro-batch: a cp ring holds one sequence split, a tp group the same tokens."""
        return self.cp * self.tp

    @property
    def sequence_shards(self) -> int:
        """Parts one sequence's residual stream is split into, one per rank of a cp x tp block (ring attention over
        cp, then sequence parallelism over tp)."""
        return self.cp * self.tp

    def sequence_divisor(self, load_balance: bool = True) -> int:
        """What a sequence length must be a multiple of: 2cp head-tail chunks (cp chunks without the load balance),
        each rank's part split again by tp (sequence parallelism)."""
        chunks = 2 * self.cp if self.cp_enabled and load_balance else self.cp
        return chunks * self.tp

    def sequence_problem(self, seq_len: int, load_balance: bool = True) -> str | None:
        """Why a sequence of `seq_len` tokens cannot be split over the cp ranks (2cp chunks with the head-tail load
        balance) and then each rank's part over the tp ranks (sequence parallelism), or None."""
        return sequence_split_problem(seq_len, self.tp, self.cp, load_balance)

    @property
    def dp(self) -> int:
        """Data-parallel size: how many different micro-batches are trained at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def strategy(self) -> str:
        """The friendly name of these data-parallel degrees."""
        if self.dp_shard == 1 or self.zero_stage == 0:
            return "no_shard"
        if self.dp_replicate > 1:
            return "hybrid_shard"
        return {1: "zero1", 2: "shard_grad_op"}.get(self.zero_stage, "full_shard")

    def shard_degree(self, sharded_from_stage: int) -> int:
        """Ranks a state is split over: the FSDP group (dp_shard x cp, `fsdp_shard`) when the ZeRO stage shards it
        (see `zero_stage`), else 1."""
        return self.fsdp_shard if self.zero_stage >= sharded_from_stage else 1

    @property
    def mesh_dims(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The device mesh the engine builds: ("pp",) outermost with pipeline parallelism, then ("shard",) for one
        shard group over all data-parallel ranks, ("replicate", "shard") when there are replicas (HSDP; DDP is
        (dp, 1)), FSDP2's names; then ("cp",) with context parallelism and ("tp",) innermost with tensor parallelism
        (torchtitan's order (pp, dp_replicate, dp_shard, cp, tp): tp ranks consecutive, then the cp ring)."""
        inner = [(n, getattr(self, n)) for n in ("cp", "tp") if getattr(self, n) > 1]
        sizes, names = tuple(v for _, v in inner), tuple(n for n, _ in inner)
        outer = ((self.pp,), ("pp",)) if self.pp > 1 else ((), ())
        if self.dp_replicate > 1:
            return (*outer[0], self.dp_replicate, self.dp_shard, *sizes), (*outer[1], "replicate", "shard", *names)
        return (*outer[0], self.dp_shard, *sizes), (*outer[1], "shard", *names)

    @property
    def dp_mesh_dims(self) -> tuple[str, ...]:
        """The mesh dimensions FSDP2 shards and replicates over: every one but pp and tp (a cp group shards the
        states as data-parallel ranks do: torchtitan's dp_shard_cp)."""
        return tuple(n for n in self.mesh_dims[1] if n not in ("tp", "pp"))

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP2 splits one replica's parameters, gradients and optimizer states over: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def expert_shard(self) -> int:
        """Ranks FSDP2 splits one replica's routed experts over (torchtitan's efsdp): the dp_shard x cp ranks that
        expert parallelism does not borrow (llmctl.spec.experts)."""
        return self.fsdp_shard // self.ep

    @property
    def expert_mesh_dims(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The device mesh of the routed experts, over the same ranks as `mesh_dims`: dp_shard x cp split into
        ("efsdp", "ep") with ep innermost (an ep group is ep consecutive ranks of the flattened dp_shard x cp), pp
        outermost and replicate as in `mesh_dims`; tp innermost (the engine runs ep at tp 1)."""
        sizes: list[int] = []
        names: list[str] = []
        for n, v in (("pp", self.pp), ("replicate", self.dp_replicate)):
            if v > 1:
                sizes.append(v)
                names.append(n)
        sizes += [self.expert_shard, self.ep]
        names += ["efsdp", "ep"]
        if self.tp > 1:
            sizes.append(self.tp)
            names.append("tp")
        return tuple(sizes), tuple(names)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each axis (layout pp, dp_replicate, dp_shard, cp, tp; tp innermost)."""
        if not 0 <= rank < self.world_size:
            raise InputError(f"rank {rank} is outside a world of {self.world_size}")
        tp_i, rest = rank % self.tp, rank // self.tp
        cp_i, rest = rest % self.cp, rest // self.cp
        shard_i, rest = rest % self.dp_shard, rest // self.dp_shard
        rep_i, pp_i = rest % self.dp_replicate, rest // self.dp_replicate
        return {"pp": pp_i, "dp_replicate": rep_i, "dp_shard": shard_i, "cp": cp_i, "tp": tp_i}

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel slice of the global batch this rank trains on (the ranks of one tp x cp block share
        it)."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def attention_imbalance(self, load_balance: bool = True) -> float:
        """The slowest cp rank's attention FLOPs over the average rank's (torch's ring attention,
        torch.distributed.tensor.experimental._context_parallel._attention._is_causal_behavior). Cut the causal
        (S x S) score matrix into cp x cp blocks of S/cp: without the load balance rank i holds the i-th block row,
        whose causal part is i full blocks and one half (the diagonal), 2i + 1 half-blocks, so the last rank does
        2cp - 1 of the cp^2 half-blocks where the average is cp: (2cp - 1) / cp. With the head-tail split (2cp
        chunks, rank i holds chunks i and 2cp-1-i) every rank does 2 chunk-blocks per ring step, the same cp^2/cp:
        1."""
        if not self.cp_enabled or load_balance:
            return 1.0
        return (2 * self.cp - 1) / self.cp

    def rank_shard(self, seq_len: int) -> RankShard:
        """What one rank holds of a sequence of `seq_len` tokens and of a layer under these degrees."""
        return _rank_shard(self.tp, self.cp, seq_len)

    def tokens_per_step(self, micro_batch_size: int, grad_accum_steps: int, seq_len: int) -> int:
        """Tokens one optimizer step trains on: every data-parallel rank's micro-batches."""
        return micro_batch_size * grad_accum_steps * seq_len * self.dp

    def group_scope(self, axis: str, gpus_per_node: int) -> str:
        """Where a collective over `axis` ("dp_shard": FSDP's group, dp_shard x cp ranks; "dp_replicate"; or "efsdp":
        the routed experts' FSDP group under expert parallelism) runs,
        for ranks filled node by node:
        "intra" (the group fits in one node), "inter" (one rank per node: the node's ranks each sit in a different
        group, so the groups share the node's NICs) or "cross" (a ring over several ranks of several nodes)."""
        if axis == "dp_shard":
            size, stride = self.fsdp_shard, self.tp
        elif axis == "dp_replicate":
            size, stride = self.dp_replicate, self.tp * self.cp * self.dp_shard
        elif axis == "efsdp":  # the routed experts' FSDP group: dp_shard x cp / ep ranks, strided by ep (innermost)
            size, stride = self.expert_shard, self.tp * self.ep
        else:
            raise InputError(f"no collective group for axis {axis!r}", hint="dp_shard, dp_replicate or efsdp")
        if size <= 1 or gpus_per_node % (size * stride) == 0:
            return "intra"  # the group's ranks are consecutive (with stride) inside one node
        return "inter" if stride >= gpus_per_node else "cross"


@dataclass(frozen=True)
class RankShard:
    """One rank's part of each sequence and of each layer under context and tensor parallelism: what the memory and
    cost models size, asked here rather than divided by the degrees in each of them.

    Context parallelism splits each sequence over its ring: every activation holds this rank's `tokens`. Tensor
    parallelism splits a layer's heads, MLP columns and the vocabulary (`columns`: the first ranks' share when the
    degree does not divide them), its parameters (`params`), and under sequence parallelism the residual stream's
    tokens (`columns(tokens)`)."""

    tensor_ranks: int
    """Ranks one layer is split over (tp)."""
    ring_ranks: int
    """Ranks one sequence is split over (cp)."""
    seq_len: int

    @property
    def tokens(self) -> int:
        """This rank's tokens of each sequence (the whole sequence without context parallelism)."""
        return self.seq_len // self.ring_ranks

    @property
    def split_layers(self) -> bool:
        """Whether layers are split (tensor parallelism is on)."""
        return self.tensor_ranks > 1

    @property
    def split_sequences(self) -> bool:
        """Whether sequences are split (context parallelism is on)."""
        return self.ring_ranks > 1

    def params(self, n: float) -> float:
        """This rank's share of `n` parameters (or bytes) split evenly over the layer's ranks."""
        return n / self.tensor_ranks

    def columns(self, n: int) -> int:
        """This rank's heads, columns or vocabulary rows of `n` (the first ranks' share when the split is uneven)."""
        return -(-n // self.tensor_ranks)

    def whole_columns(self, n: int) -> int:
        """`n` split over the layer's ranks, rounded down (a vocabulary-sharded buffer's bytes)."""
        return n // self.tensor_ranks


@lru_cache(maxsize=1024)
def _rank_shard(tp: int, cp: int, seq_len: int) -> RankShard:
    """RankShard by its degrees (frozen: one object serves every setup of those degrees; the memory model asks it ~10
    times an estimate)."""
    return RankShard(tp, cp, seq_len)
