"""Pipeline parallelism: the model cut into stages by layers, run by torch.distributed.pipelining's schedules.

The design is torchtitan's (torchtitan/distributed/pipeline_parallel.py: `pipeline_llm`, `pipeline_module_split`,
`build_pipeline_schedule`), on Hugging Face models:

- The split: `llmctl.spec.pipeline.split_layers(num_layers, setup.pipeline_stages)` says which decoder layers each
  stage holds (the embedding and the final norm + LM head count as one layer each) and `stages_of_rank` which stages
  this pp rank runs (loop placement for interleaved 1F1B, the V for ZB-V). Nothing is re-derived here.
- A stage module is a copy of the whole (meta-device) causal LM with what the stage does not run removed: the decoder
  layers of other stages replaced by `Absent` (no parameters; it hands its input on), the token embedding dropped
  after the first stage, the final norm made an identity and the LM head dropped before the last stage. torchtitan
  deletes layers from a ModuleDict for the same reason: every parameter keeps the unsplit model's name, so a stage's
  state dict is a slice of the unsplit model's (DCP checkpoints move between pp degrees, export is unchanged, and
  random init draws the same values: llmctl.engine.materialize seeds by parameter name).
- A stage's forward (installed on the instance) runs the family's own base-model forward: the first stage from the
  token ids, a later one from the previous stage's hidden states given as `inputs_embeds` (the base model then builds
  its positions, causal mask and rotary tables as it always does; the `Absent` layers keep each real layer's index,
  so per-layer attention types stay right). The last stage returns the logits. Families whose base forward changes
  `inputs_embeds` (Gemma's embedding scale, GPT-2's learned positions) declare `Family.pipeline_unsupported`, and tied
  embeddings are refused (model rule "pp split").
- Per stage, the engine's fixed order: activation checkpointing -> compile -> FSDP2, FSDP not resharding after forward
  (torchtitan under PP: each micro-batch's backward would gather the parameters again). The stage's gradients
  accumulate unsharded over a schedule run and are reduce-scattered once at its end (PipelineStage's
  perform_reduce_grad).
- The loss is the engine's whole loss (fp32 cross-entropy over the real vocabulary) on the last stage. Each
  micro-batch's loss is divided by grad_accum_steps before backward, as the data-parallel path does, with the
  schedule's own scaling off (scale_grads=False): a step of grad_accum_steps / pipeline_microbatches schedule runs
  then gives the data-parallel run's gradients at the same global batch.
- The gradient norm for clipping is each rank's stages' norm (whole over its data-parallel mesh), squared and summed
  over the pp group (`Pipeline.total_norm`, GradStep's `across`); fp16's loss scale multiplies the last stage's loss.
- Context parallelism: a run's micro-batches go through the sequence split together (llmctl.engine.context_parallel:
  the ring on for the whole schedule run, this rank's part of each sequence and its positions given to every stage).
- Tensor parallelism: the whole meta model is split over tp with its family's plan first (torchtitan's order: TP,
  then AC, compile, FSDP), then cut; a stage hands on the whole sequence (its blocks' sequence-parallel output
  all-gathered, as the embedding's output is at pp 1) and the next stage's first block cuts it again (`_tp_boundaries`);
  the last stage returns its vocabulary shard of the logits and the loss runs on the shards inside loss_parallel().
  Sending the whole sequence costs tp times torchtitan's sequence-sharded sends, and keeps the family's own base
  forward (positions, masks, rotary tables) unchanged.
- Evaluation runs the schedule forward only (`Pipeline.evaluate`), the last stage's ranks summing and counting.
- Checkpoints: the model's and AdamW's state dicts are those of the unsplit model (`StageParts.state_dicts`), the
  optimizer's param_groups listing the unsplit model's parameter names on every rank, so a pp 2 checkpoint loads at
  pp 1 and back. The schedule's micro-batch limits (1F1B: at least pp per run; interleaved: rounds that divide them)
  are the engine rule "pp schedule microbatches".

Sources: torchtitan/distributed/pipeline_parallel.py (split, stage building, schedule choice, reshard_after_forward
under PP), torch/distributed/pipelining/{stage,schedules}.py (torch 2.13: PipelineStage's dynamic metadata inference,
the FSDP handling in backward_maybe_with_nosync / perform_reduce_grad, each schedule's n_microbatches checks).
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmctl.engine.context_parallel import whole
from llmctl.engine.loss import local_value, vocab_shards_loss
from llmctl.errors import SpecError
from llmctl.families.modules import decoder_layers
from llmctl.spec.pipeline import split_layers, stages_of_rank

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from llmctl.engine.data import Batch
    from llmctl.spec.setup import TrainSetup


def _absent_class():  # -> type[torch.nn.Module]
    import torch

    class Absent(torch.nn.Module):
        """A decoder layer another stage holds: no parameters, its input handed on unchanged."""

        pipeline_absent = True

        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return hidden_states

    return Absent


def _base_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(base model, LM head) of a Hugging Face causal LM."""
    base = getattr(model, "base_model", None)
    if base is model:  # Llama 4's text LM keeps the multimodal prefix ("language_model") but its body in `model`
        base = getattr(model, "model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or head is None or not hasattr(base, "norm"):
        raise SpecError(
            f"pipeline parallelism: cannot find the base model, final norm and LM head of {type(model).__name__}"
        )
    for attr in ("logit_scale", "logits_scaling", "final_logit_softcapping"):
        v = getattr(model.config, attr, None)
        if v:
            raise SpecError(f"pipeline parallelism: {type(model).__name__} transforms its logits ({attr} {v})")
    return base, head


def stage_module(
    full: torch.nn.Module, first_block: int, num_blocks: int, first: bool, last: bool, tp_mesh: Any = None
) -> torch.nn.Module:
    """A copy of the meta-device model `full` holding only one stage (see the module doc), with the stage's forward:
    `forward(x, position_ids=None)`, x the token ids (first stage) or the previous stage's hidden states. `tp_mesh`:
    `full` is tensor-parallel already (llmctl.engine.tensor_parallel); see `_tp_boundaries`."""
    import torch

    model = copy.deepcopy(full)
    absent = _absent_class()
    layers = decoder_layers(model)
    for i in range(len(layers)):
        if not first_block <= i < first_block + num_blocks:
            layers[i] = absent()
    base, head = _base_and_head(model)
    if not first:
        embed = model.get_input_embeddings()
        for name, child in list(base.named_children()):
            if child is embed:
                setattr(base, name, None)
    if not last:
        base.norm = torch.nn.Identity()
        for name, child in list(model.named_children()):
            if child is head:
                setattr(model, name, None)
        head = None
    gather = _tp_boundaries(model, layers, first_block, num_blocks, first, last, tp_mesh)

    def forward(self: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        given = {"input_ids": x} if first else {"inputs_embeds": x}
        hidden = base(**given, position_ids=position_ids, use_cache=False).last_hidden_state
        if head is not None:
            logits = head(hidden)
            return logits.to_local() if hasattr(logits, "to_local") else logits  # vocabulary shards under tp
        return gather(hidden)

    model.forward = types.MethodType(forward, model)
    return model


def _tp_boundaries(
    model: torch.nn.Module, layers: Any, first_block: int, num_blocks: int, first: bool, last: bool, tp_mesh: Any
) -> Any:
    """Tensor parallelism at a stage's edges (sequence parallelism keeps s/tp tokens per rank between layers): a
    stage hands on the whole sequence, as the embedding does at pp 1 (its blocks' output all-gathered), so the next
    stage's base model builds its positions, mask and rotary tables from it; the next stage's first block cuts it
    to this rank's tokens again (layer 0's PrepareModuleInput at pp 1), or, a stage of the norm and head alone, its
    norm does. Returns what the stage applies to its output hidden states."""
    if tp_mesh is None:
        return lambda h: h
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    if not first and num_blocks and first_block > 0:  # layer 0 has it already (llmctl.engine.tensor_parallel)
        cut = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True)
        parallelize_module(layers[first_block], tp_mesh, cut)
    elif not first and last:
        base, _ = _base_and_head(model)

        def own_tokens(module: Any, args: tuple) -> tuple:
            h = DTensor.from_local(args[0], tp_mesh, [Replicate()], run_check=False)
            return (h.redistribute(tp_mesh, [Shard(1)]).to_local(), *args[1:])

        base.norm.register_forward_pre_hook(own_tokens, prepend=True)
    if last or not num_blocks:
        return lambda h: h
    return lambda h: DTensor.from_local(h, tp_mesh, [Shard(1)], run_check=False).full_tensor()


def split_model(full: torch.nn.Module, setup: TrainSetup, pp_rank: int, mesh: Any = None) -> list[tuple[int, Any]]:
    """(stage index, stage module) of each stage pp rank `pp_rank` runs; under tensor parallelism (`mesh` with a tp
    dimension) the whole meta model is split over tp first (its family's plan), then cut."""
    tp_mesh = None
    if setup.dims.tp_enabled:
        from llmctl.engine.tensor_parallel import apply_tp

        tp_mesh = mesh["tp"]
        apply_tp(full, tp_mesh)
    n = len(decoder_layers(full))
    parts = split_layers(n, setup.pipeline_stages)
    mine = stages_of_rank(setup.pp_schedule, pp_rank, setup.pp, setup.virtual_stages)
    return [
        (i, stage_module(full, p.first_block, p.num_blocks, p.embedding, p.head, tp_mesh))
        for i, p in enumerate(parts)
        if i in mine
    ]


def parallelize_stage(part: torch.nn.Module, setup: TrainSetup, mesh: DeviceMesh) -> bool:
    """Activation checkpointing -> compile -> FSDP2 on one stage (llmctl.engine.parallelize's pieces, which skip the
    absent layers), FSDP not resharding after forward. Returns whether FSDP2 was applied."""
    from llmctl.engine.parallelize import (
        apply_activation_checkpointing,
        apply_compile,
        apply_experts,
        apply_fsdp,
        dp_mesh,
        needs_fsdp,
    )

    apply_experts(part, setup, mesh)
    apply_activation_checkpointing(part, setup.checkpointing)
    if setup.compile:
        apply_compile(part)
    dp = dp_mesh(mesh)
    fsdp = needs_fsdp(dp.size(), setup.precision, setup.levers.offload, setup.finetune.adapters)
    if fsdp:
        apply_fsdp(part, dp, setup.precision, setup.levers.offload, reshard_after_forward=False)
    return fsdp


@dataclass
class StageLoss:
    """The schedule's loss function on the last stage: the engine's whole loss of one micro-batch, recorded for the
    step's mean, returned divided by grad_accum_steps (times the loss multiplier) for backward; in evaluation the
    summed loss over the targets that are not -100."""

    vocab: int
    grad_accum_steps: int
    multiplier: float = 1.0
    evaluating: bool = False
    divisors: list[float | None] = field(default_factory=list)
    """Packed data: each micro-batch's loss divisor of the run, in order (None: the mean over its tokens)."""
    recorded: list[Any] = field(default_factory=list)
    tp_mesh: Any = None
    """Tensor parallelism: the last stage's logits are this rank's vocabulary shard (loss_parallel's loss)."""
    counting: bool = False
    """Set while the schedule computes a micro-batch's loss: PipelineStage's metadata inference (the first run)
    also calls the loss function, on uninitialised tensors, and that call must not count."""

    def counted(self, compute: Any) -> Any:
        """The schedule's `_compute_loss` wrapped so that its calls, and only they, count."""

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.counting = True
            try:
                return compute(*args, **kwargs)
            finally:
                self.counting = False

        return wrapped

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:

        if not self.counting:  # metadata inference: the shapes matter, not the value
            return logits.float().sum() * 0.0
        if self.evaluating:
            loss = self._cross_entropy(logits, targets, "sum")
            self.recorded.append(local_value(loss).detach())
            return loss
        acc = self.grad_accum_steps
        div = self.divisors[len(self.recorded)] if self.divisors else None
        loss = self._cross_entropy(logits, targets, "mean" if div is None else "sum")
        if div is not None:
            loss = loss * (acc / div)
        self.recorded.append(local_value(loss).detach())
        return loss * (self.multiplier / acc)

    def _cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        """The engine's loss of one micro-batch: whole (llmctl.engine.loss.whole_loss's), or on the vocabulary
        shards under tensor parallelism (parallel_loss's; the schedule runs inside loss_parallel())."""
        import torch.nn.functional as F

        if self.tp_mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            shards = DTensor.from_local(logits, self.tp_mesh, [Shard(-1)], run_check=False).float()
            return vocab_shards_loss(shards, targets, self.vocab, reduction)
        v = self.vocab
        return F.cross_entropy(logits[..., :v].float().reshape(-1, v), targets.reshape(-1), reduction=reduction)


@dataclass
class Pipeline:
    """This rank's stages and the schedule that runs them."""

    parts: list[torch.nn.Module]
    stage_ids: list[int]
    num_stages: int
    schedule: Any
    loss: StageLoss
    group: Any
    """The pp process group (the gradient norm's sum over stages)."""
    microbatches: int
    """Micro-batches per schedule run (setup.pipeline_microbatches)."""

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    @staticmethod
    def _joined(batches: list[Batch], device: torch.device) -> Batch:
        """One run's micro-batches as one batch (the schedule cuts it into them again, along the rows)."""
        import torch

        from llmctl.engine.data import Batch

        pos = None if batches[0].positions is None else torch.cat([b.positions for b in batches]).to(device)
        return Batch(
            torch.cat([b.inputs for b in batches]).to(device), torch.cat([b.targets for b in batches]).to(device), pos
        )

    def _feed(self, b: Batch) -> tuple[tuple, dict[str, Any]]:
        """The schedule's inputs: the token ids where this rank runs the first stage, the targets where it runs the
        last, the positions (packed data, context parallelism's part of each sequence) to every stage."""
        args = (b.inputs,) if self.has_first else ()
        kwargs: dict[str, Any] = {"target": b.targets} if self.has_last else {}
        if b.positions is not None:
            kwargs["position_ids"] = b.positions
        return args, kwargs

    def _loss_parallel(self) -> Any:
        """loss_parallel() under tensor parallelism (the loss and its backward on the vocabulary shards)."""
        import contextlib

        if self.loss.tp_mesh is None:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def run(self, batches: list[Batch], multiplier: float, device: torch.device, split: Any = whole) -> torch.Tensor:
        """One schedule run (forward and backward of len(batches) micro-batches), inside `split` (context
        parallelism: this rank's part of every sequence, the ring on for the whole run); the sum of their losses on
        a rank that runs the last stage, 0 elsewhere."""
        import torch

        self.loss.multiplier, self.loss.evaluating = multiplier, False
        self.loss.divisors = [b.loss_divisor for b in batches] if batches[0].loss_divisor is not None else []
        self.loss.recorded = []
        with split(self._joined(batches, device)) as part, self._loss_parallel():
            args, kwargs = self._feed(part)
            # return_outputs=False, as torchtitan: else the last stage keeps every micro-batch's logits to the end of
            # the run and concatenates them (b*s*V each), which neither the loss nor the memory model needs.
            self.schedule.step(*args, return_outputs=False, **kwargs)
        return torch.stack(self.loss.recorded).sum() if self.loss.recorded else torch.zeros((), device=device)

    def evaluate(self, batches: list[Batch], device: torch.device, split: Any = whole) -> tuple[torch.Tensor, int]:
        """Forward only: (summed loss, loss tokens) of `batches` (this rank's part of them, inside `split`) on a rank
        that runs the last stage, (0, 0) elsewhere (the tokens counted once per data-parallel rank)."""
        import torch

        from llmctl.engine.data import IGNORE

        self.loss.evaluating, self.loss.divisors, self.loss.recorded = True, [], []
        with split(self._joined(batches, device)) as part, self._loss_parallel():
            args, kwargs = self._feed(part)
            self.schedule.eval(*args, **kwargs)
            tokens = int((part.targets != IGNORE).sum())
        if not self.loss.recorded:
            return torch.zeros((), dtype=torch.float64, device=device), 0
        return torch.stack(self.loss.recorded).sum().double(), tokens

    def total_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The gradient norm over every stage: this rank's stages' norm (already whole over the data-parallel
        mesh) squared, summed over the pp group."""
        import torch.distributed as dist

        sq = norm.float().pow(2).reshape(1).clone()
        dist.all_reduce(sq, group=self.group)
        return sq.sqrt().reshape(())


def build_schedule(pipe_stages: list[Any], setup: TrainSetup, loss: StageLoss) -> Any:
    """The torch schedule class of setup.pp_schedule over this rank's stages, `pipeline_microbatches` per run."""
    from torch.distributed.pipelining import schedules

    sched = setup.pp_schedule
    cls = getattr(schedules, sched.torch_class)
    m = setup.pipeline_microbatches
    first = pipe_stages if sched.looped else pipe_stages[0]
    out = cls(first, n_microbatches=m, loss_fn=loss, scale_grads=False)
    out._compute_loss = loss.counted(out._compute_loss)
    return out


def build_stages(
    parts: list[tuple[int, torch.nn.Module]], setup: TrainSetup, mesh: DeviceMesh, device: torch.device, vocab: int
) -> Pipeline:
    """The PipelineStage of each (parallelized, materialized) part and the schedule over them."""
    from torch.distributed.pipelining import PipelineStage

    group = mesh["pp"].get_group()
    n = setup.pipeline_stages
    stages = [PipelineStage(m, i, n, device, group=group) for i, m in parts]
    loss = StageLoss(vocab, setup.grad_accum_steps, tp_mesh=mesh["tp"] if setup.dims.tp_enabled else None)
    return Pipeline(
        [m for _, m in parts],
        [i for i, _ in parts],
        n,
        build_schedule(stages, setup, loss),
        loss,
        group,
        setup.pipeline_microbatches,
    )


# --- checkpoints: the unsplit model's state dicts --------------------------------------------------------------------
def _parts_module():  # -> type[torch.nn.ModuleList]
    import torch

    class StageParts(torch.nn.ModuleList):
        """This rank's stage modules, as the one `model` the trainer hands the optimizer, the gradient clipping and
        the checkpointer; its state dicts are the unsplit model's (`state_dicts`)."""

        full_groups: list[list[str]]
        """The unsplit model's parameter names in each AdamW group (build_optimizer's: matrices, then vectors), in
        its order: what a pp 1 checkpoint's param_groups list, written the same by every pp rank."""

        def names(self) -> dict[Any, str]:
            from llmctl.engine.materialize import clean_name

            return {p: clean_name(n) for part in self for n, p in part.named_parameters()}

        def state_dicts(self, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
            """(model, optimizer) state dicts shaped as get_state_dict's of the unsplit model: the model's keys the
            stage parts' own (already the unsplit names), the optimizer's `state` by parameter name and its
            `param_groups` with the unsplit model's names. Optimizer states not made yet (a resume before the first
            step) are made first, as get_state_dict does."""
            from torch.distributed.checkpoint.state_dict import _init_optim_state, get_model_state_dict

            _init_optim_state(optimizer)
            model_sd: dict[str, Any] = {}
            for part in self:
                model_sd.update(get_model_state_dict(part))
            names = self.names()
            state = {names[p]: optimizer.state[p] for g in optimizer.param_groups for p in g["params"]}
            groups = [
                {**{k: v for k, v in g.items() if k != "params"}, "params": list(full)}
                for g, full in zip(optimizer.param_groups, self.full_groups, strict=True)
            ]
            return model_sd, {"state": state, "param_groups": groups}

        def load_state_dicts(
            self, optimizer: torch.optim.Optimizer, model_sd: dict[str, Any], optim_sd: dict[str, Any]
        ) -> None:
            """After DCP loaded in place into `state_dicts`' tensors: the parts' parameters set (their own keys),
            the groups' hyperparameters (lr, initial_lr, ...) taken from the checkpoint."""
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

            for part in self:
                own = {k: model_sd[k] for k in get_model_state_dict(part)}
                set_model_state_dict(part, own)
            for g, saved in zip(optimizer.param_groups, optim_sd["param_groups"], strict=True):
                g.update({k: v for k, v in saved.items() if k != "params"})

    return StageParts


def stage_parts(parts: list[torch.nn.Module], full: torch.nn.Module) -> torch.nn.ModuleList:
    """The StageParts of `parts`, with the unsplit meta model `full`'s optimizer groups (build_optimizer's split:
    matrices decay, vectors do not)."""
    from llmctl.engine.materialize import clean_name

    out = _parts_module()(parts)
    trained = [(clean_name(n), p) for n, p in full.named_parameters() if p.requires_grad]
    out.full_groups = [[n for n, p in trained if p.ndim >= 2], [n for n, p in trained if p.ndim < 2]]
    return out
