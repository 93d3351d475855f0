"""The rules between training decisions, each in one place (torch-free).

A rule says why a setup cannot be trained (one line, and a hint), or None. The setup asks the rules that need no
model when it is built (`TrainSetup.__post_init__`: a plan file, a flag, a pin and the planner's search all build
setups, so they all meet the same rule); the rules that need the model (`MODEL_RULES`: does the family split over tp,
does its attention run as a ring, ...) are asked by the plan file's check, the planner's request and search, and the
engine, through `model_problem`. `ENGINE_RULES` say what llmctl's engine runs of what the memory model can size
(estimate-memory's what-ifs: ZeRO-1, pipeline stages, other optimizers).

A rule names the decisions it constrains (`decisions`): a plan file's error names their keys, a command's their flags.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmctl.errors import RuleError
from llmctl.spec.optimizer_states import AUTO as AUTO_STATES
from llmctl.spec.pipeline import Schedule

if TYPE_CHECKING:
    from llmctl.spec.models import ModelSpec

Setup = Any
"""A llmctl.spec.setup.TrainSetup. Named, not imported: the setup asks these rules as it is built (it imports this
module), and a rule reads only the setup's fields."""


@dataclass(frozen=True)
class Rule:
    name: str
    decisions: tuple[str, ...]
    check: Callable[..., str | None]
    """(setup) -> the problem, or None; MODEL_RULES' take (setup, spec)."""
    hint: str | Callable[[Any], str] = ""

    def problem(self, setup: Setup, *model: ModelSpec) -> RuleError | None:
        why = self.check(setup, *model)
        if why is None:
            return None
        hint = self.hint(setup) if callable(self.hint) else self.hint
        return RuleError(why, hint=hint or None, decisions=self.decisions, rule=self.name)


# --- what a setup is, before its degrees are a layout ---------------------------------------------------------------
def _states_need_adamw(s: Setup) -> str | None:
    if s.optimizer_states != AUTO_STATES and s.optimizer != "adamw":
        return f"optimizer states {s.optimizer_states} apply to adamw's two moments, not {s.optimizer}"
    return None


def _chunk_without_tp(s: Setup) -> str | None:
    if s.tp > 1 and s.loss_chunk_tokens:
        return "tensor parallelism computes the loss on vocabulary shards (loss parallel), not in chunks"
    return None


def _async_tp(s: Setup) -> str | None:
    return "async TP needs tp > 1 and compile" if s.async_tp and (s.tp < 2 or not s.compile) else None


def _hybrid_nodes(s: Setup) -> str | None:
    if s.strategy == "hybrid_shard" and s.nodes < 2 and s.shard_size is None:
        return "hybrid_shard needs at least 2 nodes (on one node it is full_shard)"
    return None


BEFORE_LAYOUT = (
    Rule(
        "states need adamw",
        ("optimizer_states",),
        _states_need_adamw,
        "drop the optimizer states, or use the adamw optimizer",
    ),
    Rule("loss parallel", ("loss_chunk_tokens", "tp"), _chunk_without_tp, "set the loss chunk to 0 with tp > 1"),
    Rule("async tp", ("async_tp", "tp", "compile"), _async_tp, "turn on compile, or drop async TP"),
    Rule("hybrid nodes", ("strategy", "nodes"), _hybrid_nodes, "pass --nodes N --gpus-per-node G"),
)


# --- what a layout runs ------------------------------------------------------------------------------------------------
def _sequence(s: Setup) -> str | None:
    return s.dims.sequence_problem(s.seq_len, s.cp_load_balance)


def _ring_on_sdpa(s: Setup) -> str | None:
    if s.dims.cp_enabled and not s.attention.runs_ring:
        return f"context parallelism runs ring attention on SDPA, not {s.attention}"
    return None


def _fsdp2_no_zero1(s: Setup) -> str | None:
    return "FSDP2 has no ZeRO-1 (optimizer-only sharding)" if s.engine == "fsdp2" and s.strategy == "zero1" else None


def _flash_half(s: Setup) -> str | None:
    return "flash attention needs bf16 or fp16" if s.attention.needs_half and not s.precision.flash_attention else None


def _offload_fsdp2(s: Setup) -> str | None:
    if s.levers.offload and s.engine != "fsdp2":
        return f"CPU offload is FSDP2's CPUOffloadPolicy: not run with engine {s.engine}"
    return None


def _adapter_refusals(s: Setup) -> list[tuple[bool, str, str]]:
    """(refused, why, hint) of what llmctl's engine runs with adapters: FSDP2 data parallelism and cp, a half or fp32
    compute dtype."""
    ft = s.finetune
    return [
        (s.engine != "fsdp2", f"the {s.engine} engine's ledger is full training's", "drop --engine zero"),
        (s.dims.tp_enabled, f"tensor parallelism (tp {s.tp}) is not wired for adapters", "use tp 1 (FSDP, cp)"),
        (s.dims.pp_enabled, "pipeline parallelism is not run by llmctl's engine", "use pp 1"),
        (s.dims.ep_enabled, "expert parallelism is planned for full training only", "use ep 1"),
        (s.precision.float8, f"precision {s.precision.name} converts the frozen linears", "use bf16-mixed"),
        (s.levers.offload, "CPU offload is planned for full training only", "drop --offload"),
        (
            ft.method == "qlora" and s.precision.compute_dtype == "fp32",
            "QLoRA computes in bf16 or fp16 (its 4-bit base is dequantized to it)",
            "use precision bf16-mixed",
        ),
    ]


def _adapters(s: Setup) -> str | None:
    if not s.finetune.adapters:
        return None
    return next((f"{s.finetune.method}: {why}" for bad, why, _ in _adapter_refusals(s) if bad), None)


def _adapters_hint(s: Setup) -> str:
    return next((hint for bad, _, hint in _adapter_refusals(s) if bad), "")


def _pp_stages(s: Setup) -> str | None:
    sched, v = s.pp_schedule, s.virtual_stages
    if not s.dims.pp_enabled:
        return None
    if sched is Schedule.ZBV and v != 2:
        return f"pipeline schedule zbv runs 2 stages per rank in a V, not {v}"
    if sched.looped and v < 2:
        return f"pipeline schedule {sched} loops over 2 or more stages per rank, not {v}"
    if not sched.looped and v != 1:
        return f"pipeline schedule {sched} runs one stage per rank, not {v} (use interleaved-1f1b for virtual stages)"
    return None


def _pp_microbatches(s: Setup) -> str | None:
    m = s.pipeline_microbatches
    if s.dims.pp_enabled and s.grad_accum_steps % m:
        return (
            f"pp microbatches {m} must divide the {s.grad_accum_steps} accumulation micro-batches of a step (each "
            "schedule run takes pp microbatches of them)"
        )
    return None


def _pp_schedule_microbatches(s: Setup) -> str | None:
    """torch.distributed.pipelining's own limits on a run's micro-batches (schedules.py, torch 2.13): Schedule1F1B
    needs at least one per stage; ScheduleInterleaved1F1B runs them in rounds of pp, max(1, m // pp) rounds that must
    divide m. GPipe and ZB-V take any count."""
    m, pp, sched = s.pipeline_microbatches, s.pp, s.pp_schedule
    if not s.dims.pp_enabled:
        return None
    if sched is Schedule.ONE_F_ONE_B and m < pp:
        return f"pipeline schedule 1f1b needs at least pp {pp} micro-batches per run, not {m}"
    rounds = max(1, m // pp)
    if sched is Schedule.INTERLEAVED_1F1B and m % rounds:
        return f"pipeline schedule interleaved-1f1b runs {m} micro-batches in {rounds} rounds of pp {pp}: not evenly"
    return None


AFTER_LAYOUT = (
    Rule("sequence split", ("seq_len", "tp", "cp"), _sequence, "choose a sequence length that is a multiple of it"),
    Rule(
        "ring on sdpa",
        ("cp", "attention"),
        _ring_on_sdpa,
        "use attention auto or sdpa with cp > 1 (SDPA's own flash kernel runs on GPUs)",
    ),
    Rule("fsdp2 has no zero1", ("strategy", "engine"), _fsdp2_no_zero1, "use --engine zero"),
    Rule("flash needs half", ("attention", "precision"), _flash_half, "use --attention sdpa with fp32"),
    Rule("offload is fsdp2's", ("offload", "engine"), _offload_fsdp2, "use --engine fsdp2"),
    Rule("adapters", ("finetune", "tp", "pp", "ep", "precision", "offload", "engine"), _adapters, _adapters_hint),
    Rule("pp stages per rank", ("pp", "pp_schedule", "pp_virtual_stages"), _pp_stages, "leave pp_virtual_stages out"),
    Rule(
        "pp microbatches",
        ("pp", "pp_microbatches", "grad_accum_steps"),
        _pp_microbatches,
        "use a pp microbatches that divides --grad-accum, or leave it out",
    ),
)


def check(setup: Setup, rules: tuple[Rule, ...]) -> None:
    """Raise the first rule's refusal (RuleError: one line, its hint)."""
    for rule in rules:
        err = rule.problem(setup)
        if err is not None:
            raise err


# --- what a model allows ---------------------------------------------------------------------------------------------
def _tp_splits(s: Setup, spec: ModelSpec) -> str | None:
    from llmctl.families.tensor_parallel import plan_problem

    return plan_problem(spec, s.tp)


def _ring_runs(s: Setup, spec: ModelSpec) -> str | None:
    from llmctl.families.context_parallel import cp_problem

    return cp_problem(spec, s.seq_len) if s.dims.cp_enabled else None


def _positions(s: Setup, spec: ModelSpec) -> str | None:
    if spec.features.learned_positions and s.seq_len > spec.max_position_embeddings:
        # GPT-2 learns one embedding per position (wpe): a longer sequence indexes past the table.
        return (
            f"seq len {s.seq_len} is longer than the model's {spec.max_position_embeddings} positions (n_positions; "
            "set it in model.overrides)"
        )
    return None


def _nf4_base(s: Setup, spec: ModelSpec) -> str | None:
    # torchao's NF4 runs F.linear, not Conv1D's addmm (llmctl/engine/qlora.py)
    if s.finetune.method == "qlora" and spec.features.conv1d:
        return f"qlora: {spec.name}'s block matmuls are Conv1D layers, which llmctl's NF4 base does not run"
    return None


def _targets(s: Setup, spec: ModelSpec) -> str | None:
    from llmctl.spec.finetune import targets_problem

    return targets_problem(spec, s.finetune)


def _pp_split(s: Setup, spec: ModelSpec) -> str | None:
    from llmctl.spec.pipeline import max_stages

    most = max_stages(spec.num_layers)
    if not s.dims.pp_enabled:
        return None
    if s.pipeline_stages > most:
        return (
            f"{s.pipeline_stages} pipeline stages (pp {s.pp} x {s.virtual_stages} per rank) cannot split "
            f"{spec.name}'s {spec.num_layers} layers (at most {most}: the embedding and the head count as one each)"
        )
    if spec.tie_embeddings:  # the first stage's embedding and the last stage's head would be one weight on two ranks
        return f"pipeline parallelism: {spec.name} ties its embedding and LM head (first and last stage share them)"
    fam = spec.family
    if fam is not None and fam.pipeline_unsupported:
        return f"pipeline parallelism: {spec.model_type} cannot be split into stages: {fam.pipeline_unsupported}"
    return None


def _ep_split(s: Setup, spec: ModelSpec) -> str | None:
    from llmctl.spec.experts import ep_problem

    counts = sorted({la.mlp.num_experts for la in spec.layers if la.mlp.moe}) or [0]
    why = next((why for e in counts if (why := ep_problem(e, s.ep, spec.name))), None)
    if why is None and getattr(s, "moe_aux_loss", False) and not spec.moe:
        return f"training.moe_aux_loss: {spec.name} is dense (no router to balance)"
    if why is None and s.ep > 1 and spec.features.dense_moe:
        return (
            f"expert parallelism: {spec.name}'s MoE runs every token through every expert (transformers' "
            "Llama4TextMoe): there is no top-k dispatch to split"
        )
    return why


MODEL_RULES = (
    Rule("tp plan", ("tp",), _tp_splits, "use --tp 1, or no pin"),
    Rule("ring attention", ("cp",), _ring_runs, "use --cp 1, or no pin"),
    Rule("pp split", ("pp", "pp_virtual_stages"), _pp_split, "use a smaller --pp, or pp 1 for this model"),
    Rule(
        "ep split",
        ("ep", "moe_aux_loss"),
        _ep_split,
        "use ep 1, or an ep that divides every MoE layer's routed experts",
    ),
    Rule("learned positions", ("seq_len",), _positions),
    Rule("nf4 base", ("finetune",), _nf4_base, "use --finetune lora"),
    Rule("lora targets", ("lora_targets",), _targets, "leave finetune.lora_targets out for the family's defaults"),
)


def model_problem(setup: Setup, spec: ModelSpec, only: tuple[str, ...] | None = None) -> RuleError | None:
    """The first MODEL_RULES refusal of `setup` on `spec` (or of the rules named in `only`), or None."""
    for rule in MODEL_RULES:
        if only is not None and rule.name not in only:
            continue
        err = rule.problem(setup, spec)
        if err is not None:
            return err
    return None


# --- what llmctl's engine runs ---------------------------------------------------------------------------------------
def _engine_layout(s: Setup) -> str | None:
    from llmctl.spec.parallel import ENGINE_STRATEGIES

    if s.strategy not in ENGINE_STRATEGIES:
        return f"strategy {s.strategy} is not run by llmctl's engine"
    if s.engine != "fsdp2":
        return f"the {s.engine} engine is not llmctl's"
    return None


def _ep_engine(s: Setup) -> str | None:
    if s.dims.ep_enabled and s.dims.tp_enabled:
        return f"the engine's expert parallelism runs at tp 1 (experts are not split over tp; tp {s.tp})"
    if s.moe_aux_loss and (s.dims.pp_enabled or s.dims.tp_enabled):
        return "the engine adds the MoE auxiliary loss at pp 1 and tp 1 (its loss is the whole model's on one rank)"
    if s.dims.ep_enabled and s.dims.pp_enabled:
        # torch 2.13's pipeline stages infer their backward's shapes on some ranks of a stage and not others: the
        # dispatch's all-to-all inside a stage then waits for a peer that is already past it (measured: a hang at
        # the first step of pp 2 x ep 2 on 4 ranks).
        return f"the engine's expert parallelism runs at pp 1 (pp {s.pp}: not yet inside pipeline stages)"
    return None


ENGINE_RULES = (
    Rule("engine layout", ("strategy", "engine"), _engine_layout),
    Rule("ep at tp 1", ("ep", "tp", "pp", "moe_aux_loss"), _ep_engine, "use tp 1 and pp 1 with ep, or ep 1"),
    # An engine rule, not a setup rule: estimate-memory's --pp with the default single micro-batch stays a what-if.
    Rule(
        "pp schedule microbatches",
        ("pp", "pp_schedule", "pp_microbatches", "grad_accum_steps"),
        _pp_schedule_microbatches,
        "use a multiple of pp micro-batches per run (--grad-accum, --pp-microbatches)",
    ),
)


def engine_problem(setup: Setup) -> RuleError | None:
    for rule in ENGINE_RULES:
        err = rule.problem(setup)
        if err is not None:
            return err
    return None
