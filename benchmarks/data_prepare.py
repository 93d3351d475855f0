"""`llmctl data prepare` vs the loop a user would write, on the same corpus and the same Hugging Face fast tokenizer.

The corpus: --mb MB of generated JSON lines (documents of 20..1,500 words drawn from a Zipf-distributed vocabulary of
made-up words, with punctuation and line breaks) in a temporary folder. The tokenizer: a byte-level BPE of vocabulary
--vocab trained here with the `tokenizers` library on a sample of it, saved as a transformers folder (no download).

- plain loop: one process reads the file line by line, `json.loads`, `tok.encode(doc, add_special_tokens=False)`
  framed as [BOS] doc [EOS], then writes the tokens as one uint16 file;
- llmctl: `python -m llmctl data prepare CORPUS --out DIR --tokenizer TOK --workers N` for N = 1, 2 and all
  usable cores.
Both timed from process start to exit (what a user waits for: each pays ~3-4 s importing transformers once), best of
--repeat runs. Then the check that both wrote the same token stream, byte for byte.

Run: .venv/bin/python benchmarks/data_prepare.py [--mb 16] [--repeat 2] [--quick]
(default ~1.5 min on 2 cores; --quick: a 1 MB corpus, ~15 s, nearly all of it each process importing transformers)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PLAIN_LOOP = """
import json, sys, time
import numpy as np
from transformers import AutoTokenizer
t0 = time.perf_counter()
tok = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
out = []
with open(sys.argv[2], encoding="utf-8") as f:
    for line in f:
        doc = json.loads(line)["text"]
        out += [tok.bos_token_id] + tok.encode(doc, add_special_tokens=False) + [tok.eos_token_id]
np.asarray(out, dtype=np.uint16).tofile(sys.argv[3])
print(len(out), time.perf_counter() - t0)
"""


def make_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """JSON lines of generated documents until the file holds `megabytes` MB; returns the number of documents."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "ing", "er", "qu", "x"]
    words = sorted({"".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(30_000)})
    weights = [1 / (rank + 1) for rank in range(len(words))]  # Zipf's law: frequency ~ 1/rank
    target, written, docs = int(megabytes * 1e6), 0, 0
    with path.open("w", encoding="utf-8") as f:
        while written < target:
            n = rng.randint(20, 1500)
            text = " ".join(rng.choices(words, weights, k=n))
            text = text.replace(" ba ", ", ").replace(" ka ", ". ").replace(" ma ", ".\n\n")
            line = json.dumps({"text": text, "id": docs}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def train_tokenizer(corpus: Path, folder: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def sample():
        with corpus.open(encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i >= 2000:
                    return
                yield json.loads(line)["text"]

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(
        sample(), trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(
        folder
    )


def timed(cmd: list[str]) -> tuple[float, str]:
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return seconds, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=16.0, help="corpus size in MB of JSON lines")
    ap.add_argument("--vocab", type=int, default=8000, help="BPE vocabulary of the trained tokenizer")
    ap.add_argument("--repeat", type=int, default=2, help="runs per method (the best is shown)")
    ap.add_argument("--quick", action="store_true", help="a 1 MB corpus: startup-bound, for checking the script")
    args = ap.parse_args()
    if args.quick:
        args.mb, args.vocab = 1.0, 2000
    py = sys.executable
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp_str:
        tmp = Path(tmp_str)
        corpus, tok = tmp / "corpus.jsonl", tmp / "tokenizer"
        t = time.perf_counter()
        docs = make_corpus(corpus, args.mb)
        train_tokenizer(corpus, tok, args.vocab)
        print(
            f"corpus: {corpus.stat().st_size / 1e6:.1f} MB, {docs:,} documents (JSON lines); tokenizer: byte-level BPE, "
            f"vocabulary {args.vocab}; {cores} usable cores; setup {time.perf_counter() - t:.1f} s"
        )

        rows = []
        runs = [
            timed([py, "-c", PLAIN_LOOP, str(tok), str(corpus), str(tmp / "plain.bin")]) for _ in range(args.repeat)
        ]
        best, plain_stdout = min(runs)
        tokens, loop_seconds = int(plain_stdout.split()[0]), float(plain_stdout.split()[1])
        rows.append(("plain loop: tok.encode(doc) per document", 1, best))
        worker_counts = sorted({1, 2, cores})
        for workers in worker_counts:
            best = None
            for _ in range(args.repeat):
                out = tmp / f"prepared-{workers}"
                cmd = [py, "-m", "llmctl", "data", "prepare", str(corpus), "--out", str(out), "--force"]
                seconds, said = timed([*cmd, "--tokenizer", str(tok), "--workers", str(workers)])
                best = seconds if best is None else min(best, seconds)
            label = "llmctl data prepare" + (" (all cores)" if workers == cores and workers > 2 else "")
            rows.append((label, workers, best))

        plain_seconds = rows[0][2]
        print(f"\n{'method':42s} {'workers':>7s} {'seconds':>8s} {'tokens/s':>10s} {'speedup':>8s}")
        for method, workers, seconds in rows:
            print(
                f"{method:42s} {workers:>7d} {seconds:>8.1f} {tokens / seconds:>10,.0f} "
                f"{plain_seconds / seconds:>7.2f}x"
            )
        print(
            f"\n{tokens:,} tokens. Wall time from process start to exit; the plain loop spent "
            f"{plain_seconds - loop_seconds:.1f} s importing transformers, {loop_seconds:.1f} s loading and tokenizing."
        )

        plain = (tmp / "plain.bin").read_bytes()
        same = []
        for workers in worker_counts:
            meta = json.loads((tmp / f"prepared-{workers}" / "meta.json").read_text())
            shards = meta["splits"]["train"]["shards"]
            same.append(b"".join((tmp / f"prepared-{workers}" / s["file"]).read_bytes() for s in shards) == plain)
        if not all(same):
            raise SystemExit("MISMATCH: llmctl data prepare and the plain loop wrote different token streams")
        print(
            "same token stream: yes (the plain loop's file == the train shards of every --workers run, byte for byte)"
        )


if __name__ == "__main__":
    main()
