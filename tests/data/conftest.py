"""Fixtures of the `llmctl data prepare` tests: a small BPE tokenizer trained here (no download), a warm forkserver."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # for data_helpers (tests run with --import-mode=importlib)
from data_helpers import make_docs  # noqa: E402


@pytest.fixture(scope="session")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-level BPE tokenizer folder (vocabulary 400, <s> and </s>) trained on generated text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(
        make_docs(300, seed=99), trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"])
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session", autouse=True)
def warm_forkserver() -> None:
    """Start this test process's forkserver with transformers preloaded once (prepare's own preload list depends on
    its first call's tokenizer; a worker forked from a cold server would import transformers itself: seconds)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["llmctl.data.prepare", "llmctl.engine.data", "transformers.models.auto.tokenization_auto"]
    )
    multiprocessing.forkserver.ensure_running()
