"""Tokenizers for training data: the built-in byte-level one and a local Hugging Face folder, with the fingerprint
that ties a prepared dataset to the tokenizer that made it. Torch-free; transformers is imported only for a folder.

`llmctl data prepare` (llmctl.data.prepare) tokenizes with these, and the engine (llmctl.engine.data) uses the same
ones for `data.kind: text` and to check a prepared folder's fingerprint: one definition of each token id.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from llmctl.errors import InputError


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def fingerprint(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens; BOS/EOS ids follow the byte range (256, 257), as in the tiny presets."""

    name = "bytes"
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def fingerprint(self) -> str:
        """Identifies the vocabulary: two tokenizers with the same fingerprint map text to the same ids."""
        return hashlib.sha256(b"llmctl-bytes-v1:bos=256,eos=257").hexdigest()


class HFTokenizer:
    """A tokenizer from a local Hugging Face folder (never downloads)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise InputError(
                f"data.tokenizer: cannot load a tokenizer from {path!r}: {str(e).splitlines()[0]}"
            ) from None
        self.name = str(path)
        self.vocab_size = len(self._tok)
        self.bos_id = self._tok.bos_token_id
        self.eos_id = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The conversation as text by the folder's chat template (llmctl.data.chat tokenizes it)."""
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The fast tokenizer's batch call (Rust, one call for many documents)."""
        return self._tok(list(texts), add_special_tokens=False)["input_ids"]

    def fingerprint(self) -> str:
        """sha256 of the tokenizer's canonical serialization (vocabulary, merges, normalizer, pre-tokenizer, added
        tokens) plus its BOS/EOS ids: independent of file layout, changed by anything that changes the ids."""
        h = hashlib.sha256()
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is not None:
            h.update(backend.to_str().encode())
        else:  # a slow (Python) tokenizer: its vocabulary, sorted
            h.update(json.dumps(sorted(self._tok.get_vocab().items())).encode())
        h.update(f"|bos={self.bos_id}|eos={self.eos_id}".encode())
        return h.hexdigest()


BYTE_TOKENIZER_MARK = ("llmctl_tokenizer", "bytes-v1")
"""The key and value in tokenizer_config.json of ByteTokenizer exported as a Hugging Face tokenizer (`llmctl export`,
llmctl.engine.export_tokenizer): the same ids by construction, so a folder that carries it is read as ByteTokenizer
(its fingerprint included: data prepared with bytes stays valid for a model fine-tuned from the export)."""


def load_tokenizer(path: str | None) -> Tokenizer:
    if path is None or _is_exported_bytes(path):
        return ByteTokenizer()
    return HFTokenizer(path)


def _is_exported_bytes(path: str) -> bool:
    try:
        config = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    key, value = BYTE_TOKENIZER_MARK
    return isinstance(config, dict) and config.get(key) == value


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)
