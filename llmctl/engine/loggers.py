"""TensorBoard and Weights & Biases: the run's metrics where people look at them (rank 0, extra [logging]).

metrics.jsonl stays the source of truth (llmctl.engine.metrics); these sinks get the same step and eval records,
mapped to metric names by `scalars`. One run across restarts: the run id is stored in every checkpoint (trainer
state) and read back on resume, so a requeued or resumed job continues the same W&B run (`resume="allow"`), and
the TensorBoard writer reopens the same folder with `purge_step` = the resumed step + 1, which hides anything a
crashed attempt logged past the checkpoint (no repeated steps). A run that starts from step 0 gets a new id.

The W&B API key only ever comes from the environment (WANDB_API_KEY or `wandb login`): the plan schema has no
field for it, and nothing here writes it.
"""

from __future__ import annotations

import importlib.util
import secrets
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from llmctl.errors import InputError, RuntimeFailure, one_line
from llmctl.spec.planfile import LoggingSection, WandbSection

# record key -> metric name (the slash groups them into sections in both UIs)
_NAMES = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "tokens_per_s_per_gpu": "perf/tokens_per_s_per_gpu",
    "mfu": "perf/mfu",
    "mfu_palm": "perf/mfu_palm",
    "step_time_s": "perf/step_time_s",
    "model_tflops_per_gpu": "perf/model_tflops_per_gpu",
    "peak_mem_allocated_bytes": "memory/peak_allocated_bytes",
    "peak_mem_reserved_bytes": "memory/peak_reserved_bytes",
    "peak_rss_bytes": "memory/peak_rss_bytes",
    "val_loss": "eval/loss",
    "val_ppl": "eval/ppl",
}


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a step or eval record under their metric names; the plan's predictions as predicted/*."""
    out: dict[str, float] = {}
    for k, v in record.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        if k.endswith("_predicted") and k.removesuffix("_predicted") in _NAMES:
            out["predicted/" + _NAMES[k.removesuffix("_predicted")].split("/", 1)[1]] = float(v)
        elif k in _NAMES:
            out[_NAMES[k]] = float(v)
    return out


def new_run_id() -> str:
    """8 characters of [a-z0-9], the shape of W&B's own ids."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def check_installed(cfg: LoggingSection) -> None:
    """Before anything starts: a logger the plan asks for must be importable (one line naming the extra)."""
    for on, module, key in (
        (cfg.tensorboard, "tensorboard", "logging.tensorboard"),
        (cfg.wandb, "wandb", "logging.wandb"),
    ):
        if on and importlib.util.find_spec(module) is None:
            raise InputError(f"{key}: the {module} package is not installed", hint="pip install 'llmctl[logging]'")


class Sink(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    def __init__(self, folder: Path, start_step: int, plan_yaml: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events of a crashed attempt at steps >= start + 1 are hidden by TensorBoard's reader.
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=start_step + 1)
        if start_step == 0:
            self.writer.add_text("plan", "    " + plan_yaml.replace("\n", "\n    "), 0)  # markdown code block

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, cfg: WandbSection, run_id: str, folder: Path, name: str, config: dict[str, Any]) -> None:
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=cfg.project,
                entity=cfg.entity,
                name=cfg.name or name,
                tags=cfg.tags or None,
                mode=cfg.mode,
                id=run_id,
                resume="allow",
                dir=str(folder),
                config=config,
                # The engine's console is its own (progress line, events); no stdout capture, no system sampler.
                settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
            )
        except Exception as e:  # wandb raises its own types (UsageError: no API key, CommError: no network)
            raise RuntimeFailure(
                one_line(f"logging.wandb: wandb.init failed: {type(e).__name__}: {e}"),
                hint="online mode needs WANDB_API_KEY in the environment (or `wandb login`); "
                "mode: offline needs no network",
            ) from None

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


@dataclass(frozen=True)
class RunRecord:
    """What a logger records about the run besides its numbers."""

    name: str
    """The plan's name (W&B's run name unless logging.wandb.name is set)."""
    plan_yaml: str
    """The plan as written into the checkpoint (TensorBoard's text tab)."""
    config: dict[str, Any]
    """The plan as JSON (W&B's run config)."""


def open_sinks(cfg: LoggingSection, run_id: str, start_step: int, run: RunRecord) -> list[Sink]:
    """The loggers logging.* asks for, opened at `start_step`."""
    root = Path(cfg.dir)
    sinks: list[Sink] = []
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(root / "tensorboard", start_step, run.plan_yaml))
    if cfg.wandb is not None:
        sinks.append(WandbSink(cfg.wandb, run_id, root, run.name, run.config))
    return sinks
