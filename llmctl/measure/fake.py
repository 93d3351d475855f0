"""Measure any transformers causal LM on fake tensors: its parameter counts and the bytes its training forward saves.

A Hugging Face `model_type` that llmctl has no analytical model for (llmctl.families) is measured instead:

- Parameters: the full model is built on the meta device (shapes, no memory) and counted exactly (llmctl.measure.hf).
- Activations: a training forward (train mode, so dropout masks count) runs under `FakeTensorMode`, which computes
  shapes and dtypes but no values and allocates nothing: measuring a Llama-3-70B-shaped config takes ~3 s on a
  laptop CPU. Every tensor autograd saves for backward is counted once per storage (llmctl.measure.saved),
  parameters, buffers and the batch excluded, and charged to the region that created it: a decoder layer or the
  head, so `sum(kind bytes x count) + head` is the model's saved bytes. Full activation checkpointing wraps each
  layer in non-reentrant `torch.utils.checkpoint`, and what a checkpointed layer keeps alive is counted too: for a
  Llama that is the layer input, b*s*h*act_bytes. Where the CPU kernels save other bytes than a GPU's (dropout
  masks, fused attention), the GPU's are used (llmctl.measure.forward).
- The activation model is shorter than the real one when it can be: the shortest prefix of layers that holds every
  kind, plus one layer so that every kind is measured where a layer follows it (per-layer config lists such as
  `layer_types` are cut to match; a kind found only in the last layer is measured in a model one layer deeper, the
  lists repeated from their start; when the built model's first layers do not have the full model's signatures,
  the full depth is measured). Parameters always come from the full model.
- Bytes are fit as a*b*s + c*b*s*s through two sequence lengths at b=1 and checked at a third (SEQ_LENS).

A real CPU forward without dropout, with the same hooks, saves exactly the bytes the fake one reports
(tests/measure/test_fake.py).

`measure_config(cfg)` returns plain JSON data, cached as `cache_dir/<config_hash>.json` (llmctl.measure.cache):

    version            MEASURE_VERSION
    model_type         cfg["model_type"]
    config_hash        sha256 of the canonical JSON of cfg, MEASURE_VERSION and the torch and transformers versions
    total_params       sum(p.numel()) over model.parameters() of the full model (tied parameters once)
    embedding_params   nn.Embedding parameters outside the decoder layers (token, position, per-layer embeddings)
    head_params        everything else outside the decoder layers (final norm, an untied lm_head)
    layers             one entry per decoder-layer kind, layers grouped by (class, sorted parameter names and shapes,
                       attention type: layer attributes such as attention_type / sliding_window and per-layer
                       config lists such as layer_types):
                       {"kind": id, "params": per layer, "count": n, "indices": [i, ...], "matmul_params": per layer
                       (parameters of >= 2-D weights), "active_params" / "active_matmul_params": the same per token (routed
                       experts count k/E)}. Layers sharing weights (zamba) count them in each kind.
    saved              {"<act_bytes>/<attention>/<checkpointing>": {"<kind>": [a, c]}}, act_bytes in {4, 2}
                       (fp32, bf16 weights and activations), attention in {sdpa, eager}, checkpointing in
                       {none, full}: one layer of that kind saves a*b*s + c*b*s*s bytes for backward
    head_saved         {"<act_bytes>/<attention>": [a, c]}: what the head saves, same form, without checkpointing
                       (position tables of shape (1, s, d) do not grow with b: at b > 1 this slightly overcounts)
    head_saved_checkpointed  the same when every layer is fully checkpointed: the checkpoints also keep what the
                       head passes every layer, such as eager attention's (b, 1, s, s) mask
    attention_used     {"sdpa": impl, "eager": impl}: what transformers built (models without sdpa use eager)
    fit_error          only when a fit misses the third length by more than FIT_TOLERANCE:
                       {"<act_bytes>/<attention>/<checkpointing>/<kind or head>": relative error}
    seconds            time the measurement took (a cache hit returns the original)

torch and transformers are imported inside functions (llmctl.measure.forward imports torch), so importing this module
(and a cache hit, which reads package versions from metadata) stays cheap: `llmctl estimate` and `plan` reach it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from importlib import util
from pathlib import Path
from typing import Any

from llmctl.errors import SpecError
from llmctl.families.modules import decoder_layers
from llmctl.measure import cache, hf
from llmctl.spec.attention import Attention

ACT_BYTES = {4: "float32", 2: "bfloat16"}
ATTENTIONS = ("sdpa", "eager")
CHECKPOINTING = ("none", "full")
SEQ_LENS = (256, 512, 1024)
"""Sequence lengths measured at b=1: the fit goes through the first two and is checked at the third (other lengths
for short position tables and sliding windows: _seq_lens)."""
FIT_TOLERANCE = 0.01

log = logging.getLogger("llmctl.measure")


def available() -> bool:
    """Whether torch and transformers are installed (found without importing them)."""
    return all(util.find_spec(m) is not None for m in ("torch", "transformers"))


def measure_config(
    cfg: dict,
    *,
    cache_dir: Path | None = None,
    refresh: bool = False,
    announce: Callable[[Path], None] | None = None,
) -> dict:
    """Measure a Hugging Face config (config.json contents as a dict, with model_type): see the module docstring.
    The result is cached; `refresh` measures again. `announce(cache file)` is called when a measurement starts, once
    transformers has accepted the config. Raises SpecError (one line) for a config that cannot be built or
    measured."""
    model_type = hf.model_type_of(cfg)
    if not available():
        raise SpecError(
            f"model_type {model_type!r}: measuring it needs torch and transformers", hint="pip install 'llmctl[train]'"
        )
    key = cache.config_hash(cfg)
    path = Path(cache_dir if cache_dir is not None else cache.default_cache_dir()) / f"{key}.json"
    if not refresh:
        cached = cache.read(path, key)
        if cached is not None:
            return cached
    result = _measure(cfg, model_type, key, lambda: announce(path) if announce else None)
    cache.write(path, result)
    return result


def install() -> None:
    """Make llmctl.spec measure model types outside the analytical families with `measure_config` (default cache).
    Cheap: nothing heavy is imported until a config needs measuring."""
    from llmctl.spec import models

    models.set_measurer(_measure_announced)


def _measure_announced(cfg: dict) -> dict:
    """measure_config, saying on stderr what takes the seconds when it is not a cache hit."""
    import sys

    def announce(path: Path) -> None:
        print(
            f"llmctl: measuring model_type {cfg.get('model_type')!r} on fake tensors (no analytical model; "
            f"cached in {path.parent})",
            file=sys.stderr,
        )

    return measure_config(cfg, announce=announce)


# --- the fit --------------------------------------------------------------------------------------------------------
def _positive_ints(config: Any, names: tuple[str, ...]) -> list[int]:
    values = (hf.config_value(config, n) for n in names)
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]


def _seq_lens(config: Any) -> tuple[int, int, int]:
    """Three lengths within the model's positions: 256, 512, 1024 by default. With a sliding window (or attention
    chunk) of w >= 256, all three are at or past it (2w, 4w, 8w, or half, three quarters and all of the positions):
    below the window sdpa skips the mask, and a fit through both regimes predicts neither; past it is where
    long-context training, the case memory planning is about, runs. Learned positions fewer than 1024 (BERT's 512):
    a quarter, half and all of them."""
    configs = (config, hf.text_config(config))
    positions = [v for c in configs for v in _positive_ints(c, ("max_position_embeddings", "n_positions", "n_ctx"))]
    windows = [v for c in configs for v in _positive_ints(c, ("sliding_window", "attention_chunk_size"))]
    most, window = min(positions, default=SEQ_LENS[-1]), min(windows, default=0)
    n = SEQ_LENS[0]
    if window >= n and 8 * window <= most:
        return (2 * window, 4 * window, 8 * window)
    if window >= n and 2 * window <= most:
        return (most // 2, 3 * most // 4, most)
    if 4 * n > most and most >= 8:
        n = most // 4
    return (n, 2 * n, 4 * n)


def _fit(points: dict[int, int]) -> tuple[list[float], float]:
    """([a, c] with bytes = a*s + c*s*s at b=1 through the two shorter lengths, relative error at the longest)."""
    (s1, y1), (s2, y2), (s3, y3) = sorted(points.items())
    c = (y2 / s2 - y1 / s1) / (s2 - s1)
    a = y1 / s1 - c * s1
    predicted = a * s3 + c * s3 * s3
    error = abs(predicted - y3) / y3 if y3 else abs(predicted)
    return [a, c], error


# --- the measurement -------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Measuring is not the user's training run: transformers' config advice, torch's warnings and the traceback
    torch logs when a fake kernel fails (the failure itself becomes one SpecError line) are kept off the terminal."""
    import warnings

    from transformers.utils import logging as hf_logging

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    verbosity, level = hf_logging.get_verbosity(), fake_log.level
    hf_logging.set_verbosity_error()
    fake_log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        fake_log.setLevel(level)


def _eager(implementation: str) -> bool:
    """Whether transformers' attention implementation keeps the scores (its eager path)."""
    return Attention(implementation).keeps_scores


def _measure(cfg: dict, model_type: str, key: str, started: Callable[[], None] = lambda: None) -> dict:
    with _quiet():
        return _measure_quietly(cfg, model_type, key, started)


def _measure_quietly(cfg: dict, model_type: str, key: str, started: Callable[[], None]) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmctl.measure.forward import to_fake

    start = time.perf_counter()
    config = hf.hf_config(cfg, model_type)
    started()
    full = hf.build(config, model_type, "float32")
    layers = decoder_layers(full, model_type)
    signatures, lists = hf.layer_table(full, config, layers)
    kind_of = hf.kind_ids(signatures)
    kinds = [kind_of[s] for s in signatures]
    counts = hf.param_counts(full, layers, kinds, config)
    # The shortest prefix holding one layer of every kind, and one layer more: a layer's output is saved by the
    # next layer (or held by its checkpoint), while after the last layer the final norm may save a converted copy
    # (RMSNorm's fp32 upcast of bf16) that belongs to the head. Kinds are measured where a layer follows them; a
    # kind found only in the last layer is measured in a model one layer deeper (_short_model).
    depth = 2 + max(kinds.index(k) for k in set(kinds))
    seq_lens = _seq_lens(config)
    del full, layers

    result: dict[str, Any] = {"version": cache.MEASURE_VERSION, "model_type": model_type, "config_hash": key, **counts}
    saved: dict[str, dict[str, list[float]]] = {}
    head_saved: dict[str, list[float]] = {}
    head_checkpointed: dict[str, list[float]] = {}
    used: dict[str, str] = {}
    fit_error: dict[str, float] = {}
    for attention in ATTENTIONS:
        for act_bytes, dtype_name in ACT_BYTES.items():
            fell_back = attention in used and _eager(used[attention]) and not _eager(attention)
            if fell_back:
                continue  # a model without sdpa: measured with eager below, copied after the loop
            model, used[attention] = _short_model(config, model_type, dtype_name, attention, depth, signatures, lists)
            if _eager(used[attention]) and not _eager(attention):
                continue
            layers = decoder_layers(model, model_type)
            mode = FakeTensorMode()
            to_fake(model, mode)
            for ckpt in CHECKPOINTING:
                by_len = {s: _run(model, layers, s, ckpt, mode, model_type) for s in seq_lens}
                if ckpt == "none" and not any(any(v[0]) for v in by_len.values()):
                    # Every layer with parameters saves its matmul inputs: the model ran its layers without
                    # calling them as modules (no hooks), and their bytes would be charged to the head.
                    raise SpecError(
                        f"model_type {model_type!r}: its decoder layers ({type(layers[0]).__name__}) saved nothing "
                        "for backward while running; cannot tell their activations from the rest"
                    )
                name = f"{act_bytes}/{attention}/{ckpt}"
                saved[name] = {}
                real = min(len(layers), len(kinds))  # a deeper model's extra layer is not one of the real ones
                for kind in dict.fromkeys(kinds[:real]):
                    at = [i for i in range(real) if kinds[i] == kind]
                    at = [i for i in at if i < len(layers) - 1] or at
                    saved[name][kind], err = _fit({s: max(v[0][i] for i in at) for s, v in by_len.items()})
                    if err > FIT_TOLERANCE:
                        fit_error[f"{name}/{kind}"] = err
                head, err = _fit({s: v[1] for s, v in by_len.items()})
                if err > FIT_TOLERANCE:
                    fit_error[f"{name}/head"] = err
                (head_saved if ckpt == "none" else head_checkpointed)[f"{act_bytes}/{attention}"] = head
    if _eager(used["sdpa"]):  # transformers fell back: sdpa training runs eager attention
        for act_bytes in ACT_BYTES:
            for ckpt in CHECKPOINTING:
                saved[f"{act_bytes}/sdpa/{ckpt}"] = saved[f"{act_bytes}/eager/{ckpt}"]
            head_saved[f"{act_bytes}/sdpa"] = head_saved[f"{act_bytes}/eager"]
            head_checkpointed[f"{act_bytes}/sdpa"] = head_checkpointed[f"{act_bytes}/eager"]
    result.update(saved=saved, head_saved=head_saved, head_saved_checkpointed=head_checkpointed)
    result["attention_used"] = used
    if fit_error:
        result["fit_error"] = fit_error
    result["seconds"] = round(time.perf_counter() - start, 3)
    return result


def _short_model(
    config: Any, model_type: str, dtype_name: str, attention: str, depth: int, signatures: list[tuple], lists: list[str]
) -> tuple[Any, str]:
    """The model cut (or grown by one layer) to `depth` layers if its first layers keep the full model's signatures,
    else the full model."""
    if depth != len(signatures):
        keep = min(depth, len(signatures))
        try:
            short = hf.short_config(config, depth, lists)
            model, used = hf.build_attention(short, model_type, dtype_name, attention)
            layers = decoder_layers(model, model_type)
            if len(layers) == depth and hf.layer_table(model, short, layers)[0][:keep] == signatures[:keep]:
                return model, used
        except Exception:  # noqa: BLE001 - a config that refuses the cut (validated on assignment): no cut
            pass
        log.info(
            "%s: cannot build %d layers that keep the kinds of its first; measuring all %d",
            model_type,
            depth,
            len(signatures),
        )
    return hf.build_attention(config, model_type, dtype_name, attention)


def _run(model: Any, layers: Any, seq: int, checkpointing: str, mode: Any, model_type: str) -> tuple[list[int], int]:
    from llmctl.measure.forward import saved_bytes

    try:
        return saved_bytes(model, layers, 1, seq, checkpointing, mode)
    except SpecError:
        raise
    except Exception as e:  # noqa: BLE001 - model code that needs values (data-dependent routing, .item()) fails
        # here: a limit of the method for this architecture, said in one line (the debug switch shows the cause)
        raise SpecError(
            f"model_type {model_type!r}: cannot run its forward on fake tensors: {hf.first_line(e)}",
            hint="this architecture needs an analytical model in llmctl.families",
        ) from e
