"""Pipeline parallelism's memory per pp rank (llmctl.plan.memory.pipeline): each rank's parameters and states against
an independent count on a model split on the meta device, the micro-batches in flight per schedule, and the saved
activations of each stage of a tiny model measured on the CPU (llmctl.measure.saved)."""

import math

import pytest

from llmctl.plan import memory as mem
from llmctl.plan.memory import pipeline as pl
from llmctl.plan.memory.estimate import PP_INPUT_GRADS, PP_RECV_BUFFERS, PP_STAGE_OUTPUTS
from llmctl.spec import models
from llmctl.spec.pipeline import Schedule, in_flight, split_layers, stages_of_rank
from llmctl.spec.setup import TrainSetup

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")

from llmctl.measure.saved import SavedBytes  # noqa: E402

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "num_hidden_layers": 8,
    "tie_word_embeddings": False,
}


def build(cfg: dict, device: str = "meta", dtype=torch.float32):
    cfg = dict(cfg)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype)


def stage_modules(model, stages: int) -> list[list]:
    """The modules of each stage of torchtitan's split: the embedding on the first, the blocks, norm + LM head on the
    last (a tied LM head is the embedding's matrix again: the last stage counts it as its own copy)."""
    out = []
    for part in split_layers(model.config.num_hidden_layers, stages):
        mods = [model.model.embed_tokens] if part.embedding else []
        mods += [model.model.layers[i] for i in part.blocks]
        mods += [model.model.norm, model.lm_head] if part.head else []
        out.append(mods)
    return out


def counted(modules: list, tp: int) -> int:
    """Parameters of a stage's modules on one tp rank, counted on the modules: norms whole, the rest / tp."""
    total = 0
    for mod in modules:
        for name, p in mod.named_parameters():
            total += p.numel() if "norm" in name or p.dim() == 1 else p.numel() // tp
    return total


def rank_counts(model, sched: Schedule, pp: int, v: int, tp: int) -> list[int]:
    mods = stage_modules(model, pp * v)
    return [sum(counted(mods[i], tp) for i in stages_of_rank(sched, r, pp, v)) for r in range(pp)]


@pytest.mark.parametrize(
    "cfg,sched,pp,tp",
    [
        (TINY, Schedule.ONE_F_ONE_B, 4, 1),  # 8 blocks + 2 over 4 stages: 3, 3, 2, 2 "layers": uneven
        (TINY, Schedule.ONE_F_ONE_B, 3, 2),
        (TINY, Schedule.INTERLEAVED_1F1B, 2, 1),
        (TINY, Schedule.ZBV, 2, 2),
        ({**TINY, "tie_word_embeddings": True}, Schedule.ONE_F_ONE_B, 4, 1),
    ],
    ids=["8-over-4", "8-over-3-tp2", "interleaved", "zbv-tp2", "tied"],
)
def test_rank_states_equal_a_split_model(cfg, sched, pp, tp):
    """Each pp rank's parameters, and its fp32 master + gradients + AdamW states (16 bytes per parameter, FSDP2),
    equal the count of the modules its stages hold: ratio 1.00 on every rank, the heaviest included."""
    model = build(cfg)
    spec = models.from_hf_config(cfg, name="tiny")
    setup = TrainSetup(gpus_per_node=pp * tp * 2, tp=tp, pp=pp, pp_schedule=sched, grad_accum_steps=8, attention="sdpa")
    expected = rank_counts(model, sched, pp, setup.virtual_stages, tp)
    ranks = pl.pipeline_ranks(spec, setup)
    assert [pl.rank_params(spec, setup, r) for r in ranks] == expected
    for est, count in zip(mem.pipeline_rank_estimates(spec, setup), expected):
        assert est.model_state_bytes == math.ceil(count * 4 / 2) * 2 + math.ceil(count * 8 / 2)  # fsdp 2
    heaviest = mem.estimate(spec, setup)
    assert mem.stage_params(spec, setup)[0] == max(expected)
    assert heaviest.device_bytes == max(s.device_bytes for s in heaviest.stages)


def test_405b_stages_counted_on_meta():
    """Llama 3.1 405B, 126 blocks: pp 8 (16 blocks a stage but 15 on the first and the last, which hold the embedding
    and the head) and interleaved pp 8 x 2 under tp 8: every rank's parameters equal the split model's (ratio 1.00;
    ceil(126 / 8) = 16 blocks plus an end would over-count the ends' ranks, and an even split of the blocks
    under-counts the middle ones)."""
    entry = models.preset_entry("llama-3.1-405b")
    model = build(entry["config"])
    spec = models.from_preset("llama-3.1-405b")
    for sched in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B):
        setup = TrainSetup(nodes=64, gpus_per_node=8, tp=8, pp=8, pp_schedule=sched, seq_len=8192, attention="sdpa")
        expected = rank_counts(model, sched, 8, setup.virtual_stages, 8)
        got = [pl.rank_params(spec, setup, r) for r in pl.pipeline_ranks(spec, setup)]
        assert [g / e for g, e in zip(got, expected)] == [1.0] * 8
    assert got == [6_240_043_008] + [6_375_866_368] * 6 + [6_240_059_392]


@pytest.mark.parametrize(
    "sched,m,expected",
    [
        (Schedule.GPIPE, 8, [(8,)] * 4),
        (Schedule.ONE_F_ONE_B, 8, [(4,), (3,), (2,), (1,)]),
        (Schedule.ONE_F_ONE_B, 4, [(4,), (3,), (2,), (1,)]),
        (Schedule.GPIPE, 2, [(2,)] * 4),
        # (v - 1) pp + 2 (pp - r - 1) + 1 = 11, 9, 7, 5 forwards before the first backward, 4 (m // (m // pp)) a round
        # per local stage: rank 0 runs 4 of stage 0, 4 of stage 4, 3 of stage 0 again
        (Schedule.INTERLEAVED_1F1B, 8, [(7, 4), (5, 4), (4, 3), (4, 1)]),
        (Schedule.INTERLEAVED_1F1B, 1, [(1, 1)] * 4),
        # ZB-V: 2 pp in all, 2 pp - r of the rank's first stage (r) and r of its second (2 pp - 1 - r)
        (Schedule.ZBV, 8, [(8, 0), (7, 1), (6, 2), (5, 3)]),
    ],
)
def test_micro_batches_in_flight_per_stage(sched, m, expected):
    """How many micro-batches of each of its stages a rank holds at its peak (pp 4, 8 blocks)."""
    spec = models.from_hf_config(TINY, name="tiny")
    setup = TrainSetup(gpus_per_node=4, pp=4, pp_schedule=sched, grad_accum_steps=m, attention="sdpa")
    ranks = pl.pipeline_ranks(spec, setup)
    assert [tuple(h.micro_batches for h in r.held) for r in ranks] == expected
    assert [r.in_flight for r in ranks] == [in_flight(sched, r, 4, m, setup.virtual_stages) for r in range(4)]


def test_in_flight_scales_the_activations():
    """1F1B: rank r keeps pp - r micro-batches of its stage: with equal stages, the activations line is in the same
    ratio (stage 0 and the last differ by their ends only)."""
    spec = models.from_hf_config({**TINY, "num_hidden_layers": 14}, name="tiny")  # 16 "layers": 4 per stage
    setup = TrainSetup(gpus_per_node=4, pp=4, grad_accum_steps=8, attention="sdpa", seq_len=128)
    acts = [
        next(c.bytes for c in e.components if c.name.startswith("activations ("))
        for e in mem.pipeline_rank_estimates(spec, setup)
    ]
    assert acts[1] * 2 == acts[2] * 3  # 3 and 2 micro-batches of 4 blocks each


def test_p2p_buffers_follow_torch_pipelining():
    """torch's PipelineStage: a receive buffer per micro-batch for each stage but the first (activations) and each
    but the last (gradients), b x s/cp x h/tp in the compute dtype; the received inputs' gradients until the next
    step; each in-flight forward's output until its backward."""
    spec = models.from_preset("llama-3.1-8b")
    setup = TrainSetup(gpus_per_node=8, tp=2, pp=4, grad_accum_steps=8, seq_len=4096, attention="sdpa")
    boundary = 2 * 1 * (4096 // 2) * 4096
    assert pl.boundary_bytes(setup, spec.hidden_size) == boundary
    ests = mem.pipeline_rank_estimates(spec, setup)

    def line(e, name):
        return next((c.bytes for c in e.components if c.name == name), 0)

    assert [line(e, PP_RECV_BUFFERS) for e in ests] == [
        8 * boundary,
        16 * boundary,
        16 * boundary,
        8 * boundary,
    ]
    assert [line(e, PP_INPUT_GRADS) for e in ests] == [0, 8 * boundary, 8 * boundary, 8 * boundary]
    assert [line(e, PP_STAGE_OUTPUTS) for e in ests] == [4 * boundary, 3 * boundary, 2 * boundary, 0]


def stage_forward(model, part, ids, boundary):
    """One micro-batch through one stage of the model, as a PipelineStage runs it: the token ids (first stage) or the
    received activation (a leaf), the stage's blocks with the position embeddings its forward builds, and the norm,
    head and loss on the last. Returns the output (keeps the graph alive)."""
    inner = model.model
    x = inner.embed_tokens(ids) if part.embedding else boundary
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    cos_sin = inner.rotary_emb(x, pos)
    for i in part.blocks:
        x = inner.layers[i](x, attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
        x = x[0] if isinstance(x, tuple) else x
    if part.head:
        logits = model.lm_head(inner.norm(x))
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    return x


@pytest.mark.parametrize("pp", [2, 4])
def test_stage_activations_match_measurement(pp):
    """Each stage's saved activations for one micro-batch, measured on the CPU in bf16 with the saved-tensor harness,
    within 3% of the estimate's lines over its micro-batches in flight (1F1B, pp micro-batches a run: rank r holds
    pp - r): its blocks', its rotary tables, the ids on the first, the LM head's input and the loss's log-softmax on
    the last."""
    b, s = 2, 128
    model = build(TINY, device="cpu", dtype=torch.bfloat16)
    model.train()
    spec = models.from_hf_config(TINY, name="tiny")
    setup = TrainSetup(
        gpus_per_node=pp,
        pp=pp,
        grad_accum_steps=pp,
        seq_len=s,
        micro_batch_size=b,
        attention="sdpa",
        precision="bf16-mixed",
    )
    ids = torch.randint(0, TINY["vocab_size"], (b, s))
    keep = ("activations (", "input ids", "final norm + LM-head input", "loss log-softmax")
    ranks = pl.pipeline_ranks(spec, setup)
    for prank, est in zip(ranks, mem.pipeline_rank_estimates(spec, setup)):
        (held,) = prank.held
        assert held.micro_batches == pp - prank.rank
        received = torch.randn(b, s, TINY["hidden_size"], dtype=torch.bfloat16, requires_grad=True)
        with SavedBytes([*model.parameters(), received, ids]) as saved:
            out = stage_forward(model, held.part, ids, received)
        assert out.requires_grad
        lines = sum(c.bytes for c in est.components if c.name.startswith(keep))
        assert lines % held.micro_batches == 0
        predicted = lines // held.micro_batches
        assert predicted == pytest.approx(saved.total(), rel=0.03), (held.part, predicted, saved.total())


SPLITS = [
    (layers, sched, v, pp)
    for layers in (1, 2, 5, 8, 13, 32)
    for sched, v in ((Schedule.ONE_F_ONE_B, 1), (Schedule.INTERLEAVED_1F1B, 2), (Schedule.INTERLEAVED_1F1B, 3))
    for pp in (2, 4, 8)
    if pp * v <= layers + 2
]


@pytest.mark.parametrize("layers,sched,v,pp", SPLITS)
def test_ranks_hold_the_model_once(layers, sched, v, pp):
    """Whatever the split, the pp ranks together hold every parameter once (untied, tp 1), every block on one rank."""
    spec = models.from_hf_config({**TINY, "num_hidden_layers": layers}, name="tiny")
    setup = TrainSetup(
        gpus_per_node=pp, pp=pp, pp_schedule=sched, pp_virtual_stages=v if sched.looped else None, grad_accum_steps=pp
    )
    ranks = pl.pipeline_ranks(spec, setup)
    assert sum(pl.rank_params(spec, setup, r) for r in ranks) == spec.params
    assert sorted(i for r in ranks for i in r.blocks) == list(range(layers))


def test_interleaved_in_flight_is_torchs_warm_up():
    """in_flight for interleaved 1F1B is torch's own warm-up (ScheduleInterleaved1F1B: _get_warmup_ops with its rounds
    of micro-batches) plus the steady state's first forward, capped at every forward of the run; also when pp does
    not divide the micro-batches (rounds of m // max(1, m // pp))."""
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    for pp in (2, 4, 8):
        for m in range(1, 3 * pp + 1):
            rounds = max(1, m // pp)
            if m % rounds:
                continue  # torch refuses these
            for v in (2, 3):
                for r in range(pp):
                    warm = _get_warmup_ops(r, v, m // rounds, pp, m, multiply_factor=2)
                    assert in_flight(Schedule.INTERLEAVED_1F1B, r, pp, m, v) == min(warm + 1, m * v), (pp, m, v, r)


def torch_peak(sched: Schedule, rank: int, pp: int, m: int, v: int) -> tuple[int, list[tuple[int, ...]]]:
    """The most stage-micro-batches `rank` holds over torch's own action list for the schedule (its
    `_calculate_single_rank_operations`; a forward adds one of its stage, a full or weight backward frees it), and the
    per-stage counts at every moment it holds that many."""
    from torch.distributed.pipelining import schedules as ts

    cls = {Schedule.INTERLEAVED_1F1B: ts.ScheduleInterleaved1F1B, Schedule.ZBV: ts.ScheduleZBVZeroBubble}[sched]
    sch = object.__new__(cls)  # the action list needs only these, not the stages and process groups
    sch.pp_group_size, sch._n_microbatches, sch.n_local_stages, sch.num_stages = pp, m, v, pp * v
    sch.number_of_rounds = max(1, m // pp)
    sch.microbatches_per_round = m // sch.number_of_rounds
    own = stages_of_rank(sched, rank, pp, v)
    held, best, at = dict.fromkeys(own, 0), -1, []
    for a in sch._calculate_single_rank_operations(rank):
        if a is None or a.microbatch_index >= m or a.computation_type.value not in ("F", "B", "W"):
            continue
        held[a.stage_index] += 1 if a.computation_type.value == "F" else -1
        now = tuple(held[s] for s in own)
        if sum(now) > best:
            best, at = sum(now), [now]
        elif sum(now) == best:
            at.append(now)
    return best, at


@pytest.mark.parametrize(
    "sched,v", [(Schedule.INTERLEAVED_1F1B, 2), (Schedule.INTERLEAVED_1F1B, 3), (Schedule.ZBV, 2)], ids=str
)
@pytest.mark.parametrize("pp,m", [(2, 8), (4, 4), (4, 6), (4, 8), (4, 16), (8, 8), (8, 16)])
def test_in_flight_follows_torchs_action_lists(sched, v, pp, m):
    """The in-flight count and how it falls on the rank's stages equal the peak over torch's own schedule, every
    rank, also with fewer micro-batches than ZB-V's 2 pp - 1."""
    if sched is Schedule.INTERLEAVED_1F1B and m % max(1, m // pp):
        pytest.skip("torch refuses it")
    for r in range(pp):
        best, at = torch_peak(sched, r, pp, m, v)
        k = in_flight(sched, r, pp, m, v)
        assert k == best
        assert pl.held_micro_batches(sched, pp, m, v, k, r) in at


def test_fsdp2_under_pipelining_keeps_whole_fp32_gradients_and_parameters():
    """What the estimate's two largest pp lines stand on (PIPELINE_NOTE), run on torch itself (gloo, one rank): inside a
    schedule run every FSDP2 unit keeps its parameters unsharded and its gradients accumulated whole in the reduce
    dtype (fp32) until the schedule's reduce-scatter (PipelineStage.perform_reduce_grad)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = init_device_mesh("cpu", (1,))
        for layer in model:
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        stage = PipelineStage(model, 0, 1, torch.device("cpu"), group=dist.group.WORLD)
        seen: dict = {}
        reduce = stage.perform_reduce_grad

        def before_reduce(*args, **kwargs):
            groups = [g for s in fully_shard.state(model)._state_ctx.all_states for g in s._fsdp_param_groups]
            seen["unsharded"] = [g.is_unsharded for g in groups]
            seen["grads"] = [
                (p.unsharded_accumulated_grad.dtype, p.unsharded_accumulated_grad.numel())
                for g in groups
                for p in g.fsdp_params
            ]
            return reduce(*args, **kwargs)

        stage.perform_reduce_grad = before_reduce
        loss = lambda y, t: ((y.float() - t) ** 2).mean()  # noqa: E731
        ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss).step(torch.randn(4, 64), target=torch.randn(4, 64))
    finally:
        dist.destroy_process_group()
    assert seen["unsharded"] == [True] * 3
    assert seen["grads"] == [(torch.float32, 64 * 64), (torch.float32, 64)] * 3
