"""Engine loss traces for a refactor: the losses, gradient norms and learning rates of six tiny plans, step by step,
from one torchrun of 4 gloo ranks (tests/engine/engine_runs.py), so that a change that must not change training can
be checked bit for bit against the same plans run before it.

    .venv/bin/python scripts/loss_traces.py record before.json    # on the commit before the change
    .venv/bin/python scripts/loss_traces.py record after.json     # after it
    .venv/bin/python scripts/loss_traces.py compare before.json after.json

The plans: FSDP (full_shard), selective checkpointing with a chunked loss, no_shard with accumulation and partial:2,
HSDP over 2 x 2, TP 2 x CP 2, bf16-mixed with full checkpointing; llama-tiny on the shipped corpus, 6 steps each
(about 30 s on 2 cores). Deterministic on one machine; compare traces recorded on the same machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
FIELDS = ("step", "loss", "grad_norm", "lr")


def _plan(base: dict[str, Any], folder: Path, name: str, ranks: int = 2, nodes: int = 1, **edits: Any) -> str:
    p = json.loads(json.dumps(base))
    p["name"] = name
    p["data"] = {"kind": "text", "paths": [str(REPO / "examples/corpus")]}
    p["hardware"].update(nproc_per_node=ranks, nodes=nodes)
    p["training"].update(max_steps=6, micro_batch_size=4)
    p["checkpoint"] = {"dir": None}
    p["logging"] = {"dir": str(folder / name), "interval_steps": 1}
    for key, value in edits.items():
        section, field = key.split("__")
        p.setdefault(section, {})[field] = value
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(p))
    return str(path)


def record(out: Path) -> None:
    base = yaml.safe_load((REPO / "examples/tiny-cpu.yaml").read_text())
    folder = Path(tempfile.mkdtemp(prefix="loss-traces-"))
    plans = [
        _plan(base, folder, "fsdp"),
        _plan(base, folder, "selective-chunk", training__activation_checkpointing="selective",
              training__loss_chunk_tokens=32),
        _plan(base, folder, "noshard-accum-partial", parallel__sharding="no_shard", training__grad_accum_steps=2,
              training__activation_checkpointing="partial:2"),
        _plan(base, folder, "hsdp", ranks=2, nodes=2, parallel__sharding="hybrid_shard"),
        _plan(base, folder, "tp2cp2", ranks=4, parallel__tp=2, parallel__cp=2, training__attention="sdpa"),
        _plan(base, folder, "bf16-full", training__precision="bf16-mixed",
              training__activation_checkpointing="full"),
    ]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(folder), "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "4", str(REPO / "tests/engine/engine_runs.py"),
         str(folder / "results.json"), *plans],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode:
        sys.exit(f"the runs failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    traces = {}
    for plan in plans:
        name = Path(plan).stem
        rows = [json.loads(line) for line in (folder / name / "metrics.jsonl").read_text().splitlines()]
        traces[name] = [{k: r.get(k) for k in FIELDS} for r in rows if r.get("event") == "step"]
    out.write_text(json.dumps(traces, indent=1) + "\n")
    print(f"{out}: " + ", ".join(f"{k} {len(v)} steps" for k, v in traces.items()))


def compare(a: Path, b: Path) -> int:
    x, y = json.loads(a.read_text()), json.loads(b.read_text())
    differ = [name for name in sorted(set(x) | set(y)) if x.get(name) != y.get(name)]
    for name in differ:
        print(f"{name}: differs ({x.get(name)} vs {y.get(name)})")
    print("bit-identical" if not differ else f"{len(differ)} of {len(set(x) | set(y))} plans differ")
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "record":
        record(Path(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
