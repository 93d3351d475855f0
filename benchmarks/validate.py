"""Every published training run with a source, predicted by llmctl's planner with the run's setup pinned: one table
of planned vs published tokens/s (TFLOP/s per GPU where that is what was published) and peak memory, and the median
error. Nothing in llmctl is fitted to these runs: the table measures the planner's error.

The runs, their sources and the quotes are data (benchmarks/published_runs.yaml). For each run the planner gets
the run's model, GPUs, network, sequence, global batch and every decision the source gives, pinned; what the source
leaves out (null) is searched, as `llmctl plan` would with those flags, and the row is marked `*`. Where the setup
does not fit in llmctl's memory model the pinned setup is timed anyway (`evaluate`), and the row says so. A run the
planner cannot predict at all (a model family or a precision recipe llmctl does not have) is a row that says why.

Run: .venv/bin/python benchmarks/validate.py [--runs FILE] [--markdown]   (or `make validate`)
Exit status 0: it reports, it does not gate; 2 when the data file is malformed.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmctl.errors import DoesNotFitError, InputError, LlmctlError  # noqa: E402
from llmctl.plan import memory as mem  # noqa: E402
from llmctl.plan.network import network_for  # noqa: E402
from llmctl.plan.planner import plan  # noqa: E402
from llmctl.plan.request import PlanRequest  # noqa: E402
from llmctl.plan.space import PP_WITH_CP  # noqa: E402
from llmctl.plan.timing import Candidate, evaluate  # noqa: E402
from llmctl.spec import hardware, models  # noqa: E402
from llmctl.spec.interconnect import default_interconnect  # noqa: E402
from llmctl.spec.setup import TrainSetup  # noqa: E402
from llmctl.units import GIB  # noqa: E402

RUNS = Path(__file__).with_name("published_runs.yaml")
METRICS = {
    "tokens_per_s_per_gpu": "tok/s/GPU",
    "tokens_per_s": "tok/s",
    "tflops_per_gpu": "TFLOP/s/GPU",
}
PINNED = ("strategy", "tp", "cp", "pp", "pp_schedule", "checkpointing", "attention", "compile")
"""Decisions a run gives by the same name as llmctl's (the micro-batch is `micro_batch` in the data). Async TP is
not a pin: the planner turns it on wherever it prices it (tp > 1, compile, Hopper or Blackwell on NVLink,
llmctl.plan.request.PlanRequest.async_tp); a run that says otherwise has its chosen setup re-timed with the run's
value (`evaluate`)."""
REFUSAL = re.compile(r"no setup satisfies .*?: (.*?)(?:; with CPU offload|$)")
FIT_REASON = re.compile(r"needs [\d.,]+ GiB per GPU > [\d.,]+ GiB")
REQUIRED = ("id", "source", "model", "gpu", "nodes", "gpus_per_node", "precision", "seq_len", "published")
# The catalog's convention for memory a datasheet states in GB when no driver reading is known
# (llmctl/spec/presets/gpus.yaml, header): GB x 10^9 / 2^20, less 1.5%.
DATASHEET_MEMORY_DISCOUNT = 0.985


class DataError(Exception):
    """The data file is malformed: one line naming the run and the field."""


@dataclass(frozen=True)
class Row:
    """One run's line of the table."""

    id: str
    setup: str
    metric: str
    published: float
    planned: float | None = None
    memory_published_gib: float | None = None
    memory_planned_gib: float | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        return None if self.planned is None else self.planned / self.published

    @property
    def memory_ratio(self) -> float | None:
        if self.memory_planned_gib is None or not self.memory_published_gib:
            return None
        return self.memory_planned_gib / self.memory_published_gib


def load_runs(path: Path = RUNS) -> list[dict[str, Any]]:
    """The runs of the data file, each checked for the fields the table needs and a source with its quote."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise DataError(f"{path}: {e}") from None
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, list) or not runs:
        raise DataError(f"{path}: no `runs:` list")
    seen: set[str] = set()
    for i, run in enumerate(runs):
        where = f"{path}: run {run.get('id', i + 1) if isinstance(run, dict) else i + 1}"
        if not isinstance(run, dict):
            raise DataError(f"{where}: not a mapping")
        missing = [k for k in REQUIRED if run.get(k) is None]
        if missing:
            raise DataError(f"{where}: missing {', '.join(missing)}")
        if run["id"] in seen:
            raise DataError(f"{where}: duplicate id")
        seen.add(run["id"])
        src = run["source"]
        if not isinstance(src, dict) or not str(src.get("ref", "")).strip() or not str(src.get("quote", "")).strip():
            raise DataError(f"{where}: source needs a ref and the quoted row")
        pub = run["published"]
        if pub.get("metric") not in METRICS or not isinstance(pub.get("value"), int | float) or pub["value"] <= 0:
            raise DataError(f"{where}: published needs a metric ({', '.join(METRICS)}) and a positive value")
    return runs


def setup_label(run: dict[str, Any]) -> str:
    """'llama-3.1-8b, 8 x H100-SXM, FSDP 8, TP 8, fp8-tensorwise, 8k, mb 2 / 16': what ran, in one cell."""
    world = run["nodes"] * run["gpus_per_node"]
    tp, cp, pp = (run.get(k) or 1 for k in ("tp", "cp", "pp"))
    gpu = f"{run['gpu_as_run']}†" if run.get("gpu_as_run") else run["gpu"]
    strategy = {"full_shard": "FSDP", "hybrid_shard": "HSDP", "no_shard": "DDP"}.get(run.get("strategy") or "", "")
    layout = [f"{strategy} {world // (tp * cp * pp)}" if strategy else ""]
    asy = " async" if run.get("async_tp") else ""
    layout += [f"{name} {d}{asy if name == 'TP' else ''}" for name, d in (("TP", tp), ("CP", cp), ("PP", pp)) if d > 1]
    if run.get("pp_schedule"):
        layout.append(run["pp_schedule"])
    seq = run["seq_len"]
    seq_s = f"{seq // 1024}k" if seq >= 1024 and seq % 1024 == 0 else str(seq)
    mb = run.get("micro_batch")
    gb = run.get("global_batch")
    batch = f"mb {mb if mb is not None else '?'} / {gb if gb is not None else '?'}"
    ckpt = run.get("checkpointing") or "ckpt ?"
    extra = [x for x in (ckpt, "compile" if run.get("compile") else "") if x]
    model = run["model"]
    parts = [model, f"{world} x {gpu}", ", ".join(x for x in layout if x), run["precision"], seq_s, batch, *extra]
    return ", ".join(p for p in parts if p)


def gpu_of(run: dict[str, Any]) -> hardware.GPUSpec:
    """The catalog's GPU, with the facts the source states about the run's own GPU where it differs."""
    gpu = hardware.resolve_gpu(run["gpu"])
    over = run.get("gpu_overrides") or {}
    if "memory_gb" in over:
        gpu = replace(gpu, memory_bytes=int(over["memory_gb"] * 1e9 * DATASHEET_MEMORY_DISCOUNT))
    if "hbm_gbytes_s" in over:
        gpu = replace(gpu, hbm_gbytes_s=float(over["hbm_gbytes_s"]))
    return gpu


def request_for(run: dict[str, Any]) -> PlanRequest:
    """The planner's request for the run: its cluster and network, its batch, the decisions it gives pinned."""
    gpu = gpu_of(run)
    inter = run.get("inter_node_gbps") or default_interconnect(gpu).inter_node_gbps
    cluster = hardware.make_cluster(
        f"run {run['id']}",
        gpu=run["gpu"],
        nodes=run["nodes"],
        gpus_per_node=run["gpus_per_node"],
        inter_node_gbps=inter,
    )
    pins = {k: run[k] for k in PINNED if run.get(k) is not None}
    if run.get("micro_batch") is not None:
        pins["micro_batch_size"] = run["micro_batch"]
    return PlanRequest(
        spec=models.resolve_model(run["model"]),
        gpu=gpu,
        nodes=run["nodes"],
        gpus_per_node=run["gpus_per_node"],
        network=network_for(cluster),
        seq_len=run["seq_len"],
        global_batch_seqs=run.get("global_batch"),
        precision=run["precision"],
        pins=pins,
        nodes_exact=True,
        explain=False,
    )


def pinned_setup(req: PlanRequest, run: dict[str, Any]) -> TrainSetup:
    """The run's setup as given, the decisions it leaves out at TrainSetup's defaults, the accumulation from the
    global batch (for `evaluate` where the planner finds that the setup does not fit)."""
    fields = {k: v for k, v in req.pins.items() if k in {f for f in TrainSetup.__dataclass_fields__}}
    setup = replace(req.base, **fields, nodes=req.nodes)
    per_step = setup.tokens_per_step // setup.seq_len  # sequences per step at one accumulation step
    accum = max(1, req.global_batch // per_step) if per_step else 1
    return replace(setup, grad_accum_steps=accum)


def predict(run: dict[str, Any]) -> Row:
    """The run's row: the planner's prediction against the published figures, or why there is none."""
    pub = run["published"]
    row = Row(
        id=run["id"],
        setup=setup_label(run),
        metric=pub["metric"],
        published=float(pub["value"]),
        memory_published_gib=pub.get("memory_gib"),
    )
    notes = []
    if run.get("not_planned"):
        return replace(row, note="not planned: " + run["not_planned"])
    try:
        req = request_for(run)
    except LlmctlError as e:
        return replace(row, note=f"not planned: {e.message}")
    searched = [k for k in (*PINNED, "micro_batch") if k in run and run[k] is None]
    try:
        try:
            cand: Candidate = plan(req).chosen
        except InputError as e:  # pins the planner does not search together (--pp with --cp): priced as given
            if PP_WITH_CP not in e.message:
                raise
            raise DoesNotFitError(f"no setup satisfies the pins: {PP_WITH_CP}") from None
    except DoesNotFitError as e:
        setup = pinned_setup(req, run)
        est = mem.estimate(req.spec, setup)
        cand = evaluate(req, setup)
        cand = replace(cand, predicted=replace(cand.predicted, memory_per_gpu_bytes=est.device_bytes))
        why = FIT_REASON.search(e.message)
        rest = f", the rest at {_decided(cand.setup, searched)}" if searched else ""
        if why:
            notes.append(f"does not fit in llmctl's memory model ({why.group(0)}): timed as given{rest}")
        else:
            refusal = REFUSAL.match(e.message)
            reason = refusal.group(1) if refusal else e.message.split("; with CPU offload")[0]
            notes.append(f'the planner refuses these pins ("{reason}"): timed as given{rest}')
        searched = []
    except LlmctlError as e:
        return replace(row, note=f"not planned: {e.message}")
    if run.get("async_tp") is not None and cand.setup.async_tp != run["async_tp"]:
        again = evaluate(req, replace(cand.setup, async_tp=run["async_tp"]))
        kept = cand.predicted.memory_per_gpu_bytes  # async TP moves no bytes of memory
        cand = replace(again, predicted=replace(again.predicted, memory_per_gpu_bytes=kept))
    p, s = cand.predicted, cand.setup
    if searched:
        notes.append("* searched: " + _decided(s, searched))
    elif run.get("global_batch") is None:
        notes.append(f"* global batch llmctl's default, mb {s.micro_batch_size} x {s.grad_accum_steps}")
    planned = {
        "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
        "tokens_per_s": p.tokens_per_s,
        "tflops_per_gpu": p.mfu_palm * req.gpu.peak_tflops("bf16"),
    }[row.metric]
    return replace(row, planned=planned, memory_planned_gib=p.memory_per_gpu_bytes / GIB, note="; ".join(notes))


def _decided(s: TrainSetup, names: list[str]) -> str:
    """What the planner chose (or the defaults were) for the decisions a run leaves out."""
    said = {
        "micro_batch": f"mb {s.micro_batch_size} x {s.grad_accum_steps}",
        "checkpointing": f"checkpointing {s.checkpointing}",
        "attention": str(s.attention),
        "compile": "compile" if s.compile else "no compile",
        "pp_schedule": f"{s.pp_schedule}",
    }
    return ", ".join(said.get(k, k) for k in names)


def median_abs_error(rows: list[Row]) -> float | None:
    """Median of |planned / published - 1| over the rows with a prediction."""
    errs = [abs(r.ratio - 1) for r in rows if r.ratio is not None]
    return statistics.median(errs) if errs else None


def _num(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}{unit}" if x >= 100 else f"{x:,.1f}{unit}"


def render(rows: list[Row], runs: list[dict[str, Any]]) -> str:
    """The table (markdown), with the median errors under it."""
    out = [
        "| run | setup | metric | published | planned | planned / published | memory GiB published / planned | note |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        memory = f"{_num(r.memory_published_gib)} / {_num(r.memory_planned_gib)}"
        if r.memory_ratio is not None:
            memory += f" ({r.memory_ratio:.2f})"
        cells = (r.id, r.setup, METRICS[r.metric], _num(r.published), _num(r.planned), ratio, memory, r.note)
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    out.extend(footnotes(runs))
    out.append(summary(rows))
    return "\n".join(out)


def footnotes(runs: list[dict[str, Any]]) -> list[str]:
    """One line per GPU the catalog lacks (a run's `gpu_as_run`), saying what was planned in its place."""
    out = {}
    for run in runs:
        if run.get("gpu_as_run"):
            over = run.get("gpu_overrides") or {}
            facts = [f"{over['memory_gb']} GB" for _ in [0] if "memory_gb" in over]
            facts += [f"{over['hbm_gbytes_s'] / 1000:g} TB/s" for _ in [0] if "hbm_gbytes_s" in over]
            stated = f" with the memory and bandwidth the source states ({', '.join(facts)})" if facts else ""
            out[run["gpu_as_run"]] = (
                f"† {run['gpu_as_run']}: not in llmctl's GPU catalog; planned as {run['gpu']}{stated}.  "
            )
    return [*out.values(), ""] if out else []


def summary(rows: list[Row]) -> str:
    """One paragraph: how many runs, how many planned, the median errors of speed and memory."""
    planned = [r for r in rows if r.ratio is not None]
    med = median_abs_error(rows)
    ratios = [r.ratio for r in planned]
    mem_errs = [abs(r.memory_ratio - 1) for r in planned if r.memory_ratio is not None]
    lines = [f"{len(rows)} published runs, {len(planned)} planned ({len(rows) - len(planned)} not: see the notes)."]
    if med is not None:
        lines.append(
            f"Speed: median |planned / published - 1| = {med:.0%}; median planned / published = "
            f"{statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})."
        )
    if mem_errs:
        lines.append(
            f"Memory ({len(mem_errs)} runs that publish it): median |planned / published - 1| = "
            f"{statistics.median(mem_errs):.0%}."
        )
    return " ".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, default=RUNS, help="the data file (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        runs = load_runs(args.runs)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render([predict(r) for r in runs], runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
