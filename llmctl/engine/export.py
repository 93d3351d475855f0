"""`llmctl export`: an engine checkpoint -> a Hugging Face folder that `AutoModelForCausalLM.from_pretrained` loads.

The checkpoint is torch.distributed.checkpoint (DCP) shards of `{"model": get_state_dict(model), "optim": ...}`
(llmctl.engine.checkpoint), so a model tensor is stored under "model." + its Hugging Face name, with the vocabulary
rows padded to model.pad_vocab_multiple. The export, in one process and without a process group:

1. finds the step folder and the plan that trained it (its plan.yaml, or --plan), and checks the output folder,
   all before torch is imported, so that a bad command line fails in a fraction of a second;
2. builds the plan's model on the meta device with the real vocabulary, which names every tensor transformers
   expects and its shape; checks each against the checkpoint's metadata (no tensor data read yet);
3. splits the tensors save_pretrained would write (tied weights once) into shard files of at most
   --max-shard-size, and for each shard file loads only its tensors from DCP, straight into tensors of the
   output dtype (DCP copies each stored chunk into them), drops the padded vocabulary rows, reverts transformers'
   load-time weight conversions (Mixtral's fused experts) as save_pretrained does, and writes the safetensors
   file. One shard file's tensors are in memory at a time;
4. writes config.json (real vocabulary, dtype), generation_config.json, the index and the tokenizer and chat
   template the run trained with (llmctl.engine.export_tokenizer) into a hidden sibling folder, fsyncs them, and renames it into place (with --force, the old folder is
   moved aside first and deleted after). An interrupted export never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmctl.engine.checkpoint import PLAN_FILE, TMP_PREFIX, complete_checkpoints, latest_checkpoint
from llmctl.engine.export_tokenizer import run_tokenizer, write_tokenizer
from llmctl.engine.model import base_spec, padded_vocab_size
from llmctl.errors import InputError, RuntimeFailure, SpecError, disk_full
from llmctl.fileio import fsync_dir, pid_alive, raise_if_no_space
from llmctl.spec.planfile import ModelSection, Plan, load_plan

if TYPE_CHECKING:
    import torch

    from llmctl.spec.setup import TrainSetup

DCP_METADATA = ".metadata"
"""The file torch.distributed.checkpoint's FileSystemWriter writes last: a folder without it is no DCP checkpoint."""
MODEL_PREFIX = "model."
"""Checkpointer.save stores {"model": model_sd, ...}; DCP flattens it to "model." + the Hugging Face name."""
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
DEFAULT_MAX_SHARD = "5GB"
"""Hugging Face's customary shard size (parsed by llmctl.units.parse_bytes, which reads GB as GiB)."""
EXPORT_MARKER = ".llmctl-export"
"""The file every export folder holds: `--force` replaces a folder only when it has one (a folder of the user's is
never deleted)."""
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class ExportRequest:
    checkpoint: Path
    """The plan's checkpoint.dir (its newest complete step_* folder is exported) or one step_* folder."""
    out: Path
    """The Hugging Face folder to write."""
    dtype: str | None = None
    """bf16 | fp32; None: bf16 when the plan trained in bf16 or bf16-mixed, else fp32."""
    force: bool = False
    """Replace a non-empty `out` (only once the new folder is complete)."""
    plan: Path | None = None
    """The plan that trained the checkpoint, for checkpoints without plan.yaml (it wins over plan.yaml)."""
    max_shard_bytes: int = 5 * 2**30
    """Largest safetensors file (a tensor larger than this gets a file of its own)."""

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InputError(f"--dtype: unknown {self.dtype!r}", hint="bf16 or fp32")
        if self.max_shard_bytes <= 0:
            raise InputError(f"--max-shard-size must be positive, got {self.max_shard_bytes}")


@dataclass(frozen=True)
class ExportResult:
    out: Path
    step_dir: Path
    step: int | None
    plan_source: Path
    tensors: int
    """Tensors written (tied weights once)."""
    shards: int
    total_bytes: int
    """Bytes of tensor data in the safetensors files (the index's total_size)."""
    dtype: str
    vocab_size: int
    checkpoint_vocab_size: int
    """Rows of the embedding in the checkpoint (the padded vocabulary)."""
    files: tuple[str, ...]
    """Every file in the exported folder (but EXPORT_MARKER)."""
    tokenizer_files: tuple[str, ...]
    tokenizer: str
    """Which tokenizer and chat template the folder carries, or why none (RunTokenizer.describe)."""
    seconds: float
    peak_rss_bytes: int
    """The process's peak resident memory (getrusage), including the Python and torch baseline."""


ShardCallback = Callable[[int, int, str, int], None]
"""on_shard(index from 1, shard count, file name, bytes), after each shard file is written."""


# --- torch-free checks of the command line -----------------------------------------------------------------------
def resolve_checkpoint(path: Path) -> tuple[Path, int | None]:
    """(step folder, step) for a checkpoint.dir (its newest complete step_*) or a step folder itself."""
    if not path.exists():
        raise InputError(f"{path}: no such checkpoint")
    if not path.is_dir():
        raise InputError(f"{path}: not a folder", hint="give the plan's checkpoint.dir or one step_* folder in it")
    if (path / DCP_METADATA).is_file():
        steps = {p.resolve(): s for s, p in complete_checkpoints(path.resolve().parent)}
        return path, steps.get(path.resolve())
    found = latest_checkpoint(path)
    if found is not None:
        step, folder = found
        if not (folder / DCP_METADATA).is_file():
            raise InputError(f"{folder}: not a torch.distributed.checkpoint folder (no {DCP_METADATA} file)")
        return folder, step
    if path.name.startswith("step_"):
        raise InputError(f"{path}: not a torch.distributed.checkpoint folder (no {DCP_METADATA} file)")
    partial = sorted(p.name for p in path.iterdir() if p.name.startswith(TMP_PREFIX))
    interrupted = f" (only an interrupted save: {partial[-1]})" if partial else ""
    below = sorted(p for p in path.iterdir() if p.is_dir() and latest_checkpoint(p) is not None)
    raise InputError(
        f"{path}: no complete step_* checkpoint{interrupted}",
        hint=f"did you mean {below[0]}?" if below else "give the plan's checkpoint.dir or one step_* folder in it",
    )


def resolve_plan(step_dir: Path, given: Path | None) -> tuple[Plan, Path]:
    """The plan file given with --plan, else the plan.yaml the engine wrote into the checkpoint."""
    if given is not None:
        return load_plan(given), given
    saved = step_dir / PLAN_FILE
    if not saved.is_file():
        raise InputError(
            f"{step_dir} has no {PLAN_FILE} (a checkpoint made before llmctl wrote the plan into it)",
            hint="give the plan that trained it with --plan PLAN",
        )
    return load_plan(saved), saved


def check_out(out: Path, force: bool, step_dir: Path) -> None:
    """Refuse an output folder that holds files (unless --force, and then only one an export wrote), that is a
    file, or that holds the checkpoint."""
    target = out.resolve()
    source = step_dir.resolve()
    if target == source or target in source.parents:
        raise InputError(f"--out {out}: holds the checkpoint being exported", hint="choose another folder")
    if out.is_symlink() and not out.exists():
        raise InputError(f"--out {out}: a broken symbolic link")
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise InputError(
                f"--out {out}: folder is not empty", hint="choose an empty folder, or --force to replace it once done"
            )
        _check_replaceable(out)


def _check_replaceable(out: Path) -> None:
    """--force replaces only a folder `llmctl export` wrote (its EXPORT_MARKER): it used to delete any non-empty
    folder, and a user's thesis.tex and a sub-folder went with it (issue 46)."""
    if not (out / EXPORT_MARKER).is_file():
        raise InputError(
            f"--out {out}: not a folder llmctl export wrote (no {EXPORT_MARKER} in it); --force replaces only those",
            hint="choose another folder; to replace this one, delete it yourself",
        )


def default_dtype(setup: TrainSetup) -> str:
    """The dtype the setup trained in: bf16 for bf16 and bf16-mixed, else fp32 (fp16-mixed keeps fp32 masters)."""
    return "bf16" if setup.precision.compute_dtype == "bf16" else "fp32"


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped into shard files in order, each at most `max_bytes` (a larger tensor alone), like
    huggingface_hub's split_torch_state_dict_into_shards."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, n in sizes:
        if current and used + n > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += n
    if current:
        shards.append(current)
    return shards


def shard_file_name(index: int, count: int) -> str:
    """transformers' names: model.safetensors alone, else model-00001-of-00003.safetensors."""
    return SAFE_WEIGHTS if count == 1 else f"model-{index:05d}-of-{count:05d}.safetensors"


def peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes


# --- the export ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tensor:
    name: str
    """The Hugging Face name (the checkpoint's key is MODEL_PREFIX + name)."""
    checkpoint_shape: tuple[int, ...]
    shape: tuple[int, ...]
    """Shape written (vocabulary rows trimmed)."""
    dtype: torch.dtype
    """Dtype written: the output dtype for floating-point tensors, the stored one otherwise."""

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def export_checkpoint(req: ExportRequest, on_shard: ShardCallback | None = None) -> ExportResult:
    """Write the Hugging Face folder for `req` (see the module docstring); returns what was written."""
    start = time.perf_counter()
    step_dir, step = resolve_checkpoint(req.checkpoint)
    plan, plan_source = resolve_plan(step_dir, req.plan)
    check_out(req.out, req.force, step_dir)
    dtype_name = req.dtype or default_dtype(plan.setup)
    tokenizer = run_tokenizer(plan.data, plan.model.weights)
    spec = base_spec(plan.model)  # the model as published: overrides applied, vocabulary not padded
    vocab = spec.vocab_size
    padded = padded_vocab_size(vocab, plan.model.pad_vocab_multiple)

    import torch

    import_transformers_quietly()
    out_dtype = getattr(torch, DTYPES[dtype_name])
    config, generation_config = _hf_configs(plan.model, spec.hf_config, vocab)
    model = _meta_model(config, out_dtype)
    metadata = _read_metadata(step_dir)
    hint = (
        f"is {plan_source} the plan that trained this checkpoint?"
        if req.plan is not None
        else f"{plan_source} does not describe this checkpoint; give the plan that trained it with --plan"
    )
    tensors = _expected_tensors(model, metadata, vocab, padded, out_dtype, hint)
    shards = plan_shards([(t.name, t.nbytes) for t in tensors], req.max_shard_bytes)
    by_name = {t.name: t for t in tensors}

    out, tmp = fresh_temp(req.out)
    try:
        tmp.mkdir(parents=True)
        weight_map: dict[str, str] = {}
        total = 0
        for i, names in enumerate(shards, 1):
            name = shard_file_name(i, len(shards))
            try:
                written = _write_shard(tmp / name, [by_name[n] for n in names], step_dir, model)
            except OSError as e:  # a full disk: the whole export's bytes named; --out untouched (tmp removed below)
                raise_if_no_space(e, tmp / name, sum(t.nbytes for t in tensors))
                raise
            weight_map.update(dict.fromkeys(written, name))
            total += _nbytes(written)
            if on_shard is not None:
                on_shard(i, len(shards), name, _nbytes(written))
            del written
        if len(shards) > 1:
            # transformers' save_pretrained index: the total tensor bytes (huggingface_hub), the parameter count
            # (transformers 5), and where each tensor is; sorted keys, 2-space indent, as it writes them.
            index = {
                "metadata": {"total_parameters": model.num_parameters(), "total_size": total},
                "weight_map": dict(sorted(weight_map.items())),
            }
            (tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        config.save_pretrained(tmp)
        generation_config.save_pretrained(tmp)
        copied = write_tokenizer(tokenizer, tmp)
        files = tuple(sorted(p.name for p in tmp.iterdir()))
        publish_durably(tmp, out, req.force)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise_disk_full(e, req.out)
        raise
    return ExportResult(
        out=req.out,
        step_dir=step_dir,
        step=step,
        plan_source=plan_source,
        tensors=len(weight_map),
        shards=len(shards),
        total_bytes=total,
        dtype=dtype_name,
        vocab_size=vocab,
        checkpoint_vocab_size=padded,
        files=files,
        tokenizer_files=copied,
        tokenizer=tokenizer.describe(),
        seconds=time.perf_counter() - start,
        peak_rss_bytes=peak_rss_bytes(),
    )


def import_transformers_quietly() -> None:
    """transformers' modeling code, imported with torchao's and torch's loggers quiet: when torchao is installed
    transformers imports it (its quantizer), and on a CPU machine torchao logs each CUDA extension it cannot load
    and torch a deprecation of torchao's pytree registrations, noise in the export's output (issue 49). Nothing
    else is imported that save_pretrained's own process would not import (benchmarks/export_speed.py)."""
    from llmctl.engine.ao import quiet_torchao

    with quiet_torchao():
        import transformers.modeling_utils  # noqa: F401


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _hf_configs(m: ModelSection, hf_config: dict[str, Any], vocab: int) -> tuple[Any, Any]:
    """(PretrainedConfig, GenerationConfig) of the exported model: from the weights folder's files when the plan
    fine-tuned local weights (overrides applied, as build_model loads them), else from the plan's config fields."""
    from transformers import AutoConfig, GenerationConfig

    try:
        if m.weights:
            from llmctl.spec.rope import ROPE_KEYS, merge_overrides

            overrides = dict(m.overrides)
            rope = {k: overrides.pop(k) for k in ROPE_KEYS if k in overrides}
            config = AutoConfig.from_pretrained(m.weights, local_files_only=True, **overrides)
            if rope:  # one rope_parameters, the folder's theta kept (passing rope_scaling through would drop it)
                rope.update({"rope_theta": overrides["rope_theta"]} if "rope_theta" in overrides else {})
                config.rope_parameters = merge_overrides(config.to_dict(), rope)["rope_parameters"]
        else:
            cfg = dict(hf_config)
            config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    except (OSError, TypeError, ValueError) as e:
        source = f"model.weights {m.weights!r}" if m.weights else "model.overrides"
        raise SpecError(f"{source}: cannot build the Hugging Face config: {str(e).splitlines()[0]}") from None
    config.vocab_size = vocab
    generation = None
    if m.weights and (Path(m.weights) / "generation_config.json").is_file():
        try:
            generation = GenerationConfig.from_pretrained(m.weights, local_files_only=True)
        except (OSError, ValueError) as e:
            raise SpecError(f"{m.weights}/generation_config.json: {str(e).splitlines()[0]}") from None
    return config, generation or GenerationConfig.from_model_config(config)


def _meta_model(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The model transformers builds from `config`, on the meta device (no memory): names and shapes."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # What save_pretrained records: the class to load, and the dtype from_pretrained(dtype="auto") picks.
    config.architectures = [type(model).__name__]
    if isinstance(getattr(type(config), "torch_dtype", None), property):
        config.dtype = dtype  # transformers 5 (torch_dtype is its deprecated alias)
    else:
        config.torch_dtype = dtype  # transformers 4
    model.config = config
    return model


def _read_metadata(step_dir: Path) -> Any:
    """DCP's metadata (a pickle), read only from a folder llmctl wrote and as it wrote it (its marker checked:
    llmctl.engine.checkpoint_files.verify)."""
    from torch.distributed.checkpoint import FileSystemReader

    from llmctl.engine.checkpoint_files import verify

    verify(step_dir)
    try:
        return FileSystemReader(str(step_dir)).read_metadata()
    except Exception as e:  # a truncated or foreign .metadata: pickle raises several types
        raise InputError(
            f"{step_dir / DCP_METADATA}: not readable as torch.distributed.checkpoint metadata "
            f"({type(e).__name__}: {_first_line(e)})"
        ) from None


def _saved_names(model: torch.nn.Module) -> list[str]:
    """The state-dict names save_pretrained writes: a tied tensor once, under its source name (the embedding, not
    lm_head: the keys of transformers' tied-weights map are the tied targets)."""
    state = model.state_dict(keep_vars=True)  # the Parameters themselves: tied names share one object
    targets = set(getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or ())
    holders: dict[int, list[str]] = {}
    for name, t in state.items():
        holders.setdefault(id(t), []).append(name)
    keep = []
    for name, t in state.items():
        names = holders[id(t)]
        if len(names) == 1 or name == next((n for n in names if n not in targets), names[0]):
            keep.append(name)
    return keep


def _vocab_names(model: torch.nn.Module, vocab: int) -> set[str]:
    """Names of the tensors with one row per token (input embedding, LM head and its bias): padded in the
    checkpoint."""
    module_names = {id(mod): n for n, mod in model.named_modules(remove_duplicate=False)}
    out = set()
    for mod in (model.get_input_embeddings(), model.get_output_embeddings()):
        if mod is None:
            continue
        prefix = module_names[id(mod)]
        for pname, p in mod.named_parameters(recurse=False):
            if p.dim() >= 1 and p.shape[0] == vocab:
                out.add(f"{prefix}.{pname}" if prefix else pname)
    return out


def _expected_tensors(
    model: torch.nn.Module, metadata: Any, vocab: int, padded: int, out_dtype: torch.dtype, hint: str
) -> list[_Tensor]:
    """The tensors to write, each checked against the checkpoint's metadata: present, a tensor, the plan's shape
    (vocabulary rows padded); and no model tensor in the checkpoint that the plan's model lacks."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = metadata.state_dict_metadata
    state = model.state_dict()
    keep = _saved_names(model)
    vocab_names = _vocab_names(model, vocab)
    out = []
    for name in keep:
        shape = tuple(state[name].shape)
        want = (padded, *shape[1:]) if name in vocab_names else shape
        entry = stored.get(MODEL_PREFIX + name)
        if entry is None:
            raise SpecError(f"{name}: in the plan's model but missing from the checkpoint", hint=hint)
        if not isinstance(entry, TensorStorageMetadata):
            raise SpecError(f"{name}: not a tensor in the checkpoint", hint=hint)
        got = tuple(entry.size)
        if got != want:
            raise SpecError(f"{name}: the checkpoint holds shape {list(got)}, the plan's model {list(want)}", hint=hint)
        stored_dtype = entry.properties.dtype
        dtype = out_dtype if stored_dtype.is_floating_point else stored_dtype
        out.append(_Tensor(name, got, shape, dtype))
    extra = sorted(k for k in stored if k.startswith(MODEL_PREFIX) and k[len(MODEL_PREFIX) :] not in state)
    if extra:
        more = f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""
        raise SpecError(
            f"{extra[0][len(MODEL_PREFIX) :]}: in the checkpoint but not in the plan's model{more}", hint=hint
        )
    return out


def _write_shard(path: Path, tensors: list[_Tensor], step_dir: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Load `tensors` from the checkpoint, trim the vocabulary rows, write one safetensors file; returns what it
    wrote (names as transformers saves them)."""
    import safetensors.torch
    import torch

    want = {t.name: torch.empty(t.checkpoint_shape, dtype=t.dtype) for t in tensors}
    _dcp_load(want, step_dir)
    shard: dict[str, torch.Tensor] = {}
    for t in tensors:
        x = want.pop(t.name)
        if t.shape != t.checkpoint_shape:  # the padded vocabulary rows: a copy, so their memory goes now
            x = x[: t.shape[0]].clone()
        shard[t.name] = x
    shard = _revert_conversions(model, shard, path.name)
    safetensors.torch.save_file(shard, str(path), metadata={"format": "pt"})
    # safetensors creates the file 0600; an exported model is read by inference servers as any file the user writes.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
    return shard


def _dcp_load(want: dict[str, torch.Tensor], step_dir: Path) -> None:
    """Fill `want` (Hugging Face name -> empty tensor of the checkpoint's shape) from the DCP checkpoint, in this
    process (no process group). DCP copies each stored chunk into the target, casting to its dtype."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            # no_dist=True is the intent; DCP warns about the missing process group regardless.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": want}, storage_reader=FileSystemReader(str(step_dir)), no_dist=True)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise InputError(f"cannot read checkpoint {step_dir}: {_first_line(e)}") from None


def _revert_conversions(model: torch.nn.Module, shard: dict[str, torch.Tensor], name: str) -> dict[str, Any]:
    """Undo transformers' load-time weight conversions (transformers 5 fuses Mixtral's experts in memory and
    saves them per expert), per shard as save_pretrained does for offloaded models. Identity for Llama, GPT-2,
    Mistral, Qwen2."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: no load-time conversions, the in-memory names are the saved names
        return shard
    try:
        return dict(revert_weight_conversion(model, shard))
    except Exception as e:  # e.g. a many-to-one conversion whose inputs fell into different shard files
        raise RuntimeFailure(
            f"{name}: cannot convert the tensors to transformers' saved format ({type(e).__name__}: {_first_line(e)})",
            hint="a larger --max-shard-size keeps related tensors in one file",
        ) from None


def fresh_temp(out_arg: Path) -> tuple[Path, Path]:
    """(the absolute --out, the temporary folder beside it this process writes, not yet created); stale ones of
    killed exports removed."""
    out = Path(os.path.abspath(out_arg))
    _remove_stale_temps(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    return out, tmp


def _remove_stale_temps(out: Path) -> None:
    """Delete temporary folders that exports into `out` left when killed (their process is gone)."""
    prefix = f".{out.name}.tmp-"
    if not out.parent.is_dir():
        return
    for p in out.parent.iterdir():
        pid = p.name[len(prefix) :]
        if p.name.startswith(prefix) and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def raise_disk_full(e: BaseException, out: Path) -> None:
    """A full disk or quota while writing the export (an OSError, or safetensors' own error that carries the OS
    error): an OSError naming --out, which the CLI says in one line (llmctl.errors.disk_full). The temporary folder
    is gone and a previous --out is as it was."""
    full = disk_full(e)
    if full is not None:
        raise OSError(full, os.strerror(full), str(out)) from None


def publish_durably(tmp: Path, out: Path, force: bool) -> None:
    """EXPORT_MARKER written, every file and folder under `tmp` fsynced (durable before the rename publishes them),
    then `_publish`."""
    (tmp / EXPORT_MARKER).write_text(json.dumps({"written_by": "llmctl export"}) + "\n")
    for f in sorted(tmp.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        elif f.is_dir():
            fsync_dir(f)
    fsync_dir(tmp)
    _publish(tmp, out, force)


def _publish(tmp: Path, out: Path, force: bool) -> None:
    """Rename the complete `tmp` to `out`. An existing non-empty `out` (allowed by --force, checked earlier) is
    moved aside first and deleted after: `out` is at every moment the old folder, absent, or the new one."""
    old = None
    if out.is_dir() and any(out.iterdir()):
        if not force:  # files appeared since the check
            raise InputError(f"--out {out}: folder is not empty", hint="--force to replace it")
        _check_replaceable(out)  # again: the folder may have changed since the check
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    try:
        os.replace(tmp, out)  # onto an empty folder or none: a rename
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    fsync_dir(out.parent)
    if old is not None:
        if old.is_symlink():
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)


def _first_line(e: BaseException) -> str:
    failures = getattr(e, "failures", None)  # CheckpointException: rank -> the exception that rank raised
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))
        if isinstance(e, tuple):  # (exception, traceback) in some torch versions
            e = e[0]
    lines = str(e).strip().splitlines()
    text = (lines[-1] if lines[0].startswith("Traceback") else lines[0]) if lines else type(e).__name__
    if len(text) > 200:  # torch's long explanations: the first sentences say it
        text = text[: text.rfind(". ", 0, 200) + 1] or text[:200]
    return text
