"""Pipeline parallelism's schedules and stage split, declared once (torch-free).

The memory model, the cost model, the planner and the engine all ask this module which layers a pipeline stage holds
(`split_layers`), which stages a pp rank runs (`stages_of_rank`), how many micro-batches of activations a rank holds
at its peak (`in_flight`) and how much of a step the pipeline idles (`bubble_fraction`). The schedule names are
torch.distributed.pipelining's (`Schedule1F1B`, `ScheduleInterleaved1F1B`, `ScheduleZBVZeroBubble`, `ScheduleGPipe`).

Batch semantics: the global batch stays micro-batch x grad_accum_steps x dp. Under pp > 1 the accumulation
micro-batches go through the pipeline: one schedule run takes `pp_microbatches` of them (it divides grad_accum_steps),
and a step runs grad_accum_steps / pp_microbatches schedule runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from llmctl.errors import InputError, UnknownNameError


class Schedule(StrEnum):
    GPIPE = "gpipe"
    """All forwards, then all backwards (Huang et al. 2019, arXiv 1811.06965): every micro-batch's activations held."""
    ONE_F_ONE_B = "1f1b"
    """PipeDream-Flush's one-forward-one-backward (Narayanan et al. 2021, arXiv 2104.04473 section 2.2): stage i
    holds at most pp - i micro-batches."""
    INTERLEAVED_1F1B = "interleaved-1f1b"
    """Megatron's interleaved schedule (arXiv 2104.04473 section 2.2.1): each rank runs v looped stages (rank r holds
    stages r, r + pp, ...), the bubble shrinks by v at v times the point-to-point sends."""
    ZBV = "zbv"
    """Zero Bubble's ZB-V (Qi et al. 2024, arXiv 2401.10241 section 6): two stages per rank in a V (rank r holds
    stages r and 2pp - 1 - r), backward split into input (B) and weight (W) gradients."""

    @property
    def looped(self) -> bool:
        """More than one stage per rank (virtual stages)."""
        return self in (Schedule.INTERLEAVED_1F1B, Schedule.ZBV)

    @property
    def torch_class(self) -> str:
        """The class in torch.distributed.pipelining.schedules."""
        return {
            Schedule.GPIPE: "ScheduleGPipe",
            Schedule.ONE_F_ONE_B: "Schedule1F1B",
            Schedule.INTERLEAVED_1F1B: "ScheduleInterleaved1F1B",
            Schedule.ZBV: "ScheduleZBVZeroBubble",
        }[self]

    def default_virtual_stages(self) -> int:
        """Stages per rank when the plan does not say: 1, 2 for the looped schedules (ZB-V runs exactly 2)."""
        return 2 if self.looped else 1


SCHEDULES: tuple[Schedule, ...] = tuple(Schedule)

_ALIASES = {
    "1f1b": Schedule.ONE_F_ONE_B,
    "schedule1f1b": Schedule.ONE_F_ONE_B,
    "gpipe": Schedule.GPIPE,
    "schedulegpipe": Schedule.GPIPE,
    "interleaved-1f1b": Schedule.INTERLEAVED_1F1B,
    "interleaved1f1b": Schedule.INTERLEAVED_1F1B,
    "interleaved": Schedule.INTERLEAVED_1F1B,
    "scheduleinterleaved1f1b": Schedule.INTERLEAVED_1F1B,
    "zbv": Schedule.ZBV,
    "zb-v": Schedule.ZBV,
    "zbvzerobubble": Schedule.ZBV,
    "schedulezbvzerobubble": Schedule.ZBV,
}


def schedule(name: str | Schedule) -> Schedule:
    """The schedule a name means: ours (`interleaved-1f1b`), torch's class or torchtitan's name (`Interleaved1F1B`,
    `ScheduleZBVZeroBubble`), any case, `_` for `-`."""
    if isinstance(name, Schedule):
        return name
    key = str(name).strip().lower().replace("_", "-")
    found = _ALIASES.get(key) or _ALIASES.get(key.replace("-", ""))
    if found is None:
        raise UnknownNameError(f"unknown pipeline schedule {name!r}: use one of {', '.join(SCHEDULES)}")
    return found


@dataclass(frozen=True)
class StagePart:
    """What one pipeline stage holds of the model: blocks [first_block, first_block + num_blocks), and the token
    embedding (first stage) or the final norm and LM head (last stage)."""

    index: int
    first_block: int
    num_blocks: int
    embedding: bool
    head: bool

    @property
    def blocks(self) -> range:
        return range(self.first_block, self.first_block + self.num_blocks)


def split_layers(num_layers: int, stages: int, input_weight: int = 1, output_weight: int = 1) -> tuple[StagePart, ...]:
    """The blocks of each of `stages` stages, the torchtitan way (generate_llm_fqn_per_model_part in
    torchtitan/distributed/pipeline_parallel.py): the embedding counts as `input_weight` blocks and the norm + head as
    `output_weight`, the num_layers + 2 "layers" are dealt out evenly, the first stages taking one more when they do
    not divide; so the first and last stages may hold fewer blocks."""
    if stages < 1:
        raise InputError(f"pipeline stages must be >= 1, got {stages}")
    if stages == 1:
        return (StagePart(0, 0, num_layers, True, True),)
    effective = num_layers + input_weight + output_weight
    per, extra = divmod(effective, stages)
    if per == 0 or input_weight > per or output_weight > per:
        raise InputError(
            f"{stages} pipeline stages cannot split {num_layers} layers (the embedding and the head count as one "
            f"layer each: at most {max_stages(num_layers)} stages)"
        )
    parts, block = [], 0
    for i in range(stages):
        share = per + (1 if i < extra else 0)
        first, last = i == 0, i == stages - 1
        n = share - (input_weight if first else 0) - (output_weight if last else 0)
        n = max(0, min(n, num_layers - block))
        parts.append(StagePart(i, block, n, first, last))
        block += n
    if block != num_layers:  # cannot happen with per >= weights; kept as the split's invariant
        raise InputError(f"pipeline split of {num_layers} layers over {stages} stages left {num_layers - block} out")
    return tuple(parts)


def max_stages(num_layers: int) -> int:
    """The most stages `split_layers` can make of a model (each stage at least one layer, the embedding and the head
    counted as one each)."""
    return num_layers + 2


def stages_of_rank(sched: Schedule, rank: int, pp: int, virtual: int) -> tuple[int, ...]:
    """The stage indices pp rank `rank` runs: looped ranks hold rank, rank + pp, ... ; ZB-V's V holds rank and
    2pp - 1 - rank (torchtitan's stage placement)."""
    if sched is Schedule.ZBV:
        return (rank, 2 * pp - 1 - rank)
    return tuple(rank + s * pp for s in range(virtual))


def in_flight(sched: Schedule, rank: int, pp: int, microbatches: int, virtual: int) -> int:
    """Stage-micro-batches of activations pp rank `rank` holds at its peak (one unit: one micro-batch's activations
    of one of its stages). From the schedules' warm-up counts in torch.distributed.pipelining (and the papers above):
    GPipe holds every micro-batch of its stage; 1F1B warms up pp - rank - 1 forwards and holds one more; interleaved
    warms up (v - 1) pp + 2 (pp - rank - 1) stage-forwards (a round of m // max(1, m // pp) for pp when pp does not
    divide m); ZB-V holds 1F1B's activation memory (2 pp half-stage units on every rank, arXiv 2401.10241 section
    6) when m >= 2 pp - 1, fewer otherwise (zbv_held)."""
    m, v = microbatches, virtual
    if sched is Schedule.GPIPE:
        return m
    if sched is Schedule.ONE_F_ONE_B:
        return min(pp - rank, m)
    if sched is Schedule.INTERLEAVED_1F1B:
        # torch runs the micro-batches in max(1, m // pp) rounds: a round (m // rounds, pp when pp divides m) per
        # local stage in the warm-up (_get_warmup_ops)
        per_round = m // max(1, m // pp)
        return min((v - 1) * per_round + 2 * (pp - rank - 1) + 1, m * v)
    return sum(zbv_held(rank, pp, m))


def zbv_held(rank: int, pp: int, microbatches: int) -> tuple[int, int]:
    """Micro-batches of its two stages (rank, 2 pp - 1 - rank) a ZB-V rank holds at its peak, from torch's
    ScheduleZBVZeroBubble: 2 (pp - rank) - 1 forwards of the first stage, then rank of each, then the second stage's
    forward-backward pairs (held: one of them at a time), then a first-stage forward before its first backward; each
    count capped by the micro-batches. 2 pp in all when m >= 2 pp - 1 (arXiv 2401.10241 section 6)."""
    m = microbatches
    pairs = (min(2 * pp - rank - 1, m), min(rank + 1, m))  # during the second stage's first forward-backward pair
    stable = (min(2 * pp - rank, m), min(rank, m))  # at the first stage's first backward
    return stable if sum(stable) >= sum(pairs) else pairs


def bubble_fraction(sched: Schedule, pp: int, microbatches: int, virtual: int) -> float:
    """Idle time of the pipeline over its ideal compute time, with forward, input-gradient and weight-gradient times
    equal: GPipe and 1F1B (p - 1) / m, interleaved (p - 1) / (v m) (arXiv 2104.04473 eq. 1 and section 2.2.1); ZB-V
    0 when F = B = W (arXiv 2401.10241 table; its bubble is (p - 1)(T_F + T_B - 2 T_W) otherwise: the cost model
    prices that with its own times)."""
    if pp == 1:
        return 0.0
    if sched is Schedule.INTERLEAVED_1F1B:
        return (pp - 1) / (virtual * microbatches)
    if sched is Schedule.ZBV:
        return 0.0
    return (pp - 1) / microbatches
