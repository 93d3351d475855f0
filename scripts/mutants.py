"""A repeatable mutation check of llmctl's core (`make mutants`; not part of `make test`).

Each mutant is one realistic slip in one line of the core: the byte ledger, activations, FLOPs, the collectives' bus
factors, the planner's search, the memory phases, accumulation, the LR schedule, loss scaling, checkpoint retention,
data framing, export, the live check, tune's ranking, and (issue 51) the newer parallelism, precision and launch code:
context parallelism's sequence split, float8's conversion and prices, pipeline stages, heartbeats and the watchdog,
and every module of launch/ (the sbatch renderer, submitit, each preflight module, the dry start, job folders, the
job index, shared file systems, the SLURM options and per-node resources), at least two each.
Mutants of multi-rank code run against single-process tests where one can see the slip (torch's fake process group
for the split, a recorded all-reduce for the pp norm), so they take seconds. For each, the script copies the tracked
tree once into a scratch folder, applies the mutant there (never in the working tree), runs only the tests that cover
that code, and counts the mutant killed when they fail. It prints every mutant's verdict, the kill rate and the
survivors, and exits 1 when a survivor is not a known equivalent mutant (KNOWN_EQUIVALENT, each with why).

    .venv/bin/python scripts/mutants.py [--only ID,ID] [--dir SCRATCH]

A mutant whose `old` text is no longer found exactly once in its file is an error (the code moved): the list is kept
in step with the code, as a test is.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    id: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str


M = Mutant
MUTANTS: tuple[Mutant, ...] = (
    # --- FLOPs and the collectives (torch-free math) ---------------------------------------------------------------
    M(
        "flops-6n",
        "llmctl/plan/flops.py",
        "return 6 * matmul_params(spec) + attention_flops_per_token(spec, seq_len)",
        "return 4 * matmul_params(spec) + attention_flops_per_token(spec, seq_len)",
        ("tests/plan/test_planner.py", "tests/engine/test_selection.py"),
        "model FLOPs 4N instead of 6N",
    ),
    M(
        "flops-attention",
        "llmctl/plan/flops.py",
        "total += n * 6 * at.num_heads * at.span(seq_len) * (at.head_dim + at.v_head_dim)",
        "total += n * 3 * at.num_heads * at.span(seq_len) * (at.head_dim + at.v_head_dim)",
        ("tests/plan/test_planner.py", "tests/plan/test_cp_cost.py"),
        "attention FLOPs halved",
    ),
    M(
        "cp-imbalance",
        "llmctl/spec/parallel.py",
        "return (2 * self.cp - 1) / self.cp",
        "return 1.0",
        ("tests/plan/test_cp_cost.py",),
        "no load imbalance without the head-tail split",
    ),
    M(
        "busbw-allgather",
        "llmctl/spec/collectives.py",
        "    return (n - 1) / n\n",
        "    return 1.0\n",
        ("tests/plan/test_comm.py", "tests/netbench/test_netbench_report.py"),
        "all-gather bus factor 1 instead of (n-1)/n",
    ),
    M(
        "busbw-allreduce",
        "llmctl/spec/collectives.py",
        "return 2 * (n - 1) / n",
        "return (n - 1) / n",
        ("tests/plan/test_comm.py", "tests/netbench/test_netbench_report.py"),
        "all-reduce bus factor (n-1)/n instead of 2(n-1)/n",
    ),
    M(
        "busbw-alltoall",
        "llmctl/spec/collectives.py",
        "return 1 - 1 / n",
        "return 1.0",
        ("tests/netbench/test_alltoall_price.py",),
        "all-to-all bus factor 1: the chunk a rank keeps counted as crossing a link",
    ),
    M(
        "alltoall-off-node",
        "llmctl/plan/network.py",
        "nic_s = bytes_per_rank * (ep - in_node) / ep / (nic_bw * 1e9)",
        "nic_s = bytes_per_rank * (ep - 1) / ep / (nic_bw * 1e9)",
        ("tests/netbench/test_alltoall_price.py",),
        "an ep group over nodes sends its node-mates' chunks through the NICs too",
    ),
    M(
        "overlap",
        "llmctl/plan/comm.py",
        "return comm_s - overlap * min(comm_s, window_s)",
        "return comm_s - overlap * max(comm_s, window_s)",
        ("tests/plan/test_comm.py",),
        "more communication hidden than the compute window",
    ),
    M(
        "ep-efsdp-local",
        "llmctl/plan/comm.py",
        "local = shape.expert_params / dims.ep / M  # one MoE layer's local experts",
        "local = shape.expert_params / M  # one MoE layer's local experts",
        ("tests/plan/test_ep_cost.py",),
        "the efsdp group's all-gather and reduce-scatter moving all E experts of a layer, not the rank's E/ep",
    ),
    M(
        "ep-recompute-alltoall",
        "llmctl/plan/experts.py",
        "return ALLTOALLS_PER_LAYER * len(moe), ALLTOALLS_RECOMPUTED * again",
        "return ALLTOALLS_PER_LAYER * len(moe), 0",
        ("tests/plan/test_ep_cost.py",),
        "a block that checkpointing re-runs priced without its dispatch and combine all-to-alls again",
    ),
    M(
        "ep-grouped-gemm-width",
        "llmctl/plan/experts.py",
        "return [(rows, hidden, 2 * m.intermediate_size), (rows, m.intermediate_size, hidden)]",
        "return [(rows, hidden, m.intermediate_size), (rows, m.intermediate_size, hidden)]",
        ("tests/plan/test_ep_cost.py",),
        "the gate_up grouped GEMM priced at the width of one projection (gate and up are one fused weight)",
    ),
    # --- expert parallelism (engine) ------------------------------------------------------------------------------
    M(
        "ep-order-back",
        "llmctl/engine/experts.py",
        "back = back[torch.argsort(order)].view(tokens, k, hidden)",
        "back = back[order].view(tokens, k, hidden)",
        ("tests/engine/test_expert_dispatch.py",),
        "the combined rows put back in the sorted order's place instead of its inverse",
    ),
    M(
        "ep-regroup-back",
        "llmctl/engine/experts.py",
        "out = out[torch.argsort(by_expert)]",
        "out = out[by_expert]",
        # equivalent in one process (one source rank: the rows arrive sorted by expert); slow: a 4-rank launch
        ("tests/engine/test_tp_resume.py",),
        "the local experts' output not returned to the (source rank, expert) order the combine sends back",
    ),
    M(
        "ep-empty-cut",
        "llmctl/engine/experts.py",
        "x = torch.cat([x, x.new_zeros((1, x.shape[1]))])",
        "x = x.new_zeros((1, x.shape[1]))",
        ("tests/engine/test_expert_dispatch.py",),
        "a rank that received no rows cuts the graph: its peers wait in the dispatch's backward all-to-all forever",
    ),
    M(
        "ep-grad-scale",
        "llmctl/engine/experts.py",
        "            return grad * scale",
        "            return grad",
        ("tests/engine/test_expert_dispatch.py",),
        "the experts' gradient not divided by ep (FSDP2 divides by its own efsdp group only)",
    ),
    M(
        "ep-recompute-count",
        "llmctl/engine/experts.py",
        "if torch._C._current_graph_task_id() != -1:",
        "if torch._C._current_graph_task_id() == -2:",
        ("tests/engine/test_expert_load.py",),
        "tokens per expert counted again in activation checkpointing's recompute",
    ),
    # --- memory -------------------------------------------------------------------------------------------------------
    M(
        "ep-gathered-experts",
        "llmctl/plan/memory/experts.py",
        "local = routed / setup.ep * ((1 - 1 / efsdp) if efsdp > 1 else 1.0)",
        "local = routed * ((1 - 1 / efsdp) if efsdp > 1 else 1.0)",
        ("tests/plan/test_ep_memory.py",),
        "FSDP's all-gather at ep > 1 unshards all E experts of a layer, not the rank's E/ep",
    ),
    M(
        "ep-received-rows",
        "llmctl/plan/memory/experts.py",
        "_, received = dispatch_rows(tokens, k, ep, IMBALANCE)",
        "received, _ = dispatch_rows(tokens, k, ep, IMBALANCE)",
        ("tests/plan/test_ep_memory.py",),
        "the grouped GEMM's saved rows counted as the rows a rank sends away ((ep - 1)/ep), not those it receives",
    ),
    M(
        "loss-buffers",
        "llmctl/plan/memory/estimate.py",
        "        # Backward through the loss: fp32 grad of the log-softmax and of the logits (2 x 4*b*s*V) live at once.\n"
        '        Component("loss backward buffers", 8 * bsv, ("loss_backward",)),',
        "        # Backward through the loss: fp32 grad of the log-softmax and of the logits (2 x 4*b*s*V) live at once.\n"
        '        Component("loss backward buffers", 4 * bsv, ("loss_backward",)),',
        (
            "tests/plan/test_memory_golden.py",
            "tests/plan/test_measured_h100.py",
            "tests/plan/test_memory_checkpointing.py",
        ),
        "one fp32 loss gradient instead of two",
    ),
    M(
        "grads-before-backward",
        "llmctl/plan/memory/estimate.py",
        'no_grads = setup.engine == "fsdp2" and setup.grad_accum_steps == 1',
        'no_grads = setup.engine == "fsdp2" and setup.grad_accum_steps >= 1',
        ("tests/plan/test_measured_h100.py",),
        "gradients dropped from the forward with accumulation too",
    ),
    M(
        "memory-key",
        "llmctl/plan/memory/estimate.py",
        "return replace(setup, grad_accum_steps=min(setup.grad_accum_steps, 2), compile=False, async_tp=False)",
        "return replace(setup, grad_accum_steps=1, compile=False, async_tp=False)",
        ("tests/plan/test_planner_variants.py", "tests/plan/test_plan_run.py"),
        "the planner's memory cache ignores accumulation",
    ),
    M(
        "headroom",
        "llmctl/plan/memory/estimate.py",
        "return int(self.peak_allocated_bytes * self.setup.headroom_fraction)",
        "return int(self.peak_allocated_bytes * self.setup.headroom_fraction / 2)",
        ("tests/plan/test_memory_golden.py", "tests/plan/test_plan_run.py"),
        "half the allocator headroom",
    ),
    M(
        "root-module",
        "llmctl/plan/memory/estimate.py",
        'comps.append(Component(name, int(shard.params(held) * cb), ("forward", "backward")))',
        'comps.append(Component(name, 0, ("forward", "backward")))',
        ("tests/plan/test_measured_h100.py",),
        "FSDP2's unsharded root module not counted",
    ),
    M(
        "requeue-own-limit",
        "llmctl/launch/stalled.py",
        "nodes, why = requeue_without(d, job, usable, restart, restart + 1)",
        "nodes, why = requeue_without(d, job, usable, restart, restart)",
        ("tests/launch/test_requeue_stalled.py",),
        "a requeue the user asked for refused by the job's automatic-requeue limit",
    ),
    M(
        "requeue-leaves-out-the-waiting",
        "llmctl/launch/stalled.py",
        "return sorted({b.node for b in found.behind if b.node}), found.line()",
        "return sorted({b.node for b in found.ahead if b.node}), found.line()",
        ("tests/launch/test_requeue_stalled.py",),
        "the requeue leaves out the healthy waiting ranks' nodes instead of the stuck one's",
    ),
    M(
        "requeue-guesses-at-same-place",
        "llmctl/launch/stalled.py",
        "    if not found.ahead:\n        raise InputError(",
        "    if False:\n        raise InputError(",
        ("tests/launch/test_requeue_stalled.py",),
        "every rank at the same place, and the requeue leaves every node out as if all were stuck",
    ),
    M(
        "head-unit-holds-embeddings",
        "llmctl/plan/memory/estimate.py",
        'name, held = "unsharded final norm + LM head", spec.head_params + max(0, positions)',
        'name, held = "unsharded final norm + LM head", spec.head_params + spec.embedding_params',
        ("tests/engine/test_fsdp_units.py::test_the_memory_model_holds_what_the_units_hold",),
        "untied models still counted with the embeddings held from forward to backward",
    ),
    M(
        "head-unit-reshards",
        "llmctl/engine/parallelize.py",
        "fully_shard(tail, reshard_after_forward=False, **kwargs)",
        "fully_shard(tail, **kwargs)",
        ("tests/engine/test_fsdp_units.py",),
        "the final norm + LM head resharded after forward, gathered again at once for their backward",
    ),
    M(
        "ledger-adamw",
        "llmctl/plan/memory/ledger.py",
        "return 2 * state_bytes  # exp_avg + exp_avg_sq",
        "return state_bytes  # exp_avg + exp_avg_sq",
        ("tests/plan/test_memory_golden.py",),
        "AdamW with one moment in the byte ledger",
    ),
    M(
        "activations-silu",
        "llmctl/plan/memory/activations.py",
        '"mlp: HF silu(gate) kept": ab * sb * i,',
        '"mlp: HF silu(gate) kept": 0,',
        ("tests/plan/test_memory_measured.py",),
        "Hugging Face's kept silu(gate) left out of the saved activations",
    ),
    # --- the planner's search -----------------------------------------------------------------------------------------
    M(
        "pareto-equal",
        "llmctl/plan/search.py",
        "if not mbs or mbs[-1] < largest:",
        "if not mbs or mbs[-1] <= largest:",
        ("tests/plan/test_planner_variants.py",),
        "an option fitting the same micro-batch as a cheaper one is skipped (issue 33's survivor)",
    ),
    M(
        "whole-batch",
        "llmctl/plan/search.py",
        "if most < per_gpu and choice.pp == 1 and self.whole_fits(choice, per_gpu):",
        "if False:",
        ("tests/plan/test_planner_variants.py",),
        "the whole per-rank batch without accumulation never tried",
    ),
    # --- the engine -----------------------------------------------------------------------------------------------------
    M(
        "accumulation",
        "llmctl/engine/trainer.py",
        "(total * (self.grad_step.loss_multiplier * inject / acc)).backward()",
        "(total * (self.grad_step.loss_multiplier * inject)).backward()",
        ("tests/engine/test_dist.py::test_grad_accumulation_equivalence",),
        "accumulated gradients not divided by the micro-batches (issue 33's survivor)",
    ),
    M(
        "resume-step",
        "llmctl/engine/trainer.py",
        'start = int(state["step"])',
        'start = int(state["step"]) + 1',
        ("tests/engine/test_dist.py::test_sigterm_then_restart_is_bit_exact",),
        "a resumed run skips a step",
    ),
    M(
        "warmup",
        "llmctl/engine/optim.py",
        "return (step + 1) / warmup_steps",
        "return step / warmup_steps",
        ("tests/engine/test_selection.py",),
        "warm-up starts at a zero learning rate",
    ),
    M(
        "cosine",
        "llmctl/engine/optim.py",
        "return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))",
        "return min_lr_ratio + (1 - min_lr_ratio) * (1 + math.cos(math.pi * progress))",
        ("tests/engine/test_selection.py",),
        "cosine decay without its 1/2",
    ),
    M(
        "loss-scale-backoff",
        "llmctl/engine/scaler.py",
        "backoff_factor: float = 0.5",
        "backoff_factor: float = 0.25",
        ("tests/engine/test_precision_units.py",),
        "fp16 loss scale quartered on an overflow",
    ),
    M(
        "keep-last",
        "llmctl/engine/checkpoint.py",
        "for _, old in complete_checkpoints(self.root)[: -self.keep_last]:",
        "for _, old in complete_checkpoints(self.root)[: -self.keep_last - 1]:",
        ("tests/engine/test_dist.py::test_sigkill_in_the_middle_of_a_save",),
        "one checkpoint more kept than asked",
    ),
    M(
        "phase-peaks",
        "llmctl/engine/metrics.py",
        '"peak_mem_allocated_bytes": max(int(torch.cuda.max_memory_allocated()), *seen.allocated.values()),',
        '"peak_mem_allocated_bytes": int(torch.cuda.max_memory_allocated()),',
        ("tests/test_gpu_tier_cpu.py",),
        "the run's peak forgotten after the phase resets",
    ),
    M(
        "livecheck-slower",
        "llmctl/engine/livecheck.py",
        "if tps < (1 - slower) * want:",
        "if tps < (1 - 2 * slower) * want:",
        ("tests/engine/test_livecheck.py",),
        "a run 30-60% slower than planned not flagged",
    ),
    M(
        "livecheck-retries",
        "llmctl/engine/livecheck.py",
        'if clues.device == "cuda" and retries:',
        'if clues.device == "cuda" and retries and retries > 10:',
        ("tests/engine/test_livecheck.py",),
        "a few allocator retries not warned",
    ),
    M(
        "export-trim",
        "llmctl/engine/export.py",
        "x = x[: t.shape[0]].clone()",
        "x = x.clone()",
        ("tests/engine/test_export.py",),
        "the padded vocabulary rows exported",
    ),
    M(
        "bounds-negative",
        "llmctl/bounds.py",
        "if abs(value) > limit:",
        "if value > limit:",
        ("tests/cli/test_bounds.py",),
        "a huge negative number let through to the code",
    ),
    M(
        "sbatch-requeue",
        "templates/slurm.sbatch.j2",
        "#SBATCH --requeue\n",
        "",
        ("tests/launch/test_slurm.py::test_sbatch_requeue_resumes_from_checkpoint",),
        "the sbatch script does not ask to be requeued (the test SLURM has JobRequeue=0; needs root: minutes)",
    ),
    # --- data, tune ---------------------------------------------------------------------------------------------------
    M(
        "frame-eos",
        "llmctl/data/prepare.py",
        "tail = (eos,) if eos is not None else ()",
        "tail = ()",
        ("tests/data/test_prepare.py",),
        "documents prepared without their EOS separator",
    ),
    M(
        "tune-retries",
        "llmctl/tune/report.py",
        "return (m.alloc_retries > 0, -m.tokens_per_s, t.number)",
        "return (False, -m.tokens_per_s, t.number)",
        ("tests/tune/test_tune.py",),
        "a trial with allocator retries ranked by its speed alone",
    ),
    M(
        "tune-best",
        "llmctl/tune/report.py",
        "return min(ok, key=measured_order) if ok else None",
        "return max(ok, key=measured_order) if ok else None",
        ("tests/tune/test_tune.py",),
        "the slowest trial chosen",
    ),
    # --- LoRA: frozen base, adapters' init, checkpoints of adapters only, the adapter ledger ---------------------------
    M(
        "lora-base-trains",
        "llmctl/engine/lora.py",
        "train = is_adapter(name)",
        "train = True",
        ("tests/engine/test_lora_units.py",),
        "the base left trainable (gradients and AdamW states for every weight)",
    ),
    M(
        "lora-b-not-zero",
        "llmctl/engine/lora.py",
        'if ".lora_B." in s.name:',
        'if ".lora_B." in s.name and False:',
        ("tests/engine/test_weights_round_trip.py",),
        "B drawn like A: the model no longer starts as its base",
    ),
    M(
        "lora-ckpt-tied-head",
        "llmctl/engine/checkpoint.py",
        "return {k: v for k, v in model_sd.items() if is_adapter(k)}",
        "return model_sd",
        ("tests/engine/test_weights_round_trip.py",),
        "a LoRA checkpoint keeps a tied LM head (GPT-2's lm_head.weight) that ignore_frozen_params lets through",
    ),
    M(
        "lora-ledger-base-grads",
        "llmctl/plan/memory/adapters.py",
        'StateLine(f"gradients ({p.reduce_dtype}, adapters only)", p.reduce_bytes, 2, params=n)',
        'StateLine(f"gradients ({p.reduce_dtype}, adapters only)", p.reduce_bytes, 2)',
        ("tests/plan/test_lora_memory.py",),
        "the estimate gives the frozen base gradients",
    ),
    M(
        "qlora-per-shard",
        "llmctl/engine/qlora.py",
        "part = own_rows(q, rows, first // rows)",
        "part = nf4.to_nf4(full[first : first + rows].contiguous(), BLOCK, local.scaler_block_size)",
        ("tests/engine/test_weights_round_trip.py",),
        "each rank's NF4 piece keeps its own shard's absmax mean, not the whole weight's",
    ),
    M(
        "qlora-view-piece",
        "llmctl/engine/qlora.py",
        "part = own_rows(q, rows, first // rows)",
        "part = list(torch.split(q, rows, dim=0))[first // rows]",
        # the QLoRA dry start alone: the whole file starts with the 70B example's dry start (minutes, GiBs)
        ("tests/engine/test_dry_start.py::test_qlora_holds_what_estimate_memory_says",),
        "each rank keeps a view of the whole NF4 weight (every rank holds all of it)",
    ),
    M(
        "qlora-draw-name",
        "llmctl/engine/qlora.py",
        'names = {id(m): clean_name(n + ".weight") for n, m in model.named_modules()}',
        'names = {id(m): n + ".weight" for n, m in model.named_modules()}',
        ("tests/engine/test_qlora_units.py",),
        "a random NF4 base drawn under peft's base_layer name: not the LoRA base of the same seed",
    ),
    # --- plan --compare: cost, deadline, the count search -----------------------------------------------------------
    M(
        "compare-cost-per-node",
        "llmctl/plan/compare.py",
        "return None if s is None or price is None else self.gpus * s / HOUR * price.usd_per_gpu_hour",
        "return None if s is None or price is None else self.gpus_per_node * s / HOUR * price.usd_per_gpu_hour",
        ("tests/plan/test_compare.py", "tests/plan/test_compare_cli.py"),
        "a row's cost counts one node's GPUs, not all of them",
    ),
    M(
        "compare-deadline-ignored",
        "llmctl/plan/compare.py",
        "return s is not None and (ask.deadline_s is None or s <= ask.deadline_s)",
        "return s is not None",
        ("tests/plan/test_compare.py",),
        "a count that finishes after the deadline counts as meeting it",
    ),
    M(
        "compare-no-climb",
        "llmctl/plan/compare.py",
        "while j < len(counts) and at(j).candidate is not None and score(at(j)) < score(at(best_j)):",
        "while False:",
        ("tests/plan/test_compare.py",),
        "the first count that fits (or meets the deadline) is taken without trying larger, cheaper ones",
    ),
    M(
        "compare-one-regime",
        "llmctl/plan/compare.py",
        "starts = [first_fit(lowest), first_fit(max(lowest, index_at_least(on_gpu) or lowest))]",
        "starts = [first_fit(max(lowest, index_at_least(on_gpu) or lowest))]",
        ("tests/plan/test_compare.py",),
        "without a deadline only the counts that fit without CPU offload are climbed",
    ),
    # --- the step by kind of kernel (issue 32) ------------------------------------------------------------------------
    M(
        "kernel-attn-bwd-factor",
        "llmctl/plan/kernel_time.py",
        "f, b = work / (rf * 1e12), kt.FA_BACKWARD_FLOPS * work / (rb * 1e12)",
        "f, b = work / (rf * 1e12), 2 * work / (rb * 1e12)",
        ("tests/plan/test_kernel_time.py", "tests/plan/test_measured_h100.py"),
        "attention backward counted as 2x forward instead of the FlashAttention papers' 2.5x",
    ),
    M(
        "kernel-sdpa-fa2-on-hopper",
        "llmctl/spec/kernels.py",
        'return "cudnn" if architecture in SDPA_CUDNN_ARCHS else "fa2"',
        'return "fa2"',
        ("tests/spec/test_kernels.py", "tests/plan/test_kernel_time.py", "tests/engine/test_sdpa.py"),
        "SDPA priced at FlashAttention-2 on Hopper, where the profile shows cuDNN's kernel",
    ),
    M(
        "sdpa-torch-default-order",
        "llmctl/engine/sdpa.py",
        "return (priced, *(k for k in ORDER if k != priced))",
        "return ORDER",
        ("tests/engine/test_sdpa.py",),
        "the engine leaves SDPA's order as is instead of putting the priced kernel first",
    ),
    M(
        "fsdp-wraps-adapters-on-one-rank",
        "llmctl/spec/setup.py",
        "return dp_ranks > 1 or offload or (mixed and not adapters)",
        "return dp_ranks > 1 or offload or mixed",
        ("tests/engine/test_one_rank_adapters.py",),
        "LoRA/QLoRA on one rank wrapped in FSDP2 again (its copies, and QLoRA's crash)",
    ),
    M(
        "one-rank-adapters-no-autocast",
        "llmctl/engine/parallelize.py",
        "        apply_autocast(model, s.precision.compute_dtype, mesh.device_type)",
        "        pass",
        ("tests/engine/test_one_rank_adapters.py",),
        "one rank with adapters computes them in fp32 (no autocast): not what FSDP2's policy computed",
    ),
    M(
        "kernel-no-fsdp-copies",
        "llmctl/plan/kernel_time.py",
        "return gathers * per_gather + trained * (cb + rb) + accumulate",
        "return trained * (cb + rb)",
        ("tests/plan/test_kernel_time.py", "tests/plan/test_measured_h100.py"),
        "FSDP2's all-gather copies and gradient sums dropped",
    ),
    M(
        "kernel-memory-bwd-once",
        "llmctl/plan/kernel_time.py",
        "bwd = 2 * (sum(per_layer) + final + EMBED_FWD * h) + LOSS_BWD * spec.vocab_size / setup.tp",
        "bwd = (sum(per_layer) + final + EMBED_FWD * h) + LOSS_BWD * spec.vocab_size / setup.tp",
        ("tests/plan/test_kernel_time.py",),
        "memory-bound backward moves the forward's bytes once instead of twice",
    ),
    M(
        "kernel-gemm-no-overhead",
        "llmctl/spec/kernels.py",
        "return 2.0 * m * k * n / (e * peak_tflops * 1e12) + g.overhead_s",
        "return 2.0 * m * k * n / (e * peak_tflops * 1e12)",
        ("tests/spec/test_kernels.py", "tests/plan/test_kernel_time.py"),
        "small matmuls as fast as large ones (no launch-and-tail time)",
    ),
    # --- packed instruction data: masks, document boundaries, the step's loss normalisation ------------------------
    M(
        "packed-divisor-no-dp",
        "llmctl/engine/data.py",
        "divisor = max(1, self.step_loss_tokens(step)) / self.dp_size",
        "divisor = max(1, self.step_loss_tokens(step))",
        ("tests/engine/test_packed.py",),
        "packed loss divided by the global loss tokens without the dp factor (FSDP2 averages over dp ranks)",
    ),
    M(
        "packed-microbatch-mean",
        "llmctl/engine/data.py",
        "b.loss_divisor = divisor",
        "b.loss_divisor = max(1, int((b.targets != IGNORE).sum())) * self.acc",
        ("tests/engine/test_packed.py",),
        "each micro-batch's own loss-token mean (HF Trainer's 2024 accumulation bug)",
    ),
    M(
        "packed-doc-start-target",
        "llmctl/engine/data.py",
        "counts = ((flags[:, 1:] & LOSS) != 0) & ~starts[:, 1:]",
        "counts = (flags[:, 1:] & LOSS) != 0",
        ("tests/engine/test_packed.py",),
        "a document's first token predicted from the previous document",
    ),
    M(
        "packed-positions",
        "llmctl/engine/data.py",
        "positions = idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1)",
        "positions = idx + 0 * np.maximum.accumulate(np.where(starts, idx, 0), axis=1)",
        ("tests/engine/test_packed.py",),
        "positions not restarted at document starts (attention crosses examples)",
    ),
    M(
        "chat-mask-prompt",
        "llmctl/data/chat.py",
        "out += [(self._ids(full[cursor : len(prompt)]), False), (self._ids(through[len(prompt) :]), True)]",
        "out += [(self._ids(full[cursor : len(prompt)]), True), (self._ids(through[len(prompt) :]), True)]",
        ("tests/data/test_instruction.py",),
        "the prompt tokens carry loss under a chat template",
    ),
    M(
        "chunked-mean-all",
        "llmctl/engine/loss.py",
        'return total if reduction == "sum" else total / (t != -100).sum()',
        'return total if reduction == "sum" else total / n',
        ("tests/engine/test_packed.py",),
        "the chunked loss's mean over every position, masked ones included",
    ),
    # --- issue 51: the modules of the last turns (ring, NF4, launch, data formats, pipeline split) ------------------
    M(
        "ring-kv-tp",
        "llmctl/plan/ring.py",
        "kv = 2 * b * -(-at.num_kv_heads // tp) * s * at.head_dim * setup.compute_bytes",
        "kv = 2 * b * at.num_kv_heads * s * at.head_dim * setup.compute_bytes",
        ("tests/plan/test_cp_cost.py",),
        "the ring's K/V hop not divided by tp (each tp rank sends its own heads)",
    ),
    M(
        "ring-last-dkv",
        "llmctl/plan/ring.py",
        "                per_layer += t_d  # the last dK/dV hop",
        "                per_layer += 0 * t_d  # the last dK/dV hop",
        ("tests/plan/test_cp_cost.py",),
        "the last dK/dV hop hidden though no attention follows it",
    ),
    M(
        "ring-mem-allgather",
        "llmctl/plan/memory/ring.py",
        "return cp + 2 if step == 0 else cp",
        "return cp if step == 0 else cp",
        ("tests/plan/test_cp_memory.py",),
        "the all-gather's step-0 send copy and own block not counted",
    ),
    M(
        "ring-mem-balance",
        "llmctl/plan/memory/ring.py",
        "partial = max(4 * q, 8 * k) if setup.cp_load_balance else 0",
        "partial = max(4 * q, 8 * k) if not setup.cp_load_balance else 0",
        ("tests/plan/test_cp_memory.py",),
        "the head-tail split's partial-gradient buffer counted without it",
    ),
    M(
        "nf4-absmax",
        "llmctl/spec/nf4.py",
        "return n / 2 + n / BLOCK + compute_bytes * n / (BLOCK * s) + shard * compute_bytes * TABLE_VALUES",
        "return n / 2 + compute_bytes * n / (BLOCK * s) + shard * compute_bytes * TABLE_VALUES",
        ("tests/engine/test_qlora_units.py",),
        "NF4's int8 absmax per 64-value block left out",
    ),
    M(
        "nf4-rows",
        "llmctl/spec/nf4.py",
        "if numel % BLOCK or rows % shard:",
        "if numel % BLOCK:",
        ("tests/engine/test_qlora_units.py",),
        "a weight whose rows do not split over the shards still stored in NF4",
    ),
    M(
        "runlock-probe-ignores",
        "llmctl/launch/runlock.py",
        "            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # conflicts",
        "            fcntl.flock(fd, fcntl.LOCK_UN | fcntl.LOCK_NB)  # conflicts",
        ("tests/launch/test_run_lock.py",),
        "the submission probe never sees the holder's lock",
    ),
    M(
        "runlock-queued-any-state",
        "llmctl/launch/backends.py",
        'if state.split(" ")[0] in jobs.ACTIVE:',
        'if state.split(" ")[0] not in jobs.ACTIVE:',
        ("tests/launch/test_run_lock.py",),
        "a finished job's folder refused, a queued job's let through",
    ),
    M(
        "runlock-nonblocking",
        "llmctl/launch/runlock.py",
        "        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n",
        "        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)\n",
        ("tests/launch/test_run_lock.py",),
        "a shared lock: two runs hold the folder at once",
    ),
    M(
        "machine-check-count",
        "llmctl/launch/local.py",
        "    if have < job.nproc_per_node:",
        "    if have < 1:",
        ("tests/launch/test_machine_check.py",),
        "one visible GPU passes a plan that asks for two",
    ),
    M(
        "machine-check-cpu",
        "llmctl/launch/local.py",
        "    if gpu is None:\n        return\n    have",
        "    if gpu is None and False:\n        return\n    have",
        ("tests/launch/test_machine_check.py",),
        "a CPU plan asked for GPUs",
    ),
    M(
        "shell-comment-raw",
        "llmctl/launch/shell.py",
        "    return one_line(str(value))",
        "    return str(value)",
        ("tests/launch/test_injection.py",),
        "a plan value with a line break written raw into a # comment: the next line of the script runs (issue 46)",
    ),
    M(
        "shell-setup-newline",
        "llmctl/launch/shell.py",
        'for char, escape in (("\\n", "\\\\n"), ("\\r", "\\\\r"), ("\\t", "\\\\t")):',
        'for char, escape in (("\\r", "\\\\r"), ("\\t", "\\\\t")):',
        ("tests/launch/test_slurm_resources.py",),
        "a --setup line break left raw in its $'...' word: the script shows each setup line as a command twice",
    ),
    M(
        "backends-env-unquoted",
        "llmctl/launch/backends.py",
        'return "".join(f"{k}={shell.quote(v)} " for k, v in sorted(self.env.items()))',
        'return "".join(f"{k}={v} " for k, v in sorted(self.env.items()))',
        ("tests/launch/test_cli.py::test_local_dry_run_quotes_the_environment_it_prints",),
        "a printed command line's environment values not shell-quoted",
    ),
    M(
        "slurm-env-quote",
        "llmctl/launch/shell.py",
        "    return shlex.quote(str(value))\n\n\ndef comment",
        "    return str(value)\n\n\ndef comment",
        ("tests/launch/test_injection.py", "tests/launch/test_render.py"),
        "plan values rendered into the job script unquoted",
    ),
    M(
        "sources-inner-suffix",
        "llmctl/data/sources.py",
        "return Path(path.stem).suffix.lower() if compression(path) else path.suffix.lower()",
        "return path.suffix.lower()",
        ("tests/data/test_formats_people_have.py",),
        "a compressed file's format read from its compression suffix",
    ),
    M(
        "alpaca-input-dropped",
        "llmctl/data/chat.py",
        'prompt = f"{instruction}\\n\\n{extra}" if extra else instruction',
        "prompt = instruction",
        ("tests/data/test_formats_people_have.py",),
        "Alpaca's input left out of the user's turn",
    ),
    M(
        "sharegpt-roles",
        "llmctl/data/chat.py",
        'SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant",',
        'SHAREGPT_ROLES = {"human": "assistant", "user": "user", "gpt": "assistant",',
        ("tests/data/test_formats_people_have.py",),
        "ShareGPT's human turns trained on as the assistant's",
    ),
    M(
        "pp-split-extra",
        "llmctl/spec/pipeline.py",
        "share = per + (1 if i < extra else 0)",
        "share = per + (1 if i >= stages - extra else 0)",
        ("tests/spec/test_pipeline.py",),
        "the extra layers dealt to the last stages (which hold the head) instead of the first",
    ),
    M(
        "pp-in-flight-1f1b",
        "llmctl/spec/pipeline.py",
        "return min(pp - rank, m)",
        "return min(pp - rank - 1, m)",
        ("tests/spec/test_pipeline.py",),
        "1F1B's stage holds one micro-batch fewer than its warm-up plus the one in steady state",
    ),
    # --- issue 51: context parallelism, float8, pipeline stages, heartbeats and the watchdog -------------------------
    M(
        "cp-balance-ignored",
        "llmctl/engine/context_parallel.py",
        "_cp_options.enable_load_balance = self.load_balance",
        "_cp_options.enable_load_balance = True",
        (
            "tests/engine/test_context_parallel.py::test_the_split_cuts_ids_targets_and_positions_per_rank_in_one_process",
        ),
        "the head-tail load balance on though the plan turned it off",
    ),
    M(
        "cp-positions-uncut",
        "llmctl/engine/context_parallel.py",
        "with context_parallel(self.mesh, buffers=bufs, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(bufs)):",
        "with context_parallel(self.mesh, buffers=bufs[:2], buffer_seq_dims=[1, 1], no_restore_buffers=set(bufs[:2])):",
        (
            "tests/engine/test_context_parallel.py::test_the_split_cuts_ids_targets_and_positions_per_rank_in_one_process",
        ),
        "the positions not cut with the ids: the rotary tables of the sequence's first s/cp tokens on every rank",
    ),
    M(
        "cp-rotate-ignored",
        "llmctl/engine/context_parallel.py",
        "set_rotate_method(self.rotate)",
        'set_rotate_method("allgather")',
        (
            "tests/engine/test_context_parallel.py::test_the_split_cuts_ids_targets_and_positions_per_rank_in_one_process",
        ),
        "the plan's all-to-all rotation ignored (the ring always all-gathers)",
    ),
    M(
        "f8e-gather-without-fsdp",
        "llmctl/engine/float8.py",
        'out = Float8Conversion(p.float8_recipe or "", all_gather=fsdp and p.float8_all_gather)',
        'out = Float8Conversion(p.float8_recipe or "", all_gather=p.float8_all_gather)',
        ("tests/engine/test_precision_units.py::test_float8_all_gathers_only_under_fsdp",),
        "the float8 all-gather switched on without FSDP (no shard to gather; an amax all-reduce each step)",
    ),
    M(
        "f8e-router-fqn",
        "llmctl/engine/float8.py",
        'elif fqn.rsplit(".", 1)[-1] in ROUTER_NAMES:',
        "elif fqn in ROUTER_NAMES:",
        ("tests/engine/test_precision_units.py",),
        "the router matched on its whole path: every MoE router converted to float8",
    ),
    M(
        "f8e-one-dimension",
        "llmctl/engine/float8.py",
        "elif not float8_convertible(mod.in_features, mod.out_features):",
        "elif not float8_convertible(mod.in_features, mod.in_features):",
        ("tests/engine/test_precision_units.py",),
        "the shape rule checks the input features only",
    ),
    M(
        "f8p-recompute-mask",
        "llmctl/plan/float8.py",
        "            if redo_n and mask[k]:",
        "            if redo_n:",
        ("tests/plan/test_float8.py",),
        "selective checkpointing priced as re-casting every linear, not only those it recomputes",
    ),
    M(
        "f8p-unsharded-tp",
        "llmctl/plan/float8.py",
        "best = max(best, (params / tp - conv_rank) * compute_bytes + conv_rank)",
        "best = max(best, (params - conv_rank) * compute_bytes + conv_rank)",
        ("tests/plan/test_float8.py",),
        "the gathered block's bf16 parameters not split over tp",
    ),
    M(
        "f8p-precompute-accum",
        "llmctl/plan/float8.py",
        "fwd += per_gather + policy.param_bytes * shard / grad_accum",
        "fwd += per_gather + policy.param_bytes * shard",
        ("tests/plan/test_float8.py",),
        "the once-a-step amax precompute read priced on every micro-batch",
    ),
    M(
        "pp-loss-undivided",
        "llmctl/engine/pipeline.py",
        "return loss * (self.multiplier / acc)",
        "return loss * self.multiplier",
        ("tests/engine/test_pipeline_stages.py::test_the_last_stages_loss_per_micro_batch",),
        "the last stage's loss not divided by grad_accum_steps before backward",
    ),
    M(
        "pp-packed-divisor",
        "llmctl/engine/pipeline.py",
        "loss = loss * (acc / div)",
        "loss = loss / div",
        ("tests/engine/test_pipeline_stages.py::test_the_last_stages_loss_per_micro_batch",),
        "a packed micro-batch's summed loss divided by the step's loss tokens without the accumulation factor",
    ),
    M(
        "pp-norm-world",
        "llmctl/engine/pipeline.py",
        "dist.all_reduce(sq, group=self.group)",
        "dist.all_reduce(sq)",
        ("tests/engine/test_pipeline_stages.py::test_the_gradient_norm_is_summed_over_the_pp_group_only",),
        "the stages' squared norms summed over every rank, not the pp group (dp times too large)",
    ),
    M(
        "pp-norm-unsquared",
        "llmctl/engine/pipeline.py",
        "sq = norm.float().pow(2).reshape(1).clone()",
        "sq = norm.float().reshape(1).clone()",
        ("tests/engine/test_pipeline_stages.py::test_the_gradient_norm_is_summed_over_the_pp_group_only",),
        "the stages' norms summed, not their squares",
    ),
    M(
        "pp-stage-extra-layer",
        "llmctl/engine/pipeline.py",
        "if not first_block <= i < first_block + num_blocks:",
        "if not first_block <= i <= first_block + num_blocks:",
        ("tests/engine/test_pipeline_stages.py::test_chained_stages_give_the_whole_models_logits",),
        "a stage keeps the next stage's first layer too (it runs twice)",
    ),
    M(
        "hb-step-time-per-step",
        "llmctl/launch/heartbeat.py",
        "self._steps_s.append((now - self._finished_at) / (step - self.step))",
        "self._steps_s.append(now - self._finished_at)",
        ("tests/launch/test_heartbeat.py",),
        "a beat that finishes several steps at once counted as one long step",
    ),
    M(
        "hb-fastest-rank",
        "llmctl/launch/heartbeat.py",
        "step_s = max(measured) if measured else planned_step_s",
        "step_s = min(measured) if measured else planned_step_s",
        ("tests/launch/test_heartbeat.py",),
        "the stall limit from the fastest rank's step time (a slower rank's normal step called a stall)",
    ),
    M(
        "hb-quiet-oldest",
        "llmctl/launch/heartbeat.py",
        "quiet = now - max(b.since for b in beats)",
        "quiet = now - min(b.since for b in beats)",
        ("tests/launch/test_heartbeat.py",),
        "quiet time from the rank that moved first, not the last one to move",
    ),
    M(
        "wd-stall-step",
        "llmctl/engine/watchdog.py",
        "if self._stall is not None and step + 1 == self._stall[0]:",
        "if self._stall is not None and step == self._stall[0]:",
        ("tests/launch/test_heartbeat.py",),
        "the test hook sleeps one step late",
    ),
    M(
        "wd-stall-every-rank",
        "llmctl/engine/watchdog.py",
        "return (int(step), float(seconds)) if int(r) == rank else None",
        "return (int(step), float(seconds))",
        ("tests/launch/test_heartbeat.py",),
        "the test hook sleeps every rank, not the one it names",
    ),
    M(
        "wd-flight-no-dump",
        "llmctl/engine/watchdog.py",
        'os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")',
        'os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")',
        ("tests/launch/test_heartbeat.py",),
        "NCCL's flight recorder records but never dumps on a timeout",
    ),
    # written after the tests above (issue 51's "more mutants of your own choosing"):
    M(
        "cp-batch-views",
        "llmctl/engine/context_parallel.py",
        "bufs = [batch.inputs.clone(), batch.targets.clone(), positions]",
        "bufs = [batch.inputs, batch.targets, positions]",
        (
            "tests/engine/test_context_parallel.py::test_the_split_cuts_ids_targets_and_positions_per_rank_in_one_process",
        ),
        "the batch's own rows handed to context_parallel, which cuts its buffers in place",
    ),
    M(
        "f8e-tensorwise-granularity",
        "llmctl/engine/float8.py",
        "x.scaling_type is ScalingType.DYNAMIC and x.scaling_granularity is ScalingGranularity.TENSORWISE for x in casts",
        "x.scaling_type is ScalingType.DYNAMIC for x in casts",
        ("tests/engine/test_precision_units.py::test_float8_linears_take_torchaos_float8_tp_styles",),
        "rowwise-scaled layers given torchao's float8 TP styles (which assume one scale per tensor)",
    ),
    M(
        "f8e-router-name-left-out",
        "llmctl/engine/float8.py",
        'ROUTER_NAMES = ("gate", "router")',
        'ROUTER_NAMES = ("router",)',
        ("tests/engine/test_precision_units.py::test_float8_leaves_an_nn_linear_router_in_bf16",),
        "an nn.Linear router named gate (Mixtral, Qwen3-MoE under transformers 4.x) converted to float8",
    ),
    M(
        "f8e-head-unknown",
        "llmctl/engine/float8.py",
        'head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None',
        "head = None",
        ("tests/engine/test_precision_units.py::test_float8_converts_the_linear_layers_but_the_head_and_odd_shapes",),
        "the LM head not recognised: converted wherever its shape passes",
    ),
    M(
        "f8p-rowwise-shares-swapped",
        "llmctl/plan/float8.py",
        "return (tp if row else 1), tp, (1 if row else tp)",
        "return (1 if row else tp), tp, (tp if row else 1)",
        ("tests/plan/test_float8.py",),
        "rowwise under tp: the whole casts put on the row-wise linears' inputs instead of the column-wise ones'",
    ),
    M(
        "f8p-rowwise-scales-in",
        "llmctl/plan/float8.py",
        "scales_f = AMAX_BYTES * ((tokens + o) if rowwise else 2)",
        "scales_f = AMAX_BYTES * ((tokens + i) if rowwise else 2)",
        ("tests/plan/test_float8.py",),
        "the weight's row scales counted along the input features",
    ),
    M(
        "pp-last-stage-off-by-one",
        "llmctl/engine/pipeline.py",
        "return self.num_stages - 1 in self.stage_ids",
        "return self.num_stages in self.stage_ids",
        ("tests/engine/test_pipeline_stages.py::test_each_stage_gets_the_inputs_it_runs",),
        "no rank sees itself as the last stage: the targets never given to the schedule",
    ),
    M(
        "pp-counting-left-on",
        "llmctl/engine/pipeline.py",
        "                self.counting = False",
        "                pass",
        ("tests/engine/test_pipeline_stages.py::test_the_last_stages_loss_per_micro_batch",),
        "the loss keeps counting after the schedule's call: the next metadata inference recorded as a micro-batch",
    ),
    M(
        "hb-step-start-moved",
        "llmctl/launch/heartbeat.py",
        "if self._finished_at is None or step > self.step:",
        "if self._finished_at is None or step >= self.step:",
        ("tests/launch/test_heartbeat.py",),
        "each micro-batch's or checkpoint's beat restarts the step's clock (step times too short)",
    ),
    M(
        "hb-behind-latest",
        "llmctl/launch/heartbeat.py",
        "first = min(b.place for b in beats)",
        "first = max(b.place for b in beats)",
        ("tests/launch/test_heartbeat.py",),
        "the ranks ahead named as behind",
    ),
    M(
        "wd-stacks-one-thread",
        "llmctl/engine/watchdog.py",
        "faulthandler.register(signal.SIGUSR2, file=self._stacks, all_threads=True, chain=False)",
        "faulthandler.register(signal.SIGUSR2, file=self._stacks, all_threads=False, chain=False)",
        ("tests/launch/test_heartbeat.py",),
        "the stacks on request show the main thread only",
    ),
    # --- tensor-parallel plans (families) and their styles (engine) ---------------------------------------------------
    M(
        "tp-kv-heads",
        "llmctl/families/tensor_parallel.py",
        '("num_key_value_heads", spec.num_kv_heads),',
        '("num_key_value_heads", spec.num_heads),',
        ("tests/spec/test_plan_tp.py",),
        "tp checked against the query heads twice: a tp that splits a kv head is accepted",
    ),
    M(
        "tp-latent-whole",
        "llmctl/families/tensor_parallel.py",
        'return "norm" in tensor or any(f"{p}." in tensor for p in LATENT_PROJECTIONS)',
        'return "norm" in tensor',
        ("tests/families/test_registry.py",),
        "MLA's latent projections counted as split over tp (the engine keeps them whole)",
    ),
    M(
        "tp-shared-key-width",
        "llmctl/engine/tensor_parallel.py",
        "width = int(owner.qk_rope_head_dim)",
        "width = int(owner.kv_lora_rank)",
        ("tests/engine/test_tensor_parallel.py",),
        "MLA's key-gradient all-reduce over the latent's width: latent columns summed tp times",
    ),
    M(
        "tp-proj-norm-local",
        "llmctl/engine/tensor_parallel.py",
        "input_layouts=(Shard(-1),),\n                desired_input_layouts=(Replicate(),),",
        "input_layouts=(Shard(-1),),\n                desired_input_layouts=(Shard(-1),),",
        ("tests/engine/test_tensor_parallel.py",),
        "OLMo 2's q/k norms over the local heads' columns only (the variance of a part of the row)",
    ),
    # --- issue 51: the launch modules without any (sbatch rendering, submitit, preflight, jobs, registry, shared
    # file systems, SLURM options and resources, dry start) -------------------------------------------------------
    M(
        "sbatch-shutdown-lead",
        "llmctl/launch/slurm.py",
        "return max(10, self.slurm.signal_lead_s - 10)",
        "return max(10, self.slurm.signal_lead_s)",
        ("tests/launch/test_render.py",),
        "torchrun waits the whole signal lead for the ranks' checkpoint: SLURM's kill at the time limit comes first",
    ),
    M(
        "sbatch-spares-not-asked",
        "llmctl/launch/slurm.py",
        "alloc_nodes=params.nodes + params.preflight.spare_nodes,",
        "alloc_nodes=params.nodes,",
        ("tests/launch/test_preflight.py::test_dry_run_asks_for_the_spares_and_runs_the_preflight",),
        "--spare-nodes N: the script asks SLURM for the plan's nodes only (the preflight has no spare to drop)",
    ),
    M(
        "sbatch-mount-prefix",
        "llmctl/launch/slurm.py",
        'own = [workdir] + ([] if (job_dir + "/").startswith(workdir.rstrip("/") + "/") else [job_dir])',
        "own = [workdir] + ([] if job_dir.startswith(workdir) else [job_dir])",
        ("tests/launch/test_slurm_resources.py::test_a_job_folder_beside_the_workdir_is_mounted_as_its_own",),
        "a job folder /work/run2/... taken as inside the workdir /work/run: the container never mounts it",
    ),
    M(
        "sbatch-parsable-cluster",
        "llmctl/launch/slurm.py",
        'job_id = out.stdout.strip().split(";")[0]',
        'job_id = out.stdout.strip().split(";")[-1]',
        ("tests/launch/test_jobs_registry.py::test_an_unwritable_index_warns_and_the_launch_goes_on",),
        "sbatch --parsable's `id;cluster` read from the end: a federated cluster's name taken as the job id",
    ),
    M(
        "submitit-cpus-per-node",
        "llmctl/launch/submitit_backend.py",
        "per_rank = res.cpus_per_task // job.nproc_per_node",
        "per_rank = res.cpus_per_task",
        ("tests/launch/test_slurm_resources.py::test_submitit_carries_the_same_job",),
        "each of a node's submitit tasks (one per rank) asks for the whole node's CPUs",
    ),
    M(
        "submitit-percent-folder",
        "llmctl/launch/submitit_backend.py",
        'if any(c in text for c in "\\n\\r\\0%") or not text.isprintable():',
        'if any(c in text for c in "\\n\\r\\0") or not text.isprintable():',
        ("tests/launch/test_cli.py::test_submitit_hostile_paths",),
        "a --jobs-dir with % let through: submitit's #SBATCH --output reads %j in it as the job id",
    ),
    M(
        "submitit-logs-task0-twice",
        "llmctl/launch/submitit_backend.py",
        'if task.isdigit() and task != "0":',
        "if task.isdigit():",
        ("tests/launch/test_jobs_registry.py::test_submitit_logs_show_task_0_then_every_other_tasks_stderr",),
        "task 0's stderr listed twice by `llmctl logs`",
    ),
    M(
        "preflight-spare-tie",
        "llmctl/launch/preflight/decision.py",
        "worst = min(reversed(keep), key=lambda n: _node_score(n, checks, bench))",
        "worst = min(keep, key=lambda n: _node_score(n, checks, bench))",
        ("tests/launch/test_preflight.py",),
        "on a tie the first node of the allocation left out as the spare, not the latest",
    ),
    M(
        "preflight-below-plan-fraction",
        "llmctl/launch/preflight/decision.py",
        "if assumed.intra_busbw_gbytes_s and got < fraction * assumed.intra_busbw_gbytes_s:",
        "if assumed.intra_busbw_gbytes_s and got < assumed.intra_busbw_gbytes_s:",
        ("tests/launch/test_preflight.py",),
        "an intra-node bandwidth a little under the plan's warned about (or stops a strict job)",
    ),
    M(
        "preflight-left-counts-slow",
        "llmctl/launch/preflight/decision.py",
        "left = len(allocated) - len(d.dropped)",
        "left = len(healthy)",
        ("tests/launch/test_preflight.py",),
        "a stop for slow nodes counts them among the nodes left",
    ),
    M(
        "preflight-spares-unbounded",
        "llmctl/launch/preflight/options.py",
        'if not 0 <= self.spare_nodes <= LIMITS["--nodes"]:',
        "if not 0 <= self.spare_nodes:",
        ("tests/launch/test_preflight.py::test_options_validated",),
        "--spare-nodes past the node limit accepted",
    ),
    M(
        "preflight-spares-without-preflight",
        "llmctl/launch/preflight/options.py",
        "if not self.enabled and self.spare_nodes:",
        "if not self.enabled and self.spare_nodes < 0:",
        ("tests/launch/test_preflight.py::test_options_validated",),
        "--spare-nodes with --no-preflight accepted: the job asks for nodes nothing leaves out",
    ),
    M(
        "preflight-main-strict-lost",
        "llmctl/launch/preflight/main.py",
        'd = run(strict="--strict" in args)',
        "d = run()",
        ("tests/launch/test_preflight_host.py::test_main_gives_the_script_the_nodes_or_the_exit_code_that_stops_it",),
        "python -m llmctl.launch.preflight --strict runs the lenient check",
    ),
    M(
        "preflight-main-stop-exit",
        "llmctl/launch/preflight/main.py",
        "    if not d.ok:\n        return 1",
        "    if not d.ok:\n        return 0",
        ("tests/launch/test_preflight_host.py::test_main_gives_the_script_the_nodes_or_the_exit_code_that_stops_it",),
        "a failed preflight exits 0: the script trains on no nodes",
    ),
    M(
        "preflight-job-port-offset",
        "llmctl/launch/preflight/job.py",
        'rdzv_port=int(env["LLMCTL_RDZV_PORT"]) + PORT_OFFSET,',
        'rdzv_port=int(env["LLMCTL_RDZV_PORT"]),',
        ("tests/launch/test_preflight_host.py::test_the_job_context_reads_the_scripts_exports",),
        "the cross step's rendezvous on the training's port (a job's preflight and another's training collide)",
    ),
    M(
        "preflight-job-restart-default",
        "llmctl/launch/preflight/job.py",
        'restart=env.get("SLURM_RESTART_COUNT", "0") or "0",',
        'restart=env.get("SLURM_RESTART_COUNT", ""),',
        ("tests/launch/test_preflight_host.py::test_the_job_context_reads_the_scripts_exports",),
        "a first run's restart count empty: its preflight folder is `<id>.` and its events say `restart :`",
    ),
    M(
        "preflight-host-cross-on-one",
        "llmctl/launch/preflight/host.py",
        "if len(healthy) >= max(2, needed):",
        "if len(healthy) >= needed:",
        (
            "tests/launch/test_preflight_host.py::test_the_batch_host_runs_the_node_step_then_the_cross_step_on_two_or_more",
        ),
        "the cross step (a torchrun rendezvous) started on a single node",
    ),
    M(
        "preflight-host-kill-on-bad-exit",
        "llmctl/launch/preflight/host.py",
        '"--kill-on-bad-exit=0",',
        '"--kill-on-bad-exit=1",',
        (
            "tests/launch/test_preflight_host.py::test_the_batch_host_runs_the_node_step_then_the_cross_step_on_two_or_more",
        ),
        "one node's failed check kills the other nodes' checks (they all read as failed)",
    ),
    M(
        "preflight-node-is-host",
        "llmctl/launch/preflight/node.py",
        "f\"--rdzv_conf=is_host={int(node == opts['--rdzv-node'])},join_timeout={opts['--join-timeout-s']}\",",
        "f\"--rdzv_conf=is_host={int(node != opts['--rdzv-node'])},join_timeout={opts['--join-timeout-s']}\",",
        ("tests/launch/test_preflight.py::test_cross_step_torchrun_command",),
        "every node but the rendezvous node hosts the cross step's store",
    ),
    M(
        "preflight-node-omp-threads",
        "llmctl/launch/preflight/node.py",
        "    if nproc > 1:\n        out.setdefault",
        "    if nproc > 2:\n        out.setdefault",
        ("tests/launch/test_preflight.py::test_node_step_ranks_get_torchruns_variables",),
        "two ranks on a node each take every core (no OMP_NUM_THREADS=1, as torchrun sets it)",
    ),
    M(
        "preflight-requeue-limit",
        "llmctl/launch/preflight/requeue.py",
        "if restart >= max_requeues:",
        "if restart > max_requeues:",
        ("tests/launch/test_preflight.py",),
        "one requeue past --max-requeues",
    ),
    M(
        "preflight-requeue-forgets-exclude",
        "llmctl/launch/preflight/requeue.py",
        'exclude = sorted(set(job.get("ExcNodeList", "").split(",")) - {""} | set(d.exclude))',
        "exclude = sorted(set(d.exclude))",
        ("tests/launch/test_preflight.py",),
        "the requeue's exclude list drops the user's own --exclude nodes",
    ),
    M(
        "dry-start-allocate-all-place",
        "llmctl/launch/dry_start.py",
        'argv.insert(4, "--allocate-all")',
        'argv.insert(5, "--allocate-all")',
        ("tests/launch/test_dry_start_child.py::test_the_childs_command_line_keeps_each_option_with_its_value",),
        "--allocate-all put between --json-out and its path",
    ),
    M(
        "dry-start-overwrites-plan",
        "llmctl/launch/dry_start.py",
        "    out = folder / path.name\n",
        "    out = path\n",
        ("tests/launch/test_dry_start_child.py::test_an_override_sizes_a_copy_and_leaves_the_plan_file_alone",),
        "--dry-start --tp N rewrites the user's plan file instead of a copy",
    ),
    M(
        "jobs-sacct-plus",
        "llmctl/launch/jobs.py",
        'return out.split()[0].rstrip("+")',
        "return out.split()[0]",
        ("tests/launch/test_jobs_registry.py::test_slurm_state_asks_squeue_then_sacct_then_scontrol",),
        "sacct's `CANCELLED+` not read as CANCELLED",
    ),
    M(
        "jobs-cancel-then-exit",
        "llmctl/launch/jobs.py",
        'elif word == "exit" and rest and state != "CANCELLED":',
        'elif word == "exit" and rest:',
        ("tests/launch/test_jobs_registry.py::test_folder_state",),
        "the exit line the script appends after scancel turns a cancelled job into FAILED",
    ),
    M(
        "jobs-preflight-first-line",
        "llmctl/launch/jobs.py",
        'words = lines[-1].split(" ", 5)  # preflight KIND TIME restart R: text',
        'words = lines[0].split(" ", 5)  # preflight KIND TIME restart R: text',
        ("tests/launch/test_preflight.py::test_status_shows_the_last_preflight_line",),
        "`status` shows the first run's preflight, not the latest requeue's",
    ),
    M(
        "jobs-reused-id-oldest",
        "llmctl/launch/jobs.py",
        "    if matches:\n        return matches[-1]",
        "    if matches:\n        return matches[0]",
        ("tests/launch/test_jobs_registry.py::test_find_takes_the_newest_job_of_a_reused_id",),
        "a reused job id finds the oldest job with it",
    ),
    M(
        "registry-order-folder",
        "llmctl/launch/registry.py",
        "return sorted(out, key=lambda e: (e.submitted_at, e.folder))",
        "return sorted(out, key=lambda e: e.folder)",
        ("tests/launch/test_jobs_registry.py::test_the_index_keeps_one_entry_per_folder_path_in_launch_order",),
        "the index sorted by folder path: the latest job of another jobs root is not the latest",
    ),
    M(
        "registry-entry-name-only",
        "llmctl/launch/registry.py",
        'return index_dir() / f"{Path(folder).name[:80]}-{digest}.json"',
        'return index_dir() / f"{Path(folder).name[:80]}.json"',
        ("tests/launch/test_jobs_registry.py::test_the_index_keeps_one_entry_per_folder_path_in_launch_order",),
        "two job folders of one name in two roots share one index entry: the first job vanishes from status",
    ),
    M(
        "registry-xdg-default",
        "llmctl/launch/registry.py",
        'os.path.join("~", ".local", "state")',
        'os.path.join("~", ".local", "share")',
        ("tests/launch/test_jobs_registry.py::test_home_is_llmctl_home_else_xdg_state_else_dot_local_state",),
        "the index under ~/.local/share (XDG's data, not its state)",
    ),
    M(
        "sharedfs-later-mount",
        "llmctl/launch/sharedfs.py",
        "if inside and (best is None or len(m.point) >= len(best.point)):",
        "if inside and (best is None or len(m.point) > len(best.point)):",
        ("tests/launch/test_slurm_resources.py::test_the_mount_that_holds_a_path_is_the_deepest_then_the_latest",),
        "a later mount at the same point does not hide the earlier (an NFS mounted over a local folder read as local)",
    ),
    M(
        "sharedfs-prefix",
        "llmctl/launch/sharedfs.py",
        'inside = p == m.point or p.startswith(m.point.rstrip("/") + "/")',
        "inside = p.startswith(m.point)",
        ("tests/launch/test_slurm_resources.py::test_the_mount_that_holds_a_path_is_the_deepest_then_the_latest",),
        "/home2/venv read as inside the mount /home",
    ),
    M(
        "sharedfs-octal",
        "llmctl/launch/sharedfs.py",
        "out.append(chr(int(field[i + 1 : i + 4], 8)))",
        "out.append(chr(int(field[i + 1 : i + 4])))",
        ("tests/launch/test_slurm_resources.py::test_the_mount_of_a_path",),
        "mountinfo's \\040 read as decimal: a mount point with a space never matches",
    ),
    M(
        "sharedfs-unknown-local",
        "llmctl/launch/sharedfs.py",
        "if m is not None and m.shared is False:",
        "if m is not None and not m.shared:",
        ("tests/launch/test_slurm_resources.py::test_the_mount_that_holds_a_path_is_the_deepest_then_the_latest",),
        "a file system of unknown type called local: a note about an interpreter the nodes may well share",
    ),
    M(
        "slurm-options-time-round-down",
        "llmctl/launch/slurm_options.py",
        '"time": max(1, -(-(self.time_s or _SUBMITIT_DEFAULT_TIME_S) // 60)),',
        '"time": max(1, (self.time_s or _SUBMITIT_DEFAULT_TIME_S) // 60),',
        ("tests/launch/test_render.py::test_submitits_time_is_whole_minutes_rounded_up",),
        "submitit's time limit rounded down to the minute: the job ends before the signal lead it was checked for",
    ),
    M(
        "slurm-options-time-ms",
        "llmctl/launch/slurm_options.py",
        "        return nums[0] * 60 + nums[1]\n",
        "        return (nums[0] * 60 + nums[1]) * 60\n",
        ("tests/launch/test_render.py::test_parse_time",),
        "--time M:S read as H:M",
    ),
    M(
        "slurm-options-lead-equal",
        "llmctl/launch/slurm_options.py",
        "if self.time is not None and parse_time_s(self.time) <= self.signal_lead_s:",
        "if self.time is not None and parse_time_s(self.time) < self.signal_lead_s:",
        ("tests/launch/test_render.py::test_the_time_limit_must_leave_room_after_the_signal",),
        "a --time equal to the signal lead accepted: the signal comes at the start",
    ),
    M(
        "slurm-options-mem-case",
        "llmctl/launch/slurm_options.py",
        "if current is not None and str(current).upper() != str(value).upper():",
        "if current is not None and str(current) != str(value):",
        ("tests/launch/test_render.py::test_a_resource_option_given_twice_must_say_the_same",),
        "--mem 200G with --sbatch-arg=--mem=200g refused as two values",
    ),
    M(
        "resources-full-node",
        "llmctl/launch/slurm_resources.py",
        "full = gpus_per_node >= share.node_gpus",
        "full = gpus_per_node > share.node_gpus",
        (
            "tests/launch/test_slurm_resources.py::test_the_reported_command_takes_whole_nodes_and_gives_the_step_their_cpus",
        ),
        "a job on all 8 GPUs of a node not given the whole node",
    ),
    M(
        "resources-srun-cpus-shared",
        "llmctl/launch/slurm_resources.py",
        'return [f"export SRUN_CPUS_PER_TASK={max(1, self.cpus_per_task // tasks_per_node)}"]',
        'return [f"export SRUN_CPUS_PER_TASK={self.cpus_per_task}"]',
        ("tests/launch/test_slurm_resources.py::test_the_srun_cpus_are_the_nodes_split_over_its_tasks",),
        "submitit's tasks each ask srun for the whole node's CPUs",
    ),
    M(
        "resources-mem-unit",
        "llmctl/launch/slurm_resources.py",
        'mem = options.mem or f"{gpus_per_node * share.memory_gib_per_gpu}G"',
        'mem = options.mem or f"{gpus_per_node * share.memory_gib_per_gpu}"',
        ("tests/launch/test_slurm_resources.py::test_part_of_a_node_asks_for_the_catalogs_share_per_gpu",),
        "the per-GPU memory share written without its unit: SLURM reads MiB",
    ),
    M(
        "resources-fewest-cpus",
        "llmctl/launch/slurm_resources.py",
        "sort -n | head -n 1)",
        "sort -n | tail -n 1)",
        ("tests/launch/test_slurm_resources.py::test_the_step_gets_the_fewest_cpus_any_node_of_the_job_has",),
        "the step asks for the CPUs of the largest node of the job: it does not fit on the others",
    ),
    M(
        "runnable-one-flag-allows-both",
        "llmctl/launch/runnable.py",
        "        if allowed[p.allow]:\n",
        '        if allowed["--allow-synthetic"]:\n',
        ("tests/launch/test_runnable.py::test_allow_flags_let_it_run",),
        "--allow-synthetic also lets a plan without checkpoints run",
    ),
    M(
        "runnable-elif",
        "llmctl/launch/runnable.py",
        "    if plan.checkpoint.dir is None:\n",
        "    elif plan.checkpoint.dir is None:\n",
        ("tests/launch/test_runnable.py::test_dry_run_warns_and_prints",),
        "a synthetic plan's missing checkpoint not named (elif): the user fixes one problem to meet the next",
    ),
    M(
        "bench-net-ranks-render",
        "llmctl/launch/bench_net.py",
        '[*cfg.to_argv(), "--no-render"],',
        "cfg.to_argv(),",
        ("tests/netbench/test_netbench_report.py::test_torchrun_command_is_launch_module_argv",),
        "every bench-net rank renders the report too",
    ),
    M(
        "bench-net-noise-one-line",
        "llmctl/launch/bench_net.py",
        "muted = muted or bool(_TORCHRUN_NOISE.match(line))",
        "muted = bool(_TORCHRUN_NOISE.match(line))",
        ("tests/launch/test_bench_net_stderr.py",),
        "only the first line of torchrun's failure report kept off the terminal, the rest of its traceback shown",
    ),
    M(
        "flight-completed-off-by-one",
        "llmctl/launch/flight.py",
        'done = int(status.get("last_completed_collective", -1)) >= last',
        'done = int(status.get("last_completed_collective", -1)) > last',
        (
            "tests/launch/test_flight.py::test_a_rank_that_did_not_enter_is_named_with_the_collective_and_the_waiting_ranks",
        ),
        "a rank that completed its last collective read as waiting in it",
    ),
    M(
        "flight-consequence-first",
        "llmctl/launch/flight.py",
        "return [line for _, line in sorted(found, key=lambda f: f[0])]",
        "return [line for _, line in sorted(found, key=lambda f: not f[0])]",
        (
            "tests/launch/test_flight.py::test_groups_of_one_dimension_are_told_apart_by_members_and_the_cause_comes_first",
        ),
        "a group whose ranks behind wait in another group listed before the cause",
    ),
    # --- issue 51: five more, written after the tests, in the newest modules (expert and pipeline parallelism) ------
    M(
        "ep-owner-round-robin",
        "llmctl/spec/experts.py",
        "return expert // self.local_experts",
        "return expert % self.ep",
        ("tests/spec/test_expert_rules.py",),
        "experts dealt round-robin over the ep ranks (the engine holds consecutive blocks of E/ep)",
    ),
    M(
        "ep-divides-unchecked",
        "llmctl/spec/experts.py",
        "    if num_experts % ep:\n",
        "    if num_experts < ep:\n",
        ("tests/spec/test_expert_rules.py",),
        "an ep that does not divide the routed experts accepted (only one larger than E refused)",
    ),
    M(
        "ep-dispatch-sends-all",
        "llmctl/spec/experts.py",
        "return rows * (ep - 1) / ep, rows * imbalance",
        "return float(rows), rows * imbalance",
        ("tests/spec/test_expert_rules.py",),
        "the 1/ep of a rank's rows that stay on it priced as sent",
    ),
    M(
        "ep-buffer-no-send-copy",
        "llmctl/plan/memory/experts.py",
        "most = max(most, int(setup.compute_bytes * spec.hidden_size * (tokens * k + received)))",
        "most = max(most, int(setup.compute_bytes * spec.hidden_size * received))",
        ("tests/plan/test_ep_memory.py",),
        "the dispatch buffers without the sorted copy of the rows a rank sends",
    ),
    M(
        "ep-send-split-axis",
        "llmctl/engine/experts.py",
        "send = counts.view(grp.size, local).sum(1).tolist()",
        "send = counts.view(grp.size, local).sum(0).tolist()",
        # slow-ish: about a minute under load (torch, transformers and a tiny MoE's forward and backward)
        ("tests/engine/test_expert_dispatch.py::test_dispatch_equals_the_experts_loop",),
        "the dispatch's send splits summed over the wrong axis: per local expert, not per destination rank",
    ),
    M(
        "pp-eval-tokens-ignored",
        "llmctl/engine/pipeline.py",
        "tokens = int((part.targets != IGNORE).sum())",
        "tokens = part.targets.numel()",
        ("tests/engine/test_pipeline_stages.py::test_evaluation_counts_the_loss_tokens_it_summed_over",),
        "the evaluation's loss tokens count the ignored (padding, prompt) targets: the eval loss too low",
    ),
)

KNOWN_EQUIVALENT: dict[str, str] = {}
"""Mutant id -> why no test can tell it from the original (none so far)."""


def scratch_tree(root: Path) -> Path:
    """The tracked files (and the venv's link) copied to root/tree once: mutants are applied there."""
    tree = root / "tree"
    if tree.exists():
        shutil.rmtree(tree)
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        src, dst = REPO / f, tree / f
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    return tree


def run_mutant(m: Mutant, tree: Path) -> tuple[str, float, str]:
    """(verdict, seconds, detail): killed, survived, not run (its tests skipped here) or error."""
    target = tree / m.path
    text = target.read_text()
    if text.count(m.old) != 1:
        return "error", 0.0, f"`old` found {text.count(m.old)} times in {m.path} (the code moved: update the mutant)"
    target.write_text(text.replace(m.old, m.new))
    t0 = time.time()
    try:
        env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
        env.pop("LLMCTL_DEBUG", None)
        p = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        target.write_text(text)
    secs = time.time() - t0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("FAILED") or ln.startswith("ERROR")]
    if p.returncode == 1:
        return "killed", secs, lines[0] if lines else "a test failed"
    if p.returncode == 0 and " passed" not in p.stdout:
        return "not run", secs, "its tests were skipped here: " + (p.stdout.strip().splitlines() or [""])[-1]
    if p.returncode == 0:
        return "survived", secs, "every covering test passed"
    return "error", secs, f"pytest exited {p.returncode}: {(p.stdout + p.stderr).strip().splitlines()[-1:]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma list of mutant ids")
    ap.add_argument("--dir", default="/tmp/llmctl-mutants", help="scratch folder (default /tmp/llmctl-mutants)")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.id in args.only.split(",")]
    if not chosen:
        print(f"mutants: no mutant named {args.only}", file=sys.stderr)
        return 2
    tree = scratch_tree(Path(args.dir))
    results = []
    for m in chosen:
        verdict, secs, detail = run_mutant(m, tree)
        results.append((m, verdict))
        print(f"{verdict:8s} {secs:6.1f} s  {m.id:22s} {m.what}: {detail}", flush=True)
    killed = sum(v == "killed" for _, v in results)
    survivors = [m for m, v in results if v == "survived"]
    errors = [m for m, v in results if v == "error"]
    ran = [m for m, v in results if v != "not run"]
    print(f"\n{killed} of {len(ran)} mutants killed ({killed / max(1, len(ran)):.0%})", end="")
    print(f"; {len(results) - len(ran)} not run here (their tests skip)" if len(ran) < len(results) else "")
    for m in survivors:
        why = KNOWN_EQUIVALENT.get(m.id, "NOT EXPLAINED: add a test that kills it, or say why it is equivalent")
        print(f"  survivor {m.id} ({m.path}): {why}")
    for m in errors:
        print(f"  error {m.id} ({m.path})")
    unexplained = [m for m in survivors if m.id not in KNOWN_EQUIVALENT]
    return 1 if unexplained or errors else 0


if __name__ == "__main__":
    sys.exit(main())
