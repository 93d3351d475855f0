"""What the planner is asked: the model, the cluster and its network, the batch, the objective and the pins
(`PlanRequest`), with the achievable-efficiency factors it prices compute with (`Efficiency`), and the request built
from `llmctl plan`'s options (`build_request`, which `llmctl tune MODEL` uses too). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmctl.errors import InputError
from llmctl.families.context_parallel import cp_problem
from llmctl.families.tensor_parallel import plan_problem
from llmctl.plan import comm as cm
from llmctl.plan import kernel_time
from llmctl.plan import memory as mem
from llmctl.plan.calibrate import Calibration, read_calibration
from llmctl.plan.network import network_for
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec import hardware, kernels, models
from llmctl.spec.finetune import FULL, Finetune, method_problem
from llmctl.spec.hardware import GPUSpec
from llmctl.spec.models import ModelSpec
from llmctl.spec.optimizer_states import canonical_states
from llmctl.spec.parallel import ENGINE_STRATEGIES, canonical_strategy, sequence_split_problem
from llmctl.spec.precision import PrecisionPolicy, for_gpu
from llmctl.spec.setup import ATTENTIONS, MemoryLevers, TrainSetup, canonical

OBJECTIVES = ("throughput", "cost")
DEFAULT_SEQ_LEN = 2048
"""`plan --seq-len` when not given; a model that learns one embedding per position (GPT-2's wpe: what
llmctl.spec.planfile refuses to run past) gets at most its positions."""

# --- achievable efficiency ---------------------------------------------------------------------------------------
# The step's compute is priced by kind of kernel (llmctl.plan.kernel_time, from llmctl/spec/presets/kernels.yaml with
# each table's source): matmuls by shape, attention by kernel, head dimension and length, memory-bound ops by bytes.
# Tensor cores need dims that are multiples of 64 on A100 (docs/sources.md#fsdp-seed: "our tensor shapes must be a
# multiple of 64"); hidden or MLP sizes that are not run their matmuls at a reduced rate. The engine pads the
# vocabulary itself.
MISALIGNED_PENALTY = 0.85
# Memory-bound kernels (norms, rotary, activations, elementwise products) stream their tensors through device memory
# at this fraction of the catalog's hbm_gbytes_s, measured (presets/kernels.yaml, memory_bound_efficiency).
HBM_EFFICIENCY = kernels.memory_bound_efficiency()
DEFAULT_GLOBAL_BATCH_SEQS = 128
"""Default global batch when none is given: 128 sequences rounded up to a multiple of the GPUs (so that a node of 72
or 48 splits it evenly), or one per GPU past 128."""
TIGHT_MEMORY_FRACTION = 0.05
"""The plan warns when the chosen setup leaves less than this fraction of the GPU's memory free (beyond the allocator
headroom the estimate already holds). The estimate matches torch.cuda.max_memory_allocated for the model types it is
exact for (tests/plan/test_memory_measured.py); what it cannot see is outside the allocator and varies by a few
percent of an 80 GB GPU between stacks: the CUDA context and cuBLAS/NCCL workspaces are 0.5-2 GiB depending on the
driver, NCCL version and number of communicators (NCCL docs, "NCCL_BUFFSIZE": 4 MiB per channel and peer)."""


def node_counts(total: int) -> list[int]:
    """Nodes to try: powers of two up to the cluster, the whole cluster, and every divisor for small clusters."""
    out = {total}
    p = 1
    while p <= total:
        out.add(p)
        p *= 2
    if total <= 64:
        out.update(d for d in range(1, total + 1) if total % d == 0)
    return sorted(out)


@dataclass(frozen=True)
class Efficiency:
    """The matmuls' achievable efficiency (from the kernel tables), and what a user can override: the penalty for
    shapes that are not multiples of 64, and `calibration`, which multiplies every compute rate (--calibrate)."""

    misaligned_penalty: float = MISALIGNED_PENALTY
    calibration: float = 1.0

    def __post_init__(self) -> None:
        if self.calibration <= 0:
            raise InputError("efficiency calibration must be positive")

    def of(self, tokens_per_micro_batch: int, spec: ModelSpec, gpu: GPUSpec, dtype: str = "bf16", tp: int = 1) -> float:
        """Fraction of `dtype`'s dense peak the model's matmuls reach on one GPU (kernel_time.gemm_efficiency) for a
        micro-batch of that many tokens per rank, each rank of a tp group running its slices; never above 1."""
        e = kernel_time.gemm_efficiency(gpu, spec, tokens_per_micro_batch, tp, gpu.peak_tflops(dtype))
        if spec.hidden_size % 64 or spec.intermediate_size % 64:
            e *= self.misaligned_penalty
        return min(1.0, e * gpu.efficiency * self.calibration)

    def tp_width_factor(self, spec: ModelSpec, tp: int, gpu: GPUSpec, tokens: int, dtype: str = "bf16") -> float:
        """The rate of the model's matmuls split over tp ranks relative to tp = 1 (row-wise ones reduce over K / tp,
        the others produce 1/tp of the outputs: narrower matmuls, kernel_time.gemm_efficiency)."""
        if tp <= 1 or spec.measured is not None:
            return 1.0
        peak = gpu.peak_tflops(dtype)
        return kernel_time.gemm_efficiency(gpu, spec, tokens, tp, peak) / kernel_time.gemm_efficiency(
            gpu, spec, tokens, 1, peak
        )


@dataclass(frozen=True)
class PlanRequest:
    """Everything the planner needs; pins (strategy, micro_batch, ...) are None when free."""

    spec: ModelSpec
    gpu: GPUSpec
    nodes: int
    gpus_per_node: int
    network: cm.Network
    seq_len: int = 2048
    global_batch_seqs: int | None = None
    token_budget: int | None = None
    price_per_gpu_hour: float | None = None
    objective: str = "throughput"
    precision: PrecisionPolicy | str = "auto"
    """A policy, or its name or alias (turned into the policy); auto: the GPU's best (llmctl.spec.precision.for_gpu,
    fp16-mixed on a V100), with the reason in `precision_why`."""
    precision_why: str | None = None
    strategy: str | None = None
    micro_batch: int | None = None
    checkpointing: str | None = None
    attention: str | None = None
    compile: bool | None = None
    loss_chunk_tokens: int | None = None
    """Pin: 0 whole logits, N chunks of N tokens; None: the planner tries both (auto_loss_chunk)."""
    tp: int | None = None
    """Pin the tensor-parallel degree (None: the planner tries llmctl.families.tensor_parallel.valid_tp)."""
    cp: int | None = None
    """Pin the context-parallel degree (None: the planner tries 1, 2, 4, 8, ... where they split the GPUs and the
    sequence and the model's attention runs as ring attention: llmctl.families.context_parallel.cp_problem)."""
    overlap: float = cm.DEFAULT_OVERLAP
    efficiency: Efficiency = field(default_factory=Efficiency)
    sync_every_micro_batch: bool = True
    memory_margin: float = 0.0
    """Fraction of each GPU's memory the chosen setup must leave free (--memory-margin), on top of the allocator
    headroom and CUDA context the estimate includes."""
    optimizer_states: str = "auto"
    """What AdamW's moments are stored in, for every setup (llmctl.spec.optimizer_states): the planner never picks
    bf16 or 8bit by itself; only this (--optimizer-states) does."""
    offload: bool | None = None
    """Pin CPU offload on (--offload) or off (--no-offload); None: off, and on only where no setup fits the GPUs
    without it (llmctl.plan.planner.plan)."""
    node_memory_gib: float | None = None
    explain: bool = True
    """Size and explain every ranked candidate; False: the chosen one only (llmctl.plan.compare needs no more)."""
    nodes_exact: bool = False
    """Search only `nodes` nodes (llmctl.plan.compare probes each count once); False: every count up to it
    (llmctl.plan.search.node_counts: on a slow network fewer nodes can win)."""
    finetune: Finetune = FULL
    """Full training, or LoRA / QLoRA adapters on a frozen base (--finetune): every setup searched trains this way
    (llmctl's engine runs adapters at tp 1, without CPU offload: the planner searches neither with them)."""
    """Host memory per node (a cluster file's node_memory_gib) that CPU offload's states must fit in; None: the GPU
    catalog's node_memory_gib_per_gpu for the kind, where it is known."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "seq_len"):
            if getattr(self, name) < 1:
                raise InputError(f"{name.replace('_', ' ')} must be a positive integer, got {getattr(self, name)}")
        if self.global_batch_seqs is not None and self.global_batch_seqs < 1:
            raise InputError(f"global batch must be >= 1 sequence, got {self.global_batch_seqs}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise InputError(f"--micro-batch must be >= 1, got {self.micro_batch}")
        if self.token_budget is not None and self.token_budget < 1:
            raise InputError(f"token budget must be >= 1, got {self.token_budget}")
        if self.price_per_gpu_hour is not None and self.price_per_gpu_hour < 0:
            raise InputError(f"price per GPU-hour must be >= 0, got {self.price_per_gpu_hour}")
        if self.objective not in OBJECTIVES:
            raise InputError(f"unknown objective {self.objective!r}", hint="throughput or cost")
        if not 0 <= self.overlap <= 1:
            raise InputError(f"--overlap must be in [0, 1], got {self.overlap}")
        if not 0 <= self.memory_margin < 1:
            raise InputError(f"--memory-margin must be a fraction in [0, 1), got {self.memory_margin}")
        if self.objective == "cost" and self.price_per_gpu_hour is None:
            raise InputError(
                "--objective cost needs a price",
                hint="pass --price USD_PER_GPU_HOUR (or price_per_gpu_hour in --cluster)",
            )
        object.__setattr__(self, "optimizer_states", canonical_states(self.optimizer_states))
        p, why = for_gpu(self.precision, self.gpu)
        object.__setattr__(self, "precision", p)
        object.__setattr__(self, "precision_why", self.precision_why or why)
        self.precision.check_engine()
        if self.strategy is not None:
            s = canonical_strategy(self.strategy)
            if s not in ENGINE_STRATEGIES:
                raise InputError(
                    f"strategy {s} is not run by llmctl's engine", hint="one of: " + ", ".join(ENGINE_STRATEGIES)
                )
            object.__setattr__(self, "strategy", s)
        if self.checkpointing is not None:
            object.__setattr__(self, "checkpointing", ckpt_modes.parse(self.checkpointing))
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 0:
            raise InputError(f"--loss-chunk must be >= 0 tokens, got {self.loss_chunk_tokens}")
        if self.attention is not None:
            object.__setattr__(self, "attention", canonical(self.attention, ATTENTIONS, "attention"))
        if self.finetune.adapters and (self.tp or 1) > 1:
            raise InputError(
                f"--finetune {self.finetune.method}: tensor parallelism is not wired for adapters", hint="use --tp 1"
            )
        problem = method_problem(self.spec, self.finetune)
        if problem:
            raise InputError(problem[0], hint=problem[1])
        if self.finetune.adapters and self.offload:
            raise InputError(
                f"--finetune {self.finetune.method}: CPU offload is planned for full training only",
                hint="drop --offload",
            )
        if self.tp is not None:
            self._check_tp(self.tp)
        if self.cp is not None:
            self._check_cp(self.cp)

    def _check_tp(self, tp: int) -> None:
        """A pinned tp: within one node, splittable for the model, and no chunked loss (TP uses loss parallel)."""
        if tp < 1:
            raise InputError(f"--tp must be a positive integer, got {tp}")
        if self.gpus_per_node % tp:
            raise InputError(
                f"--tp {tp} does not divide the {self.gpus_per_node} GPUs per node (a TP group stays inside one node)",
                hint="use a divisor of --gpus-per-node",
            )
        problem = plan_problem(self.spec, tp)
        if problem:
            raise InputError(f"--tp {tp}: {problem}", hint="use --tp 1, or no pin")
        if self.seq_len % tp:
            raise InputError(
                f"--tp {tp} does not divide --seq-len {self.seq_len} (sequence parallelism splits it evenly)",
                hint="use a sequence length that is a multiple of tp",
            )
        if tp > 1 and self.loss_chunk_tokens:
            raise InputError(
                f"--tp {tp} with --loss-chunk {self.loss_chunk_tokens}: tensor parallelism computes the loss on "
                "vocabulary shards (loss parallel), not in chunks",
                hint="drop --loss-chunk, or pass --loss-chunk 0",
            )

    def _check_cp(self, cp: int) -> None:
        """A pinned cp: it (with a pinned tp) splits the GPUs and the sequence, and the model's attention runs as
        ring attention (which needs SDPA: no flash or eager pin)."""
        if cp < 1:
            raise InputError(f"--cp must be a positive integer, got {cp}")
        if cp == 1:
            return
        world, tp = self.nodes * self.gpus_per_node, self.tp or 1
        if world % (cp * tp):
            with_tp = f" x --tp {tp}" if tp > 1 else ""
            raise InputError(
                f"--cp {cp}{with_tp} does not divide the {world} GPUs ({self.nodes} x {self.gpus_per_node})",
                hint="use a power of two that divides the GPUs",
            )
        problem = cp_problem(self.spec, self.seq_len)
        if problem:
            raise InputError(f"--cp {cp}: {problem}", hint="use --cp 1, or no pin")
        split = sequence_split_problem(self.seq_len, tp, cp)
        if split:
            raise InputError(f"--cp {cp}: {split}", hint="use a sequence length that is a multiple of it")
        if self.attention in ("flash", "eager"):
            raise InputError(
                f"--cp {cp} with --attention {self.attention}: context parallelism runs ring attention on SDPA",
                hint="drop --attention, or pass --attention sdpa",
            )

    @property
    def async_tp(self) -> bool:
        """Whether the planner prices async TP on this GPU: NVLink-connected CUDA GPUs from Hopper on, where torch's
        micro-pipelined TP (symmetric memory, CUDA + compile) was measured (PyTorch dev-discuss, "Introducing Async
        Tensor Parallelism in PyTorch", 2024: H100 SXM with NVSwitch; torchtitan's docs/async_tp.md). Elsewhere TP's
        collectives are priced unhidden; a plan may still set parallel.async_tp and the engine runs it on CUDA."""
        return self.gpu.architecture in ("hopper", "blackwell") and self.gpu.link.startswith("NVLink")

    def node_options(self) -> list[int]:
        """The node counts the search tries."""
        return [self.nodes] if self.nodes_exact else node_counts(self.nodes)

    @property
    def global_batch(self) -> int:
        world = self.nodes * self.gpus_per_node  # 128 sequences up to a multiple of the GPUs (72: 144), or one each
        return self.global_batch_seqs or -(-max(DEFAULT_GLOBAL_BATCH_SEQS, world) // world) * world

    @property
    def capacity_bytes(self) -> int:
        """Bytes of each GPU a setup may use: its memory less the margin asked for."""
        return int(self.gpu.memory_bytes * (1 - self.memory_margin))

    @property
    def compute_dtype(self) -> str:
        return self.precision.compute_dtype

    @property
    def host_capacity_bytes(self) -> int | None:
        """Host memory per GPU CPU offload's states may fill (None: not known, not checked)."""
        return mem.host_capacity_bytes(self.gpu, self.gpus_per_node, self.node_memory_gib)

    def setup(
        self,
        strategy: str,
        nodes: int,
        micro_batch: int,
        grad_accum: int = 1,
        checkpointing: str = "none",
        attention: str = "sdpa",
        compile_: bool = False,
        loss_chunk_tokens: int = 0,
        tp: int = 1,
        async_tp: bool = False,
        cp: int = 1,
        cp_rotate: str = "allgather",
    ) -> TrainSetup:
        """A setup of the search on this request's GPUs per node, sequence and precision (FSDP2, AdamW; context
        parallelism with the head-tail load balance; CPU offload where the request pins it on)."""
        return TrainSetup(
            tp=tp,
            async_tp=async_tp,
            cp=cp,
            cp_rotate=cp_rotate,
            precision=self.precision,
            optimizer="adamw",
            optimizer_states=self.optimizer_states,
            strategy=strategy,
            engine="fsdp2",
            nodes=nodes,
            gpus_per_node=self.gpus_per_node,
            micro_batch_size=micro_batch,
            grad_accum_steps=grad_accum,
            seq_len=self.seq_len,
            checkpointing=checkpointing,
            attention=attention,
            compile=compile_,
            loss_chunk_tokens=loss_chunk_tokens,
            levers=MemoryLevers(offload=bool(self.offload)),
            finetune=self.finetune,
        )


def default_seq_len(spec: ModelSpec) -> int:
    """The sequence length a plan trains at when none is asked for (DEFAULT_SEQ_LEN)."""
    return min(DEFAULT_SEQ_LEN, spec.max_position_embeddings) if spec.features.learned_positions else DEFAULT_SEQ_LEN


def build_request(
    model: str,
    o: dict[str, Any],
    strategy: str | None = None,
    micro_batch: int | None = None,
    checkpointing: str | None = None,
    compile_: bool | None = None,
    spec: ModelSpec | None = None,
) -> tuple[PlanRequest, Calibration | None]:
    """The planner's request for MODEL from `llmctl plan`'s options by name (`o`: params, gpu, gpus, nodes, gpus_per_node,
    cluster, net, intra_gbps, inter_gbps, seq_len, global_batch, global_batch_tokens, tokens, price, objective,
    precision, loss_chunk, attention, overlap, calibrate, memory_margin, tp, cp, optimizer_states, offload, finetune; gpus,
    memory_margin, tp, cp, optimizer_states and offload may be absent) and the pinned decisions, every value checked in one order
    (the first bad one is the one line); with the calibration read from `calibrate`. `spec`: MODEL resolved already. `llmctl tune MODEL` builds its
    request here too."""
    gpus = o.get("gpus")
    if gpus is not None and o["nodes"] is not None:
        raise InputError("give either --gpus or --nodes (with --gpus-per-node), not both")
    flags = {
        "gpu": o["gpu"],
        "nodes": o["nodes"],
        "gpus_per_node": o["gpus_per_node"],
        "inter_node_gbps": o["inter_gbps"],
        "intra_node_gbps": o["intra_gbps"],
        "price_per_gpu_hour": o["price"],
    }
    for flag, v in (("--nodes", o["nodes"]), ("--gpus-per-node", o["gpus_per_node"])):
        if v is not None and v < 1:
            raise InputError(f"{flag} must be a positive integer, got {v}")
    for flag, x in (("--inter-gbps", o["inter_gbps"]), ("--intra-gbps", o["intra_gbps"]), ("--price", o["price"])):
        if x is not None and (not x >= 0 or (x == 0 and flag != "--price")):
            raise InputError(f"{flag} must be {'>= 0' if flag == '--price' else 'positive'}, got {x}")
    if o["cluster"]:  # the cluster file is the main input; flags override it
        hw = hardware.load_cluster(o["cluster"], **flags)
    else:
        if o["gpu"] is None:
            raise InputError("no GPU kind given", hint="pass --gpu KIND or --cluster cluster.yaml")
        hw = hardware.make_cluster("the flags", **flags)
    if gpus is not None:  # a total: one node up to a node's worth (the file's, the flag's or the kind's), else nodes
        n, g = hardware.cluster_shape(gpus, None, o["gpus_per_node"], hw.gpus_per_node)
        hw = hw.model_copy(update={"nodes": n, "gpus_per_node": g})
    seq_len, gb, gbt = o["seq_len"], o["global_batch"], o["global_batch_tokens"]
    if gb is not None and gbt is not None:
        raise InputError("give either --global-batch (sequences) or --global-batch-tokens, not both")
    if seq_len is not None and seq_len < 1:
        raise InputError(f"--seq-len must be a positive integer, got {seq_len}")
    spec = spec or models.resolve_model(model, o["params"])  # `spec`: MODEL already resolved (llmctl.plan.compare)
    if seq_len is None:
        seq_len = default_seq_len(spec)
    if gbt is not None:
        if gbt < seq_len:
            raise InputError(f"--global-batch-tokens {gbt} is less than one sequence ({seq_len})")
        gb = gbt // seq_len
    budget = models.parse_count(o["tokens"], "--tokens", models.MAX_TOKENS) if o["tokens"] is not None else None
    network = network_for(hw, o["net"])
    cal = read_calibration(o["calibrate"]) if o["calibrate"] else None
    req = PlanRequest(
        spec=spec,
        gpu=hw.gpu_spec,
        nodes=hw.nodes,
        gpus_per_node=hw.gpus_per_node,
        network=network,
        seq_len=seq_len,
        global_batch_seqs=gb,
        token_budget=budget,
        price_per_gpu_hour=hw.price_per_gpu_hour,
        objective=o["objective"].strip().lower(),
        precision=o["precision"],
        strategy=strategy,
        micro_batch=micro_batch,
        checkpointing=checkpointing,
        attention=o["attention"],
        compile=compile_,
        loss_chunk_tokens=o["loss_chunk"],
        tp=o.get("tp"),
        cp=o.get("cp"),
        overlap=o["overlap"],
        efficiency=Efficiency(calibration=cal.factor) if cal else Efficiency(),
        memory_margin=o.get("memory_margin") or 0.0,
        optimizer_states=o.get("optimizer_states") or "auto",
        offload=o.get("offload"),
        finetune=o.get("finetune") or FULL,
        node_memory_gib=hw.node_memory_gib,
    )
    return req, cal
