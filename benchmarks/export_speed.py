"""`llmctl export` vs transformers' `save_pretrained` of the same model, side by side, in fresh processes.

The checkpoint: a `llama-tiny` model (4 layers, hidden 256, vocabulary 258 padded to 320: about 3.4M parameters, the
size issue 49 timed at 19 s) with --layers / --hidden overrides, saved in the engine's layout (torch.distributed
.checkpoint of {"model": state_dict} + plan.yaml + llmctl's marker) in a temporary folder, trained on text with the
byte tokenizer.

- llmctl export: `python -m llmctl export CKPT --out A` (weights from DCP, config, generation config, the byte
  tokenizer built and saved);
- save_pretrained: one process that imports torch and transformers, loads the same model and tokenizer
  (`AutoModelForCausalLM.from_pretrained(A)`, `AutoTokenizer.from_pretrained(A)`) and saves both with
  save_pretrained: the folder a user would get from transformers alone, the same weights read and written.
Both timed from process start to exit (what a user waits for), wall and CPU (user + system of the child), --rounds
rounds in alternating order, the median shown. The save_pretrained process also reports where its time goes
(importing torch and transformers, loading, saving): most of either command is importing torch and transformers,
which both pay. The load average is printed: on a shared machine wall times scale with it, CPU times much less.

Run: .venv/bin/python benchmarks/export_speed.py [--layers 4] [--hidden 256] [--rounds 3] [--json FILE] [--quick]
(default about 30 s on an idle 2-core machine; --quick: one round)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

SAVE_PRETRAINED = """
import json, sys, time
t0 = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
t1 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, local_files_only=True)
tok = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
t2 = time.perf_counter()
model.save_pretrained(sys.argv[2])
tok.save_pretrained(sys.argv[2])
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "save_s": t3 - t2}))
"""

MAKE_CHECKPOINT = """
import shutil, sys, warnings
from pathlib import Path
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoConfig, AutoModelForCausalLM
from llmctl.engine.checkpoint_files import write_marker
from llmctl.engine.model import model_spec_for
from llmctl.spec.planfile import load_plan

plan_path, step = Path(sys.argv[1]), Path(sys.argv[2])
cfg = dict(model_spec_for(load_plan(plan_path).model).hf_config)
torch.manual_seed(0)
net = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg), dtype=torch.float32)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # DCP warns that there is no process group: one process is the intent
    dcp.save({"model": net.state_dict()}, checkpoint_id=str(step), no_dist=True)
shutil.copy(plan_path, step / "plan.yaml")
write_marker(step)
print(sum(p.numel() for p in net.parameters()))
"""


def write_plan(folder: Path, layers: int, hidden: int) -> Path:
    import yaml

    plan = {
        "name": "bench-export",
        "model": {
            "preset": "llama-tiny",
            "overrides": {"num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": hidden * 688 // 256},
            "pad_vocab_multiple": 64,
        },
        "data": {"kind": "text", "paths": [str(REPO / "examples" / "corpus")]},
        "hardware": {"nodes": 1, "nproc_per_node": 1},
        "parallel": {"sharding": "full_shard"},
        "training": {"precision": "fp32", "micro_batch_size": 1, "seq_len": 128, "max_steps": 1},
        "checkpoint": {"dir": str(folder / "ckpt")},
        "logging": {"dir": str(folder / "logs")},
    }
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def timed(cmd: list[str]) -> tuple[float, float, str]:
    """(wall s, the child's CPU s, stdout) of one process run to its end."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed:\n{r.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, r.stdout


def run(a: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="bench-export-"))
    try:
        plan = write_plan(root, a.layers, a.hidden)
        step = root / "ckpt" / "step_00000001"
        _, _, out = timed([sys.executable, "-c", MAKE_CHECKPOINT, str(plan), str(step)])
        params = int(out.strip().splitlines()[-1])
        export: list[tuple[float, float]] = []
        save: list[tuple[float, float]] = []
        split: list[dict[str, float]] = []
        load = [os.getloadavg()[0]]
        for i in range(a.rounds):
            exported = root / f"hf-{i}"
            ours = [sys.executable, "-m", "llmctl", "export", str(step), "--out", str(exported)]
            theirs = [sys.executable, "-c", SAVE_PRETRAINED, str(root / "hf-0"), str(root / f"sp-{i}")]
            if i % 2 == 0:  # alternating; the export first in round 0 (the baseline reads its folder)
                export.append(timed(ours)[:2])
                w, c, o = timed(theirs)
            else:
                w, c, o = timed(theirs)
                export.append(timed(ours)[:2])
            save.append((w, c))
            split.append(json.loads(o.strip().splitlines()[-1]))
            load.append(os.getloadavg()[0])
        size = sum(f.stat().st_size for f in (root / "hf-0").glob("*.safetensors"))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    return {
        "params": params,
        "weights_bytes": size,
        "rounds": a.rounds,
        "export_wall_s": med([w for w, _ in export]),
        "export_cpu_s": med([c for _, c in export]),
        "save_pretrained_wall_s": med([w for w, _ in save]),
        "save_pretrained_cpu_s": med([c for _, c in save]),
        "save_pretrained_split_s": {k: med([s[k] for s in split]) for k in split[0]},
        "load_average": load,
    }


def show(r: dict[str, Any]) -> None:
    print(
        f"llama-tiny, {r['params'] / 1e6:.1f}M parameters, {r['weights_bytes'] / 2**20:.1f} MiB fp32; median of "
        f"{r['rounds']} round{'s' if r['rounds'] > 1 else ''}, each from process start to exit"
    )
    print(f"{'':34}{'wall s':>8}{'CPU s':>8}")
    print(f"{'llmctl export':34}{r['export_wall_s']:8.2f}{r['export_cpu_s']:8.2f}")
    print(f"{'save_pretrained (transformers)':34}{r['save_pretrained_wall_s']:8.2f}{r['save_pretrained_cpu_s']:8.2f}")
    s = r["save_pretrained_split_s"]
    print(
        f"  of which: import torch + transformers {s['import_s']:.2f} s, from_pretrained {s['load_s']:.2f} s, "
        f"save_pretrained {s['save_s']:.2f} s (wall)"
    )
    print(
        f"ratio llmctl export / save_pretrained: {r['export_wall_s'] / r['save_pretrained_wall_s']:.2f} (wall), "
        f"{r['export_cpu_s'] / r['save_pretrained_cpu_s']:.2f} (CPU)"
    )
    print("load average (1 min) before and after each round: " + ", ".join(f"{x:.1f}" for x in r["load_average"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--quick", action="store_true", help="one round")
    a = p.parse_args()
    if a.quick:
        a.rounds = 1
    start = time.perf_counter()
    result = run(a)
    show(result)
    print(f"benchmark wall time {time.perf_counter() - start:.0f} s")
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
