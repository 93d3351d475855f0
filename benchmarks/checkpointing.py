"""Activation checkpointing and the chunked loss on the CPU: what each mode keeps for backward and what it costs in
step time, measured, with llmctl's memory model and FLOPs model beside every figure.

The model is the `llama-tiny` preset with overrides (default: 4 layers, hidden 256, intermediate 688, 8 heads / 2
kv heads, a 16384-token vocabulary: V/h = 64, more vocabulary-heavy than Llama 3 8B's 128256/4096 = 31, so the
b*s*V logits are about as large as all the layers' activations; no vocabulary padding), sdpa attention, fp32 (the CPU's
sensible precision; --precision bf16 for a pure-bf16 model), micro-batch 4 x 256 tokens.
Rows: none, partial:K (default K=2), selective, full, and none / selective with the chunked loss
(training.loss_chunk_tokens, default 256 tokens).

Per row, two measurements:

(a) In this process, one micro-batch, no FSDP: the model is built with transformers from the very config the engine
    builds (llmctl.engine.model.model_spec_for of the row's plan), the engine's
    `apply_activation_checkpointing(model, mode)` is applied and, for chunked rows, `install_loss_forward(model,
    "chunked", V, N)`; otherwise the loss is the engine's `whole_loss`. `llmctl.measure.memtrack.measure_step` runs
    forward + backward and reports every byte the step itself allocates (parameters and the batch excluded):
    - saved:    held after forward for backward (the loss scalar aside).
                Predicted = stage_activation_bytes(all layers, mode) + shared_activation_bytes + head_activation_bytes
                + the loss: whole 4*b*s*V (the fp32 log-softmax cross-entropy saves; the logits themselves die when
                whole_loss returns), chunked 0 (each chunk is checkpointed; its input is the LM-head input already
                counted). head_activation_bytes counts the token ids (2 x 8*b*s), which the measurement excludes as
                the batch (16 KiB at the defaults).
    - bwd peak: the most bytes alive at once during backward, parameter gradients included (measure_step's
                backward_peak_bytes). Predicted = the activation part of `estimate()`'s backward phase for this
                setup on one device: every backward-phase component except the model-state ledger lines
                (parameters, gradients, optimizer states), i.e. activations + recomputed block (checkpointed modes)
                + final norm / LM-head input + whole: the fp32 log-softmax (4*b*s*V) and loss backward buffers
                (2 x 4*b*s*V); chunked: loss_chunk_backward_bytes (max(12*N*V, 8*N*V + act*V*h)). The estimate
                adds these up as if all were alive at once; the measurement says when they really are.
(b) A real engine run (`python -m torch.distributed.run --nproc_per_node 2 -m llmctl.engine PLAN`, gloo, 2 ranks,
    full_shard FSDP2, AdamW, synthetic tokens, --steps steps, a step record every step, OMP_NUM_THREADS=1 per rank):
    - step s:       median step_time_s of metrics.jsonl over the steps after the first --warmup (over all
                    --rounds runs of the row: with --rounds R each row runs R times, the rows in a rotated order).
    - vs none:      that step time / the `none` row's.
    - FLOPs vs none: hardware_flops_per_token(spec, s, mode, "sdpa", chunked) / model_flops_per_token(spec, s),
                    the predicted cost of the recomputation (the `none` row's is 1).
    - peak RSS:     rank 0's peak resident set (the last step record's peak_rss_bytes, ru_maxrss: imports, the
                    runtime and everything the step allocated); "RSS +" is that minus rank 0's RSS before the model
                    was built (the start event's rss_before_model_bytes), beside `estimate()`'s peak allocated
                    bytes per rank for the same 2-rank full_shard setup ("est. peak"). RSS is a loose yardstick
                    (malloc keeps freed pages, gloo and the data loader have buffers), shown to see whether the
                    checkpointing savings reach the process's footprint.
    - others %:     CPU time the rest of the machine used during the row's engine run (/proc/stat busy time minus
                    the engine processes' own CPU time), as a share of all CPUs x wall time (the most of any round):
                    step times are only comparable between rows with little of it (Linux only; "-" elsewhere). It
                    cannot see a virtual machine's host: on the shared 2-core VM this was written on, the `none` row
                    measured 1.19 and 1.73 s/step in two runs minutes apart, both at 0%; --rounds 3 averages over such spells.

Nothing is hard-coded: every figure is measured or computed by llmctl's functions at run time. The default run
takes 3 to 4.5 minutes on 2 cores (six engine runs of 25-40 s each dominate; the script prints its own wall time;
--vocab 32768 takes about 7, --rounds R about R times as long); --quick is a smaller model and fewer steps, for a
smoke check (under 2 minutes).

Run: .venv/bin/python benchmarks/checkpointing.py [--layers 4] [--hidden 256] [--vocab 16384] [--seq-len 256]
     [--micro-batch 4] [--steps 12] [--precision fp32|bf16] [--chunk 256] [--partial 2] [--rounds 1]
     [--json FILE] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from llmctl.engine.model import base_spec, model_spec_for  # noqa: E402
from llmctl.plan import flops as fl  # noqa: E402
from llmctl.plan import memory as mem  # noqa: E402
from llmctl.spec import checkpointing as ckpt_modes  # noqa: E402
from llmctl.spec.models import ModelSpec  # noqa: E402
from llmctl.spec.planfile import plan_from_dict  # noqa: E402
from llmctl.spec.precision import policy  # noqa: E402
from llmctl.spec.setup import TrainSetup  # noqa: E402

PRESET = "llama-tiny"
ATTENTION = "sdpa"
MIB = 1024**2


# --- setup -------------------------------------------------------------------------------------------------------
def rows(a: argparse.Namespace) -> list[tuple[str, int]]:
    """(checkpointing mode, loss chunk tokens) of every row."""
    return [
        ("none", 0),
        (f"partial:{a.partial}", 0),
        ("selective", 0),
        ("full", 0),
        ("none", a.chunk),
        ("selective", a.chunk),
    ]


def row_name(mode: str, chunk: int) -> str:
    return f"{mode} + loss chunk {chunk}" if chunk else mode


def plan_dict(a: argparse.Namespace, mode: str, chunk: int, log_dir: Path) -> dict[str, Any]:
    return {
        "name": "bench-checkpointing",
        "model": {
            "preset": PRESET,
            "overrides": {
                "num_hidden_layers": a.layers,
                "hidden_size": a.hidden,
                "intermediate_size": a.intermediate,
                "num_attention_heads": a.heads,
                "num_key_value_heads": a.kv_heads,
                "vocab_size": a.vocab,
                "max_position_embeddings": max(2048, a.seq_len),
            },
            # No padded LM-head rows: the in-process model, the engine's and the memory model then have one V.
            "pad_vocab_multiple": 1,
        },
        "data": {"kind": "synthetic"},
        "hardware": {"nodes": 1, "nproc_per_node": a.ranks},
        "parallel": {"sharding": "full_shard"},
        "training": {
            "precision": a.precision,
            "micro_batch_size": a.micro_batch,
            "grad_accum_steps": 1,
            "seq_len": a.seq_len,
            "max_steps": a.steps,
            "seed": 0,
            "attention": ATTENTION,
            "activation_checkpointing": mode,
            "loss_chunk_tokens": chunk,
        },
        "optimizer": {"lr": 3e-4, "warmup_steps": 2},
        "logging": {"dir": str(log_dir), "interval_steps": 1},
    }


# --- (a) in-process measurement and the memory model ----------------------------------------------------------------
def measure_in_process(spec: ModelSpec, vocab: int, a: argparse.Namespace, mode: str, chunk: int) -> Any:
    """measure_step of one micro-batch of the engine's model in `mode` (llmctl.measure.memtrack.StepMemory)."""
    import torch
    import transformers

    from llmctl.engine.loss import install_loss_forward, whole_loss
    from llmctl.engine.parallelize import apply_activation_checkpointing
    from llmctl.measure.memtrack import measure_step

    cfg = dict(spec.hf_config)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.use_cache = False
    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float32
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION, dtype=dtype)
    model.config.use_cache = False
    model.train()
    apply_activation_checkpointing(model, mode)
    b, s = a.micro_batch, a.seq_len
    inputs = torch.randint(0, vocab, (b, s))
    targets = torch.randint(0, vocab, (b, s))
    if chunk:
        install_loss_forward(model, "chunked", vocab, chunk)

        def forward() -> Any:
            return model(input_ids=inputs, labels=targets)
    else:

        def forward() -> Any:
            return whole_loss(model, inputs, targets, vocab)

    return measure_step(model, forward, inputs, targets)


def train_setup(a: argparse.Namespace, mode: str, chunk: int, gpus: int) -> TrainSetup:
    """The memory model's setup of a row on `gpus` devices of one node (full_shard FSDP2, AdamW)."""
    return TrainSetup(
        precision=a.precision,
        optimizer="adamw",
        strategy="full_shard",
        gpus_per_node=gpus,
        micro_batch_size=a.micro_batch,
        seq_len=a.seq_len,
        checkpointing=mode,
        attention=ATTENTION,
        loss_chunk_tokens=chunk,
    )


def predicted_saved(spec: ModelSpec, vocab: int, a: argparse.Namespace, mode: str, chunk: int) -> int:
    """Bytes kept for backward after forward, by the memory model's functions (see the module docstring)."""
    b, s, ab = a.micro_batch, a.seq_len, policy(a.precision).compute_bytes
    layers = mem.stage_activation_bytes(spec, spec.num_layers, b, s, ab, ATTENTION, mode)
    shared = mem.shared_activation_bytes(spec, b, s, ab, ATTENTION)
    head = mem.head_activation_bytes(spec, b, s, ab)
    loss = 0 if chunk else 4 * b * s * vocab  # the fp32 log-softmax over the real vocabulary
    return layers + shared + head + loss


def predicted_backward(spec: ModelSpec, a: argparse.Namespace, mode: str, chunk: int) -> tuple[int, list[str]]:
    """The activation part of estimate()'s backward phase on one device, and the components it sums."""
    est = mem.estimate(spec, train_setup(a, mode, chunk, 1))
    parts = [c for c in est.components if "backward" in c.phases and c.bytes_per_param is None]
    return sum(c.bytes for c in parts), [f"{c.name}: {c.bytes / MIB:.2f} MiB" for c in parts]


# --- (b) the engine on 2 ranks ----------------------------------------------------------------------------------
def machine_busy_s() -> float | None:
    """CPU-seconds the whole machine has been busy since boot (/proc/stat: all but idle and iowait), or None."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """CPU-seconds of this process's finished children (torchrun and the ranks it waited for)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_engine(a: argparse.Namespace, mode: str, chunk: int, work: Path) -> dict[str, Any]:
    """Write the row's plan, run the engine under torchrun, read its metrics.jsonl."""
    import yaml

    work.mkdir(parents=True)
    scratch = work / "scratch"
    scratch.mkdir()
    plan_path = work / "plan.yaml"
    plan_path.write_text(yaml.safe_dump(plan_dict(a, mode, chunk, work / "logs"), sort_keys=False))
    env = dict(
        os.environ,
        TMPDIR=str(scratch),
        TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("LLMCTL_DEBUG", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.ranks}"]
    cmd += ["-m", "llmctl.engine", str(plan_path)]
    busy0, own0, t0 = machine_busy_s(), children_cpu_s(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    busy1, own1 = machine_busy_s(), children_cpu_s()
    others = None
    if busy0 is not None and busy1 is not None:
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (wall * (os.cpu_count() or 1))
    if proc.returncode != 0:
        raise SystemExit(
            f"engine run {row_name(mode, chunk)!r} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    recs = [json.loads(x) for x in (work / "logs" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    start = next(r for r in recs if r["event"] == "start")
    steps = [r for r in recs if r["event"] == "step"]
    timed = [r["step_time_s"] for r in steps if r["step"] > a.warmup]
    if not timed:
        raise SystemExit(f"--steps {a.steps} leaves no step after the {a.warmup} warm-up steps")
    if start["checkpointing"] != mode or start["loss_chunk_tokens"] != chunk:
        raise SystemExit(f"the engine ran {start['checkpointing']}/{start['loss_chunk_tokens']}, not {mode}/{chunk}")
    return {
        "step_time_s": statistics.median(timed),
        "step_times_s": timed,
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in steps),
        "rss_before_model_bytes": start["rss_before_model_bytes"],
        "rss_per_rank_bytes": start["rss_per_rank_bytes"],
        "loss_impl": start["loss_mode"],
        "attention": start["attention"],
        "final_loss": steps[-1]["loss"],
        "wall_s": wall,
        "engine_cpu_s": own1 - own0,
        "others_cpu_share": others,
    }


# --- output ------------------------------------------------------------------------------------------------------
COLUMNS = [  # (header line 1, header line 2, width)
    ("mode", "", 0),  # as wide as the longest row name
    ("saved MiB", "measured", 10),
    ("saved MiB", "predicted", 10),
    ("saved", "pred/meas", 10),
    ("bwd peak", "measured", 10),
    ("bwd peak", "predicted", 10),
    ("bwd peak", "pred/meas", 10),
    ("step", "s", 8),
    ("step time", "vs none", 10),
    ("pred FLOPs", "vs none", 11),
    ("peak RSS", "MiB", 9),
    ("RSS +", "MiB", 7),
    ("est. peak", "MiB", 10),
    ("others", "%", 8),
]


def table(results: list[dict[str, Any]]) -> list[str]:
    width = max(len(r["row"]) for r in results) + 2

    def line(cells: list[str]) -> str:
        first = f"{cells[0]:<{width}}"
        return (first + "".join(f"{c:>{w}}" for c, (_, _, w) in zip(cells[1:], COLUMNS[1:]))).rstrip()

    out = [line([c[0] for c in COLUMNS]), line([c[1] for c in COLUMNS])]
    out.append("-" * len(out[0]))
    for r in results:
        out.append(
            line(
                [
                    r["row"],
                    f"{r['saved_bytes'] / MIB:.2f}",
                    f"{r['saved_predicted_bytes'] / MIB:.2f}",
                    f"{r['saved_pred_over_meas']:.4f}",
                    f"{r['backward_peak_bytes'] / MIB:.2f}",
                    f"{r['backward_peak_predicted_bytes'] / MIB:.2f}",
                    f"{r['backward_pred_over_meas']:.3f}",
                    f"{r['step_time_s']:.3f}" if "step_time_s" in r else "-",
                    f"{r['step_time_vs_none']:.3f}" if "step_time_vs_none" in r else "-",
                    f"{r['flops_vs_none']:.3f}",
                    f"{r['peak_rss_bytes'] / MIB:.0f}" if "peak_rss_bytes" in r else "-",
                    f"{r['rss_growth_bytes'] / MIB:.0f}" if "rss_growth_bytes" in r else "-",
                    f"{r['estimate_peak_bytes'] / MIB:.1f}",
                    f"{100 * r['others_cpu_share']:.0f}" if r.get("others_cpu_share") is not None else "-",
                ]
            )
        )
    return out


def span(results: list[dict[str, Any]], key: str, digits: int) -> str:
    vals = [(r[key], r["row"]) for r in results if key in r]
    lo, hi = min(vals), max(vals)
    return f"{lo[0]:.{digits}f} ({lo[1]}) .. {hi[0]:.{digits}f} ({hi[1]})"


def summary(results: list[dict[str, Any]]) -> list[str]:
    by = {r["row"]: r for r in results}
    none = results[0]
    out = [
        f"saved for backward, predicted / measured: {span(results, 'saved_pred_over_meas', 4)}",
        f"backward peak, predicted / measured:      {span(results, 'backward_pred_over_meas', 3)}",
    ]
    for r in results[1:]:
        meas = r["saved_bytes"] / none["saved_bytes"]
        pred = r["saved_predicted_bytes"] / none["saved_predicted_bytes"]
        out.append(f"saved vs none, {r['row']}: measured x{meas:.3f}, predicted x{pred:.3f}")
    if "step_time_s" in none:
        for r in results[1:]:
            out.append(
                f"step time vs none, {r['row']}: measured x{r['step_time_vs_none']:.3f}, predicted FLOPs "
                f"x{r['flops_vs_none']:.3f} (measured / predicted {r['step_time_vs_none'] / r['flops_vs_none']:.3f})"
            )
        shares = [(r["others_cpu_share"], r["row"]) for r in results if r.get("others_cpu_share") is not None]
        if shares:
            worst = max(shares)
            verdict = (
                "no other process here competed for the CPUs (a virtual machine's host still can: --rounds 3 "
                "averages that out)"
                if worst[0] < 0.05
                else "the step times, and their ratios between rows with different shares, include that load"
            )
            out.append(
                f"CPU used by other processes during the engine runs: at most {100 * worst[0]:.0f}% of the machine "
                f"({worst[1]}): {verdict}"
            )
    chunked = [r for r in results if r["chunk"]]
    for r in chunked:
        base = by[r["mode"]]
        meas = r["saved_bytes"] / base["saved_bytes"]
        pred = r["saved_predicted_bytes"] / base["saved_predicted_bytes"]
        peak = r["backward_peak_bytes"] / base["backward_peak_bytes"]
        out.append(
            f"loss chunk vs whole loss, {r['mode']}: saved x{meas:.3f} (predicted x{pred:.3f}), "
            f"backward peak x{peak:.3f}"
        )
    return out


# --- main ----------------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; --quick 2)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default 256; --quick 128)")
    ap.add_argument("--intermediate", type=int, default=None, help="MLP size (default: 8/3 hidden, multiple of 16)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default 8; --quick 4)")
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 16384; --quick 8192)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 256; --quick 128)")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (default 4; --quick 2)")
    ap.add_argument("--chunk", type=int, default=None, help="loss chunk tokens of the chunked rows (default 256)")
    ap.add_argument("--partial", type=int, default=2, help="K of the partial:K row")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--steps", type=int, default=None, help="engine steps per row (default 12; --quick 4)")
    ap.add_argument("--warmup", type=int, default=None, help="first steps left out of the step time (default 2)")
    ap.add_argument("--ranks", type=int, default=2, help="engine ranks (gloo processes)")
    ap.add_argument(
        "--rounds", type=int, default=1, help="engine runs per row, in a rotated order (step time: median over all)"
    )
    ap.add_argument("--no-engine", action="store_true", help="only the in-process measurement (no step times)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows to FILE as JSON")
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer steps (smoke check)")
    a = ap.parse_args()
    defaults = (
        {"layers": 2, "hidden": 128, "heads": 4, "vocab": 8192, "seq_len": 128, "micro_batch": 2, "chunk": 128}
        | {"steps": 4, "warmup": 1}
        if a.quick
        else {"layers": 4, "hidden": 256, "heads": 8, "vocab": 16384, "seq_len": 256, "micro_batch": 4, "chunk": 256}
        | {"steps": 12, "warmup": 2}
    )
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.intermediate is None:
        a.intermediate = 16 * math.ceil(8 * a.hidden / 3 / 16)  # Llama's 8h/3 rounded up (688 for hidden 256)
    if a.partial < 2:
        ap.error("--partial K needs K >= 2 (partial:1 is full)")
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")

    t_start = time.perf_counter()
    load_before = os.getloadavg()
    plan0 = plan_from_dict(plan_dict(a, "none", 0, Path("unused")), source="benchmark plan")
    spec, vocab = model_spec_for(plan0.model), base_spec(plan0.model).vocab_size
    b, s = a.micro_batch, a.seq_len
    print(
        f"{PRESET} + overrides: {spec.describe()}; micro-batch {b} x {s} tokens, {a.precision}, {ATTENTION}; "
        f"loss chunk {a.chunk} tokens; engine: {a.ranks} gloo ranks, full_shard, {a.steps} steps "
        f"(step time: median after {a.warmup}{f', {a.rounds} rounds' if a.rounds > 1 else ''})",
        flush=True,
    )

    results: list[dict[str, Any]] = []
    for mode, chunk in rows(a):
        ckpt_modes.parse(mode)
        t0 = time.perf_counter()
        m = measure_in_process(spec, vocab, a, mode, chunk)
        pred = predicted_saved(spec, vocab, a, mode, chunk)
        bwd_pred, bwd_parts = predicted_backward(spec, a, mode, chunk)
        hw = fl.hardware_flops_per_token(spec, s, mode, ATTENTION, chunk > 0)
        est2 = mem.estimate(spec, train_setup(a, mode, chunk, a.ranks))
        results.append(
            {
                "row": row_name(mode, chunk),
                "mode": mode,
                "chunk": chunk,
                "saved_bytes": m.saved_bytes,
                "saved_predicted_bytes": pred,
                "saved_pred_over_meas": pred / m.saved_bytes,
                "forward_peak_bytes": m.forward_peak_bytes,
                "backward_peak_bytes": m.backward_peak_bytes,
                "backward_peak_predicted_bytes": bwd_pred,
                "backward_pred_over_meas": bwd_pred / m.backward_peak_bytes,
                "backward_predicted_components": bwd_parts,
                "hardware_flops_per_token": hw,
                "model_flops_per_token": fl.model_flops_per_token(spec, s),
                "flops_vs_none": hw / fl.model_flops_per_token(spec, s),
                "estimate_peak_bytes": est2.peak_allocated_bytes,
                "estimate_peak_phase": est2.peak_phase,
                "measure_s": time.perf_counter() - t0,
            }
        )
        print(f"  measured {row_name(mode, chunk)} in process ({time.perf_counter() - t0:.1f} s)", flush=True)

    if not a.no_engine:
        runs: list[list[dict[str, Any]]] = [[] for _ in results]
        with tempfile.TemporaryDirectory(prefix="llmctl-bench-ckpt-") as d:
            for rnd in range(a.rounds):
                # Several rounds run the rows in a rotated order: a slow spell of the machine then falls on
                # different rows each round instead of always on the same one.
                order = list(range(len(results)))
                order = order[rnd % len(order) :] + order[: rnd % len(order)]
                for i in order:
                    r = results[i]
                    e = run_engine(a, r["mode"], r["chunk"], Path(d) / f"round{rnd}-row{i}")
                    runs[i].append(e)
                    print(
                        f"  engine {r['row']}{f' (round {rnd + 1})' if a.rounds > 1 else ''}: "
                        f"{e['step_time_s']:.3f} s/step, loss {e['loss_impl']}, final loss {e['final_loss']:.3f} "
                        f"({e['wall_s']:.0f} s)",
                        flush=True,
                    )
        for r, es in zip(results, runs):
            shares = [e["others_cpu_share"] for e in es if e["others_cpu_share"] is not None]
            r.update(
                {
                    "step_time_s": statistics.median(x for e in es for x in e["step_times_s"]),
                    "step_time_rounds_s": [e["step_time_s"] for e in es],
                    "step_times_s": [e["step_times_s"] for e in es],
                    "peak_rss_bytes": max(e["peak_rss_bytes"] for e in es),
                    "rss_growth_bytes": max(e["peak_rss_bytes"] - e["rss_before_model_bytes"] for e in es),
                    "rss_per_rank_bytes": [e["rss_per_rank_bytes"] for e in es],
                    "loss_impl": es[0]["loss_impl"],
                    "attention": es[0]["attention"],
                    "final_loss": es[-1]["final_loss"],
                    "engine_wall_s": [e["wall_s"] for e in es],
                    "engine_cpu_s": [e["engine_cpu_s"] for e in es],
                    "others_cpu_share": max(shares) if shares else None,
                }
            )
        for r in results:
            r["step_time_vs_none"] = r["step_time_s"] / results[0]["step_time_s"]

    wall = time.perf_counter() - t_start
    print()
    for ln in table(results):
        print(ln)
    print()
    for ln in summary(results):
        print(ln)
    print(
        f"\nwall time {wall:.0f} s; load average (1 min) {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after "
        f"({os.cpu_count()} CPUs)"
    )
    if a.json:
        payload = {
            "config": {k: v for k, v in vars(a).items() if k != "json"},
            "model": spec.describe(),
            "params": spec.params,
            "wall_s": wall,
            "rows": results,
        }
        Path(a.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"rows written to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
