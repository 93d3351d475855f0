"""What the planner is asked: the model, the cluster and its network, the batch, the objective and the pins
(`PlanRequest`), with the achievable-efficiency factors it prices compute with (`Efficiency`), and the request built
from `llmctl plan`'s options (`build_request`, which `llmctl tune MODEL` uses too). Torch-free."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Any

from llmctl.errors import InputError, RuleError
from llmctl.plan import batch, kernel_time
from llmctl.plan import comm as cm
from llmctl.plan import memory as mem
from llmctl.plan.calibrate import Calibration, read_calibration
from llmctl.plan.memory.margin import DEFAULT_MEMORY_MARGIN, Margin
from llmctl.plan.network import network_for
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec import hardware, kernels, models
from llmctl.spec.attention import attention
from llmctl.spec.decisions import declared, on_command, with_values
from llmctl.spec.finetune import FULL, Finetune, from_flags
from llmctl.spec.hardware import GPUSpec
from llmctl.spec.models import ModelSpec
from llmctl.spec.optimizer_states import canonical_states
from llmctl.spec.parallel import ENGINE_STRATEGIES, canonical_strategy
from llmctl.spec.pipeline import max_stages
from llmctl.spec.precision import PrecisionPolicy, for_gpu
from llmctl.spec.rules import model_problem
from llmctl.spec.setup import TrainSetup

OBJECTIVES = ("throughput", "cost")
CHOSEN = {d.name for d in declared(TrainSetup) if d.search in ("key", "best")}
"""The decisions each setup of the search chooses (a pin narrows the search); the others' pins are in `base`."""
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


CPU_PINS = {"compile": False, "attention": "sdpa"}
"""What a plan on the host's cores (`--gpu cpu`) fixes unless the flags say otherwise, as the shipped CPU examples do:
torch.compile off (Inductor's CPU code needs a C++ compiler and takes minutes for a run of seconds), attention by
SDPA's CPU kernel (what `attention: auto` runs without CUDA; the kernel tables price only GPU kernels, and would
pick eager attention on a CPU's memory bandwidth)."""


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

    def of(
        self, tokens_per_micro_batch: int, spec: ModelSpec, gpu: GPUSpec, dtype: str = "bf16", tp: int = 1, ep: int = 1
    ) -> float:
        """Fraction of `dtype`'s dense peak the model's matmuls reach on one GPU (kernel_time.gemm_efficiency) for a
        micro-batch of that many tokens per rank, each rank of a tp group running its slices, under expert
        parallelism the experts as grouped GEMMs; never above 1."""
        e = kernel_time.gemm_efficiency(gpu, spec, tokens_per_micro_batch, tp, gpu.peak_tflops(dtype), ep)
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
    """Everything the planner needs. `pins`: the decisions the user fixed (llmctl.spec.decisions: a decision the
    planner searches is searched when it is not pinned); the rest of a setup of the search is `base`."""

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
    pins: Mapping[str, Any] = field(default_factory=dict)
    """Decision name -> the pinned value (strategy, micro_batch_size, checkpointing, attention, compile,
    loss_chunk_tokens, tp, cp, offload); a missing or None one is searched. CPU offload unpinned is off, and on only
    where no setup fits the GPUs without it (llmctl.plan.planner.plan)."""
    overlap: float = cm.DEFAULT_OVERLAP
    efficiency: Efficiency = field(default_factory=Efficiency)
    sync_every_micro_batch: bool = True
    memory_margin: float = DEFAULT_MEMORY_MARGIN
    """Fraction of each GPU's memory the chosen setup must leave free (--memory-margin), on top of the allocator
    headroom and CUDA context the estimate includes; by default what llmctl.plan.memory.margin derives from the
    H100's measured fragmentation and NCCL's buffers."""
    optimizer_states: str = "auto"
    """What AdamW's moments are stored in, for every setup (llmctl.spec.optimizer_states): the planner never picks
    bf16 or 8bit by itself; only this (--optimizer-states) does."""
    node_memory_gib: float | None = None
    """Host memory per node (a cluster file's node_memory_gib) that CPU offload's states must fit in; None: the GPU
    catalog's node_memory_gib_per_gpu for the kind, where it is known."""
    explain: bool = True
    """Size and explain every ranked candidate; False: the chosen one only (llmctl.plan.compare needs no more)."""
    nodes_exact: bool = False
    """Search only `nodes` nodes (llmctl.plan.compare probes each count once); False: every count up to it
    (llmctl.plan.search.node_counts: on a slow network fewer nodes can win)."""
    finetune: Finetune = FULL
    """Full training, or LoRA / QLoRA adapters on a frozen base (--finetune): every setup searched trains this way
    (llmctl's engine runs adapters at tp 1, without CPU offload: the planner searches neither with them)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "seq_len"):
            if getattr(self, name) < 1:
                raise InputError(f"{name.replace('_', ' ')} must be a positive integer, got {getattr(self, name)}")
        if self.global_batch_seqs is not None and self.global_batch_seqs < 1:
            raise InputError(f"global batch must be >= 1 sequence, got {self.global_batch_seqs}")
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
        object.__setattr__(self, "pins", MappingProxyType(_canonical_pins(self.pins)))
        check_pins(self)  # the rules, asked of the pins as the search will ask them

    def pin(self, name: str) -> Any:
        """The pinned value of a decision (by its name in llmctl.spec.decisions), or None: searched."""
        return self.pins.get(name)

    def with_pins(self, **pins: Any) -> PlanRequest:
        """This request with these pins changed (None: searched)."""
        return replace(self, pins={**self.pins, **pins})

    def __hash__(self) -> int:  # the pins are a mapping: hash what tells requests apart most often
        return hash((id(self.spec), self.gpu.name, self.nodes, self.gpus_per_node, self.seq_len))

    @cached_property
    def base(self) -> TrainSetup:
        """What every setup of the search shares: this request's GPUs per node, sequence, precision, optimizer states
        and training method on FSDP2 with AdamW, and the pins of the decisions the search does not choose (CPU
        offload, ...); a setup of the search is `candidate(...)`, this with the decisions the search chose."""
        fixed = TrainSetup(
            precision=self.precision,
            optimizer="adamw",
            optimizer_states=self.optimizer_states,
            engine="fsdp2",
            gpus_per_node=self.gpus_per_node,
            seq_len=self.seq_len,
            finetune=self.finetune,
        )
        return with_values(fixed, **{k: v for k, v in self.pins.items() if k not in CHOSEN})

    def candidate(self, **choice: Any) -> TrainSetup:
        """A setup of the search: `base` with the decisions chosen (by name: strategy, nodes, micro_batch_size,
        grad_accum_steps, checkpointing, attention, compile, loss_chunk_tokens, tp, async_tp, cp, cp_rotate)."""
        key = tuple(choice.items())
        setup = self._candidates.get(key)
        if setup is None:
            setup = self._candidates[key] = with_values(self.base, **choice)
        return setup

    @cached_property
    def _candidates(self) -> dict[tuple, TrainSetup]:
        """`candidate`'s setups by choice: the search builds the same setup many times over (bounds, memory search,
        timing), and a TrainSetup checks its rules when built. Setups are frozen, so one object serves them all."""
        return {}

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
    def batch_ranks(self) -> int:
        """The data-parallel ranks a default global batch is a multiple of: the GPUs over the pinned tp x cp x pp
        (every setup of the search splits it evenly; a node of 72 or 48 too)."""
        k = (self.pin("tp") or 1) * (self.pin("cp") or 1) * (self.pin("pp") or 1)
        return max(1, self.nodes * self.gpus_per_node // k)

    @cached_property
    def global_batch(self) -> int:
        """Sequences a step: as given, or llmctl.plan.batch's default in tokens for the model's size over the
        sequence length, rounded up to a multiple of `batch_ranks`."""
        return self.global_batch_seqs or batch.default_global_batch(
            self.spec.params, self.seq_len, self.batch_ranks, self.batch_kind
        )

    @property
    def batch_kind(self) -> str:
        """Which default batch the request takes (llmctl.plan.batch.kind_of): a CPU plan's, fine-tuning's, the table's."""
        return batch.kind_of(self.gpu.device == "cpu", self.finetune.adapters)

    def batch_line(self, step_time_s: float | None = None) -> str:
        """The global batch, where it came from, and how long a step of it takes (llmctl.plan.batch.explain)."""
        given = self.global_batch_seqs is not None
        return batch.explain(
            self.spec.params,
            self.seq_len,
            self.global_batch,
            self.batch_ranks,
            given,
            step_time_s=step_time_s,
            kind=self.batch_kind,
        )

    @property
    def capacity_bytes(self) -> int:
        """Bytes of each GPU a setup may use: its memory less the margin asked for."""
        return int(self.gpu.memory_bytes * (1 - self.memory_margin))  # Margin.capacity_bytes, asked per candidate

    @property
    def margin(self) -> Margin:
        """The margin kept free on each GPU (llmctl.plan.memory.margin)."""
        return Margin(self.memory_margin, self.gpu.memory_bytes)

    @property
    def compute_dtype(self) -> str:
        return self.precision.compute_dtype

    @property
    def host_capacity_bytes(self) -> int | None:
        """Host memory per GPU CPU offload's states may fill (None: not known, not checked)."""
        return mem.host_capacity_bytes(self.gpu, self.gpus_per_node, self.node_memory_gib)


def _canonical_pins(pins: Mapping[str, Any]) -> dict[str, Any]:
    """The pins given (None dropped), each in its one spelling; an unknown decision is a bug of the caller."""
    known = {d.name for d in declared(TrainSetup)}
    out: dict[str, Any] = {}
    for name, v in pins.items():
        if name not in known:
            raise TypeError(f"no decision {name!r} to pin")
        if v is None:
            continue
        if name == "strategy":
            v = canonical_strategy(v)
            if v not in ENGINE_STRATEGIES:
                raise InputError(
                    f"strategy {v} is not run by llmctl's engine", hint="one of: " + ", ".join(ENGINE_STRATEGIES)
                )
        elif name == "checkpointing":
            v = ckpt_modes.parse(v)
        elif name == "attention":
            v = attention(v, allow_auto=False)
        out[name] = v
    return out


def default_seq_len(spec: ModelSpec) -> int:
    """The sequence length a plan trains at when none is asked for (DEFAULT_SEQ_LEN)."""
    return min(DEFAULT_SEQ_LEN, spec.max_position_embeddings) if spec.features.learned_positions else DEFAULT_SEQ_LEN


REQUEST_FIELDS = ("precision", "optimizer_states", "seq_len", "finetune", "lora_rank", "lora_alpha")
"""The decisions a request holds in fields of its own (the precision and the sequence are resolved for the GPU and
the model); every other decision given is a pin (`PlanRequest.pins`)."""


def build_request(
    model: str, o: Mapping[str, Any], decisions: Mapping[str, Any] | None = None, spec: ModelSpec | None = None
) -> tuple[PlanRequest, Calibration | None]:
    """The planner's request for MODEL from `llmctl plan`'s options by name (`o`: params, gpu, gpus, nodes,
    gpus_per_node, cluster, net, intra_gbps, inter_gbps, global_batch, global_batch_tokens, tokens, price, objective,
    overlap, calibrate, memory_margin; gpus and memory_margin may be absent) and its decisions by name (`decisions`:
    the pins, None where searched, and the values of those it does not search; missing ones at `llmctl plan`'s
    defaults), every value checked in one order
    (the first bad one is the one line); with the calibration read from `calibrate`. `spec`: MODEL resolved already.
    `llmctl tune MODEL` builds its request here too."""
    d = {x.name: x.planning_default for x in on_command(TrainSetup, "plan")} | dict(decisions or {})
    flagged = on_command(TrainSetup, "plan")
    misplaced = sorted(set(o) & ({x.name for x in flagged} | {x.param for x in flagged}))
    if misplaced:  # a caller's bug: a decision among the options would be ignored
        raise TypeError(f"decisions given as options: {misplaced}")
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
    if hw.gpu_spec.is_cpu:
        d |= {k: v for k, v in CPU_PINS.items() if d.get(k) is None}
    seq_len, gb, gbt = d["seq_len"], o["global_batch"], o["global_batch_tokens"]
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
        precision=d["precision"],
        pins={k: v for k, v in d.items() if k not in REQUEST_FIELDS},
        overlap=o["overlap"],
        efficiency=Efficiency(calibration=cal.factor) if cal else Efficiency(),
        memory_margin=DEFAULT_MEMORY_MARGIN if o.get("memory_margin") is None else o["memory_margin"],
        optimizer_states=d["optimizer_states"] or "auto",
        finetune=from_flags(d),
        node_memory_gib=hw.node_memory_gib,
    )
    return req, cal


# --- the pins against the rules ---------------------------------------------------------------------------------
def _flags(names: tuple[str, ...], req: PlanRequest) -> str:
    """'--cp 2 with --attention flash': the pinned decisions a rule names, as the flags that pinned them."""
    given = [
        d.spell(req.pins[d.name]) for d in declared(TrainSetup) if d.name in names and d.flag and d.name in req.pins
    ]
    return " with ".join(given)


def _refusal(err: RuleError, req: PlanRequest) -> InputError:
    where = _flags(err.decisions, req)
    return InputError(f"{where}: {err.message}" if where else err.message, hint=err.hint)


def check_pins(req: PlanRequest) -> None:
    """The pins against the rules (llmctl.spec.rules) as the search will meet them, one line naming the flags; and
    the planner's own layouts: a TP group stays inside one node, a cp x tp block divides the GPUs."""
    pins = req.pins
    if pins.get("micro_batch_size", 1) < 1:
        raise InputError(f"--micro-batch must be >= 1, got {pins['micro_batch_size']}")
    for name, flag in (
        ("tp", "--tp"),
        ("cp", "--cp"),
        ("pp_microbatches", "--pp-microbatches"),
        ("pp_virtual_stages", "--pp-virtual-stages"),
    ):
        if pins.get(name) is not None and pins[name] < 1:
            raise InputError(f"{flag} must be a positive integer, got {pins[name]}")
    if pins.get("loss_chunk_tokens", 0) < 0:
        raise InputError(f"--loss-chunk must be >= 0 tokens, got {pins['loss_chunk_tokens']}")
    tp_pin, cp_pin = pins.get("tp", 1), pins.get("cp", 1)
    if req.gpus_per_node % tp_pin:
        raise InputError(
            f"--tp {tp_pin} does not divide the {req.gpus_per_node} GPUs per node (a TP group stays inside one node)",
            hint="use a divisor of --gpus-per-node",
        )
    world = req.nodes * req.gpus_per_node
    if world % (cp_pin * tp_pin):
        with_tp = f" x --tp {tp_pin}" if tp_pin > 1 else ""
        raise InputError(
            f"--cp {cp_pin}{with_tp} does not divide the {world} GPUs ({req.nodes} x {req.gpus_per_node})",
            hint="use a power of two that divides the GPUs",
        )
    pp_pin = pins.get("pp", 1)
    if pp_pin < 1:
        raise InputError(f"--pp must be a positive integer, got {pp_pin}")
    if world % (cp_pin * tp_pin * pp_pin):
        others = "".join(f" x {f} {v}" for f, v in (("--cp", cp_pin), ("--tp", tp_pin)) if v > 1)
        raise InputError(
            f"--pp {pp_pin}{others} does not divide the {world} GPUs ({req.nodes} x {req.gpus_per_node})",
            hint="use a power of two that divides the GPUs",
        )
    if pp_pin > max_stages(req.spec.num_layers):
        raise InputError(
            f"--pp {pp_pin}: {req.spec.name}'s {req.spec.num_layers} layers split into at most "
            f"{max_stages(req.spec.num_layers)} pipeline stages (the embedding and the head count as one layer each)",
            hint="use a smaller --pp",
        )
    layout = {k: pins[k] for k in ("tp", "cp", "ep", "loss_chunk_tokens", "attention") if k in pins}
    try:
        probe = req.candidate(nodes=req.nodes, **layout)
    except RuleError as e:
        raise _refusal(e, req) from None
    err = model_problem(probe, req.spec, only=("nf4 base", "lora targets", "tp plan", "ring attention", "ep split"))
    if err is not None:
        raise _refusal(err, req)
