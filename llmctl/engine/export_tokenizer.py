"""The tokenizer and chat template a run trained with, written into its export so that the Hugging Face folder is
prompted as it was trained (issue 49: an export used to carry neither for llmctl's byte tokenizer).

Which tokenizer the run used is the engine's own rule (llmctl.engine.data.open_stream):
- data.kind text: data.tokenizer's folder, else llmctl's byte tokenizer (llmctl.data.tokenizer.ByteTokenizer);
- data.kind tokens: the tokenizer the prepared folder records in its meta.json (the engine checked it against
  data.tokenizer and the model.weights folder's by fingerprint): a local folder, or `bytes`; the chat template its
  instruction records were rendered with (meta.json `chat_template`: the tokenizer's own, or llmctl's plain one);
- data.kind synthetic: no tokenizer (random ids).

A folder's tokenizer is loaded offline (local_files_only) and saved with save_pretrained. The byte tokenizer is built
in code as a `tokenizers` byte-level BPE with no merges: each UTF-8 byte b is token b (GPT-2's byte-to-unicode
alphabet, no regex split, no prefix space), BOS_TOKEN 256 and EOS_TOKEN 257 as special tokens, BOS prepended by the
post-processor as the engine starts every document; `tok(text).input_ids + [eos_token_id]` are the ids the engine
trains on. llmctl's plain chat template (llmctl.data.chat.PLAIN_TEMPLATE) is the Jinja template PLAIN_CHAT_TEMPLATE.
A tokenizer's chat template is written into tokenizer_config.json (where transformers 4 and inference servers read
it) as well as chat_template.jinja (where transformers 5 saves it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.data.chat import PLAIN_TEMPLATE
from llmctl.data.tokenizer import BYTE_TOKENIZER_MARK, ByteTokenizer
from llmctl.errors import InputError
from llmctl.spec.planfile import DataSection

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
"""The byte tokenizer's special tokens (ids 256 and 257) as text: what the chat template and the decoder write."""
CONFIG = "tokenizer_config.json"

PLAIN_CHAT_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' + message['content'] + (eos_token if eos_token else '\\n') }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""llmctl.data.chat.PLAIN_TEMPLATE in Jinja: [BOS], then "<|role|>\\n" + content + "\\n" per system and user turn and
"<|assistant|>\\n" + content + EOS per assistant turn (content + "\\n" without an EOS); the generation prompt is
"<|assistant|>\\n". ChatRenderer._plain tokenizes these same strings segment by segment."""


@dataclass(frozen=True)
class RunTokenizer:
    """What the run tokenized with."""

    folder: Path | None
    """A local Hugging Face tokenizer folder; None: the byte tokenizer (when `bytes`) or none."""
    bytes: bool = False
    chat_template: str | None = None
    """The instruction data's template: PLAIN_TEMPLATE, "tokenizer" (the tokenizer's own), or None (plain text)."""
    missing: str | None = None
    """Why no tokenizer is written (synthetic data, a prepared folder's tokenizer not on this machine)."""

    def describe(self) -> str:
        """For the export's summary line."""
        if self.missing:
            return f"none ({self.missing})"
        what = "llmctl's byte tokenizer as a Hugging Face tokenizer" if self.bytes else f"from {self.folder}"
        if self.chat_template == PLAIN_TEMPLATE:
            return f"{what}, with llmctl's plain chat template"
        if self.chat_template:
            return f"{what}, with its chat template"
        return what


def _meta(folder: str) -> dict[str, Any] | None:
    path = Path(folder) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def run_tokenizer(data: DataSection, weights: str | None) -> RunTokenizer:
    """The tokenizer and chat template the run trained with (module docstring), torch-free."""
    if data.kind == "synthetic":
        return RunTokenizer(None, missing="synthetic data: the run used no tokenizer")
    given = _folder(data.tokenizer) if data.tokenizer else None
    if data.kind == "text":
        return RunTokenizer(given, bytes=given is None)
    meta = _meta(data.paths[0]) if data.paths else None
    if meta is None:
        if given is not None:
            return RunTokenizer(given)
        return RunTokenizer(None, missing=f"{data.paths[0]}/meta.json is not readable here: its tokenizer is unknown")
    template = meta.get("chat_template")
    template = template if isinstance(template, str) else None
    name = (meta.get("tokenizer") or {}).get("name")
    if given is not None:  # the engine checked it is the prepared data's (by fingerprint)
        return RunTokenizer(given, chat_template=template)
    if name == ByteTokenizer.name:
        return RunTokenizer(None, bytes=True, chat_template=template)
    from llmctl.data.check import has_tokenizer

    if weights and has_tokenizer(weights):  # the engine checked it too
        return RunTokenizer(Path(weights), chat_template=template)
    if isinstance(name, str) and Path(name).is_dir():
        return RunTokenizer(Path(name), chat_template=template)
    return RunTokenizer(None, missing=f"the prepared data's tokenizer {name!r} is not on this machine")


def _folder(path: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise InputError(
            f"data.tokenizer {folder}: no such folder (the export writes the tokenizer from it)",
            hint="give a plan with the tokenizer's current path with --plan",
        )
    return folder


def byte_tokenizer() -> Any:
    """llmctl's byte tokenizer as a transformers PreTrainedTokenizerFast (module docstring), built here offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={ch: b for b, ch in _byte_alphabet().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS_TOKEN, EOS_TOKEN])  # ids 256, 257: after the 256 bytes
    b = ByteTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, b.bos_id)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's bytes_to_unicode (openai/gpt-2 encoder.py): byte -> a printable character, as ByteLevel maps them."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def write_tokenizer(run: RunTokenizer, dest: Path) -> tuple[str, ...]:
    """Save the run's tokenizer (and chat template) into `dest`; the file names written (none when `missing`)."""
    if run.missing or (run.folder is None and not run.bytes):
        return ()
    before = {p.name for p in dest.iterdir()}
    if run.bytes:
        tok = byte_tokenizer()
    else:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(run.folder), local_files_only=True)
        except (OSError, ValueError) as e:
            raise InputError(f"tokenizer {run.folder}: cannot load it: {str(e).splitlines()[0]}") from None
    if run.chat_template == PLAIN_TEMPLATE:
        tok.chat_template = PLAIN_CHAT_TEMPLATE
    tok.save_pretrained(str(dest))
    _note_in_config(dest / CONFIG, tok.chat_template, run.bytes)
    return tuple(sorted({p.name for p in dest.iterdir()} - before))


def _note_in_config(path: Path, template: Any, is_bytes: bool) -> None:
    """The chat template into tokenizer_config.json; for the byte tokenizer, the class every transformers version
    knows and llmctl's mark (llmctl.data.tokenizer.load_tokenizer reads the folder back as ByteTokenizer)."""
    config = json.loads(path.read_text()) if path.is_file() else {}
    if template:
        config["chat_template"] = template
    if is_bytes:
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config[BYTE_TOKENIZER_MARK[0]] = BYTE_TOKENIZER_MARK[1]
    path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
