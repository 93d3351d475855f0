"""The engine on folders made by `llmctl data prepare`: start-up that does not grow with the corpus, the train and
val splits, and data made with another tokenizer refused."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmctl.data.tokenizer import ByteTokenizer
from llmctl.engine.data import build_source, build_val_source, expected_tokenizers
from llmctl.errors import InputError
from llmctl.spec.planfile import DataSection
from tests.engine.conftest import REPO, check_ok, records, run_engine, write_plan


def prepared(folder: Path, train_tokens: int, val_tokens: int, shards: int = 4, fingerprint: str | None = None) -> Path:
    """A prepared folder written by hand to the format's contract (llmctl/data/format.py): seeded byte tokens."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    tok = ByteTokenizer()
    splits = {}
    for split, n in (("train", train_tokens), ("val", val_tokens)):
        entries = []
        per = -(-n // shards) if n else 0
        for i in range(shards if n else 0):
            count = min(per, n - i * per)
            name = f"{split}-{i:05d}.bin"
            rng.integers(0, 256, count, dtype=np.uint16).astype("<u2").tofile(folder / name)
            entries.append({"file": name, "tokens": int(count)})
        splits[split] = {"documents": max(1, n // 1000), "tokens": n, "shards": entries}
    meta = {
        "format": "llmctl-prepared",
        "version": 1,
        "dtype": "uint16",
        "vocab_size": tok.vocab_size,
        "tokenizer": {"name": tok.name, "fingerprint": fingerprint or tok.fingerprint(), "bos_id": 256, "eos_id": 257},
        "seq_len": None,
        "val_fraction": 0.01,
        "splits": splits,
        "sources": ["generated"],
        "text_field": "text",
        "seconds": 0.0,
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


_PROBE = """
import json, sys, time
import torch  # what a rank has imported before it reads data
from llmctl.engine.data import RankData
from llmctl.engine.model import base_spec
from llmctl.engine.trainer import data_source, val_data_source
from llmctl.spec.planfile import load_plan

def status(key):  # /proc/self/status, bytes. VmHWM (peak resident) is reset by exec; ru_maxrss is inherited.
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024

plan = load_plan(sys.argv[1])
rss0, anon0 = status("VmHWM"), status("RssAnon")
t0 = time.perf_counter()
vocab = base_spec(plan.model).vocab_size
blocks, _ = data_source(plan.data, plan.model.weights, plan.setup, plan.training.seed, vocab)
val_data_source(plan.data, plan.model.weights, plan.setup, vocab)
t = plan.training
RankData(blocks, t.micro_batch_size, t.grad_accum_steps, 0, 2).micro_batches(0)
if len(sys.argv) > 2:  # the mutation check: what reading the corpus whole would cost
    blocks.tokens[0 : len(blocks.tokens)].sum()
print(json.dumps({"seconds": time.perf_counter() - t0, "rss_bytes": status("VmHWM") - rss0,
                  "anon_bytes": status("RssAnon") - anon0}))
"""


def test_start_cost_does_not_grow_with_the_corpus(tmp_path: Path) -> None:
    """Opening a 4M-token and a 40M-token (80 MB) prepared corpus and reading a rank's first micro-batches: the
    memory the data adds and the time it takes stay flat (reading the corpus whole would add 72 MB more).
    Private memory must not grow at all; the peak resident set may grow by the page-cache pages the touched blocks
    map (the kernel maps file pages in folios of up to 2 MB here: 12 MB for 4 blocks of the large corpus vs 5 MB
    when they fall in the small one's few folios), bounded by the blocks read, not the corpus."""
    out = {}
    for name, n in (("small", 4_000_000), ("large", 40_000_000)):
        folder = prepared(tmp_path / name, n, n // 100)
        plan = write_plan(
            tmp_path / f"plan-{name}",
            {"data": {"kind": "tokens", "paths": [str(folder)], "val": "split"}, "training": {"seq_len": 1024}},
        )
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE, str(plan)], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = json.loads(proc.stdout.splitlines()[-1])
    small, large = out["small"], out["large"]
    assert large["anon_bytes"] < small["anon_bytes"] + 2 * 2**20, out
    assert large["rss_bytes"] < small["rss_bytes"] + 16 * 2**20, out
    assert large["seconds"] < small["seconds"] + 0.5, out


def test_train_and_val_splits_and_their_blocks(tmp_path: Path) -> None:
    folder = prepared(tmp_path / "d", 10_000, 700, shards=3)
    data = DataSection(kind="tokens", paths=[str(folder)], val="split")
    blocks, desc = build_source(data, 64, 0, 320)
    assert blocks.num_blocks == (10_000 - 1) // 64 and "[train]" in desc
    val, vdesc = build_val_source(data, 64, 320)
    assert val.num_blocks == (700 - 1) // 64 and "[val]" in vdesc and not val.shuffle
    whole = np.concatenate([np.fromfile(folder / f"val-{i:05d}.bin", dtype="<u2") for i in range(3)])
    assert (val.samples(0, val.num_blocks) == np.stack([whole[b * 64 : b * 64 + 65] for b in range(10)])).all()


def test_another_tokenizer_or_a_bigger_vocabulary_is_refused(tmp_path: Path) -> None:
    folder = prepared(tmp_path / "d", 10_000, 700, fingerprint="0" * 64)
    tok_dir = tmp_path / "bytes-tokenizer-folder"  # any folder the plan names as its tokenizer: the fingerprint decides
    from tests.engine.test_data import _train_tokenizer

    _train_tokenizer(tok_dir)
    data = DataSection(kind="tokens", paths=[str(folder)], tokenizer=str(tok_dir))
    with pytest.raises(InputError, match="was prepared with tokenizer 'bytes'.*not the data.tokenizer"):
        build_source(data, 64, 0, 320, expected_tokenizers(data, None))
    weights = tmp_path / "weights"
    _train_tokenizer(weights)
    plain = DataSection(kind="tokens", paths=[str(folder)])
    with pytest.raises(InputError, match="not the tokenizer of model.weights"):
        build_source(plain, 64, 0, 320, expected_tokenizers(plain, str(weights)))
    with pytest.raises(InputError, match="has 258 tokens but the model's vocabulary is 128"):
        build_source(plain, 64, 0, 128)


@pytest.mark.dist
def test_engine_trains_on_a_prepared_folder_with_its_val_split(tmp_path: Path) -> None:
    folder = prepared(tmp_path / "d", 200_000, 3_000)
    plan = write_plan(
        tmp_path,
        {
            "data": {"kind": "tokens", "paths": [str(folder)], "val": "split"},
            "training": {"max_steps": 4},
            "logging": {"eval_interval_steps": 2, "eval_batches": 2},
        },
    )
    check_ok(run_engine(plan, 2, tmp_path))
    assert [e["step"] for e in records(plan, "eval")] == [2, 4]
    assert "[val]" in records(plan, "start")[0]["val"]


@pytest.mark.dist
def test_the_readme_flow_raw_files_to_validation_loss_on_tensorboard(tmp_path: Path) -> None:
    """README "From raw files to a run": build_corpus --jsonl, `llmctl data prepare` with a val split,
    examples/tiny-cpu-prepared.yaml (shortened) on 2 ranks: eval events, and TensorBoard reads them back."""
    import yaml

    if importlib.util.find_spec("tensorboard") is None:
        pytest.skip("tensorboard not installed (pip install 'llmctl[logging]')")
    raw, data = tmp_path / "raw" / "docstrings.jsonl", tmp_path / "data"
    for cmd in (
        [sys.executable, "examples/corpus/build_corpus.py", "--jsonl", str(raw), "--max-bytes", "200000"],
        [sys.executable, "-m", "llmctl", "data", "prepare", str(raw.parent), "--out", str(data)]
        + ["--val-fraction", "0.05", "--seq-len", "128"],
    ):
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
    plan = yaml.safe_load((REPO / "examples" / "tiny-cpu-prepared.yaml").read_text())
    plan["data"]["paths"] = [str(data)]
    plan["training"]["max_steps"] = 4
    plan["checkpoint"]["dir"] = str(tmp_path / "ckpt")
    plan["logging"] |= {"dir": str(tmp_path / "logs"), "eval_interval_steps": 2, "eval_batches": 1}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    check_ok(run_engine(path, 2, tmp_path))
    evals = records(path, "eval")
    assert [e["step"] for e in evals] == [2, 4] and all(4.0 < e["val_loss"] < 6.0 for e in evals)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "logs" / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/loss")] == [2, 4]
