"""A Hugging Face Hub model id ("Qwen/Qwen3-8B") to its config.json, without torch or transformers.

Planning needs only the architecture numbers in config.json, so this reads the local Hugging Face cache directly
(same folder, same layout and the same environment variables as huggingface_hub, so a model that `transformers` or
`hf download` fetched once is found at once and offline) and only when it is missing asks huggingface_hub to download
that one file. huggingface_hub is imported inside `_download` alone: planning works without it installed, and
importing this module stays cheap (a test checks that none of torch, transformers, huggingface_hub is imported).
Without network the answer comes at once: HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1) makes no network call at
all, and otherwise one short connection (hub_probe) precedes the download, whose retries would take 24 s.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from llmctl.errors import SpecError
from llmctl.fileio import load_json
from llmctl.spec import hub_probe

CONFIG_FILE = "config.json"

# One part of a repo id, after huggingface_hub.utils._validators.validate_repo_id: ASCII letters, digits, '.', '_'
# and '-', starting with a letter or digit and ending with a word character, at most 96 characters; '--' and '..'
# are refused (the cache folder name `models--org--name` uses '--' as its separator).
_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?")

# huggingface_hub.constants.ENV_VARS_TRUE_VALUES (compared upper-cased).
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}

# Multimodal wrappers whose config.json nests the language model under `text_config`, mapped to the model_type of
# that text model: the `model_type` of the sub-config class in transformers' configuration_<wrapper>.py
# (Gemma3Config -> Gemma3TextConfig "gemma3_text", Llama4Config -> Llama4TextConfig "llama4_text", ...).
# A wrapper not listed is returned as it is. Add an entry when a new family appears.
TEXT_MODEL_OF: dict[str, str] = {
    "gemma3": "gemma3_text",
    "gemma3n": "gemma3n_text",
    "gemma4": "gemma4_text",
    "llama4": "llama4_text",
    "qwen2_vl": "qwen2_vl_text",
    "qwen2_5_vl": "qwen2_5_vl_text",
    "qwen3_vl": "qwen3_vl_text",
    "qwen3_vl_moe": "qwen3_vl_moe_text",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "glm4v": "glm4v_text",
    # These two hold any text model (an AutoConfig sub-config): the text_config's own model_type wins, and the value
    # here is only transformers' default when it has none (SubConfigSpec(model_type=...) in their configuration).
    "mistral3": "mistral",
    "llava": "llama",
}
_TEXT_CONFIG_NAMES_ITS_TYPE = {"mistral3", "llava"}

# Keys some wrappers keep on the top level only, which describe the text model too: carried into the unwrapped
# config when its text_config lacks them (the dtype for the weight bytes, the tying for the embedding count).
_CARRIED_KEYS = ("torch_dtype", "dtype", "tie_word_embeddings")


def looks_like_hub_id(text: str) -> bool:
    """Whether `text` reads as a hub model id ("Qwen/Qwen3-8B") rather than a file: exactly one '/', both parts valid
    repo-id parts, no '.json' suffix and no existing local path of that name (a local folder `org/name` wins, as it
    does in transformers' from_pretrained)."""
    if text.count("/") != 1 or text.lower().endswith(".json"):
        return False
    if not all(_valid_part(part) for part in text.split("/")):
        return False
    try:
        return not Path(text).exists()
    except (OSError, ValueError):  # a name too long for the file system is still not a local path
        return True


def _valid_part(part: str) -> bool:
    return bool(_PART.fullmatch(part)) and "--" not in part and ".." not in part and not part.endswith(".git")


def hub_cache_dir() -> Path:
    """The hub cache folder, with huggingface_hub.constants' precedence: $HF_HUB_CACHE, then the legacy
    $HUGGINGFACE_HUB_CACHE, then $HF_HOME/hub, then $XDG_CACHE_HOME/huggingface/hub, then ~/.cache/huggingface/hub.
    Like huggingface_hub, a variable set to an empty string counts as set, and `~` and `$VARS` are expanded."""
    env = os.environ
    home = env.get("HF_HOME", os.path.join(env.get("XDG_CACHE_HOME", os.path.join("~", ".cache")), "huggingface"))
    home = os.path.expandvars(os.path.expanduser(home))
    hub = env.get("HF_HUB_CACHE", env.get("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub")))
    return Path(os.path.expandvars(os.path.expanduser(hub)))


def offline_setting() -> str | None:
    """'HF_HUB_OFFLINE=1' (the variable that forbids downloads, as it is set) or None when downloads are allowed.

    huggingface_hub.constants reads `HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE`: the first one set and non-empty
    decides, so HF_HUB_OFFLINE=0 overrides TRANSFORMERS_OFFLINE=1. Copied, so that we refuse exactly when it would."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = os.environ.get(name)
        if value:
            return f"{name}={value}" if value.strip().upper() in _TRUE_VALUES else None
    return None


def load_hub_config(repo_id: str, revision: str | None = None) -> tuple[dict, str]:
    """config.json of a hub model: (config dict, where it came from, e.g.
    '~/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/<sha>/config.json' or 'downloaded from the Hugging
    Face Hub (...)'). The local cache first; a download of config.json alone when it is not there and downloads are
    allowed. A multimodal wrapper (TEXT_MODEL_OF) gives its text model. Every failure is one SpecError line."""
    if repo_id.count("/") != 1 or not all(_valid_part(p) for p in repo_id.split("/")):
        raise SpecError(
            f"{repo_id!r} is not a Hugging Face Hub model id", hint="write it as org/name, e.g. Qwen/Qwen3-8B"
        )
    cache = hub_cache_dir()
    path = cached_config_path(repo_id, revision, cache)
    if path is not None:
        source = _display(path)
    else:
        offline = offline_setting()
        if offline:
            raise SpecError(
                f"{repo_id}: {CONFIG_FILE} is not in the local Hugging Face cache ({_display(cache)}) and {offline}"
                " forbids downloading it",
                hint=fill_cache_hint(repo_id, revision, cache),
            )
        path = _download(repo_id, revision, cache)
        source = f"downloaded from the Hugging Face Hub ({_display(path)})"
    if path.is_symlink() and not path.exists():
        raise SpecError(
            f"{source}: a broken link in the Hugging Face cache (its blob {os.readlink(path)} is missing)",
            hint=f"delete {_display(path.parent.parent.parent)} and download the model again",
        )
    config = load_json(path, CONFIG_FILE)
    if not isinstance(config, dict):
        raise SpecError(
            f"{source}: a {CONFIG_FILE} is a JSON object (model_type, hidden_size, ...), not a {_json_kind(config)}"
        )
    return unwrap_text_config(config, source)


def cached_repo_ids() -> list[str]:
    """The model ids of the local Hugging Face cache (`models--org--name` folders)."""
    try:
        names = [p.name for p in hub_cache_dir().iterdir() if p.name.startswith("models--")]
    except OSError:
        return []
    return sorted(n[len("models--") :].replace("--", "/", 1) for n in names)


def cached_config_path(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    """Where config.json of `repo_id` at `revision` lies in the hub cache, or None when it is not there.

    The layout is huggingface_hub's (file_download.try_to_load_from_cache): `models--{org}--{name}/refs/{revision}`
    holds a commit sha and `snapshots/{sha}/config.json` the file (a link into `blobs/`); a revision that is itself a
    commit sha names its snapshot folder directly. With no revision and no refs/main (a model fetched by commit, or a
    copied snapshot) the most recently modified snapshot holding a config.json is used. A broken link is returned
    too, so that the caller can say so instead of "not cached". An explicit revision never falls back to another
    snapshot: planning with a different version than asked would be wrong silently."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = revision or "main"
    if any(part in ("", ".", "..") for part in ref.split("/")):
        return None  # not a name a ref file can have; the Hub itself will refuse it
    sha = _read_ref(repo / "refs" / ref)
    for name in (sha, ref):
        if name and "/" not in name and name not in (".", ".."):
            candidate = snapshots / name / CONFIG_FILE
            if os.path.lexists(candidate):
                return candidate
    if revision is not None or sha is not None:
        return None
    try:
        found = [s / CONFIG_FILE for s in snapshots.iterdir() if os.path.lexists(s / CONFIG_FILE)]
    except OSError:  # no snapshots folder, or an unreadable one
        return None
    return max(found, key=lambda p: p.parent.stat().st_mtime, default=None)


def _read_ref(path: Path) -> str | None:
    try:
        sha = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return sha or None


def fill_cache_hint(repo_id: str, revision: str | None, cache: Path) -> str:
    """How to put config.json of `repo_id` into `cache` from a machine with network (`hf` is huggingface_hub's CLI
    since 0.34; `huggingface-cli`, the same command, before 1.0), or do without it."""
    rev = f" --revision {revision}" if revision else ""
    folder = "models--" + repo_id.replace("/", "--")
    return (
        f"on a machine with network run `hf download {repo_id} {CONFIG_FILE}{rev}` or, before huggingface_hub 1.0,"
        f" `huggingface-cli download {repo_id} {CONFIG_FILE}{rev}`, then copy {folder} from its Hugging Face cache"
        f" into {_display(cache)} here; or pass a {CONFIG_FILE} path"
    )


def _download(repo_id: str, revision: str | None, cache: Path) -> Path:
    """config.json alone, through huggingface_hub (which stores it in the cache above, so the next call finds it
    there), once hub_probe finds the Hub (or the proxy to it) reachable. Its typed errors become one line each; the
    class names are huggingface_hub's (errors.py, re-exported by huggingface_hub.utils since 0.x), caught subclass
    first: GatedRepoError is a RepositoryNotFoundError, and LocalEntryNotFoundError (no network, nothing cached) an
    EntryNotFoundError."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.utils import (
            EntryNotFoundError,
            GatedRepoError,
            HfHubHTTPError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise SpecError(
            f"{repo_id}: {CONFIG_FILE} is not in the local Hugging Face cache ({_display(cache)}) and downloading it"
            " needs huggingface_hub, which is not installed",
            hint=f"pip install 'llmctl[hub]', or pass a {CONFIG_FILE} path",
        ) from None
    at = f" at revision {revision!r}" if revision else ""
    no_network_hint = f"check the network or proxy; without one, {fill_cache_hint(repo_id, revision, cache)}"
    target = hub_probe.probe_target(hub_probe.hub_endpoint())
    reason = hub_probe.unreachable_reason(target)
    if reason is not None:
        raise SpecError(
            f"{repo_id}: {CONFIG_FILE} is not in the local Hugging Face cache ({_display(cache)}) and the Hugging Face"
            f" Hub cannot be reached ({target.name}: {reason})",
            hint=fill_cache_hint(repo_id, revision, cache),
        )
    try:
        return Path(hf_hub_download(repo_id, CONFIG_FILE, revision=revision))
    except GatedRepoError:
        raise SpecError(
            f"{repo_id} is a gated repository and this account has no access to it (or no token was sent)",
            hint=f"accept its terms on https://huggingface.co/{repo_id}, then `huggingface-cli login`"
            " (`hf auth login`) or set HF_TOKEN",
        ) from None
    except RepositoryNotFoundError:
        raise SpecError(
            f"{repo_id}: no such model repository on the Hugging Face Hub (or a private one)",
            hint="check the spelling; for a private repository `huggingface-cli login` or set HF_TOKEN",
        ) from None
    except RevisionNotFoundError:
        raise SpecError(
            f"{repo_id} has no revision {revision!r} on the Hugging Face Hub",
            hint="use a branch, tag or commit sha of the repository",
        ) from None
    except LocalEntryNotFoundError:
        raise SpecError(
            f"{repo_id}: cannot reach the Hugging Face Hub to download {CONFIG_FILE}, and it is not in the local"
            f" cache ({_display(cache)})",
            hint=no_network_hint,
        ) from None
    except EntryNotFoundError:
        raise SpecError(
            f"{repo_id} has no {CONFIG_FILE}{at}: not a transformers model repository (GGUF-only, an adapter, ...)",
            hint=f"pass the base model's id or a {CONFIG_FILE} path",
        ) from None
    except HFValidationError as e:
        raise SpecError(f"{repo_id}{at}: refused by huggingface_hub: {_first_line(e)}") from None
    except HfHubHTTPError as e:  # 5xx, 401 with a bad token, a disabled repository ...
        status = getattr(getattr(e, "response", None), "status_code", None)
        raise SpecError(
            f"{repo_id}: the Hugging Face Hub answered {status or 'with an error'} for {CONFIG_FILE}: {_first_line(e)}",
            hint="retry later, or pass a config.json path",
        ) from None
    except Exception as e:
        # The HTTP client's own errors escape hf_hub_download as they are (a proxy error, in huggingface_hub 1.x+
        # from httpx/httpx2, in 0.x from requests, an OSError subclass); matched by module so as to import neither.
        if isinstance(e, (ConnectionError, TimeoutError)) or _client_module(e):
            raise SpecError(
                f"{repo_id}: cannot reach the Hugging Face Hub ({type(e).__name__}: {_first_line(e)})",
                hint=no_network_hint,
            ) from None
        if isinstance(e, OSError):  # writing into the cache: disk full, permission denied
            raise SpecError(
                f"{repo_id}: cannot store {CONFIG_FILE} in the Hugging Face cache ({_display(cache)}):"
                f" {e.strerror or _first_line(e)}",
                hint="free space or set HF_HUB_CACHE to a writable folder",
            ) from None
        raise


def _client_module(e: BaseException) -> bool:
    return type(e).__module__.split(".")[0] in {"httpx", "httpx2", "httpcore", "requests", "urllib3"}


def unwrap_text_config(config: dict, source: str) -> tuple[dict, str]:
    """The text model of a multimodal wrapper's config (TEXT_MODEL_OF), with `model_type` the text model's, and the
    source saying so; any other config unchanged. The planner sizes the language model: the vision tower of a
    Gemma 3 or Llama 4 checkpoint is a small part of it, and its numbers (hidden_size, layers) are not the LM's."""
    wrapper = config.get("model_type")
    text = config.get("text_config")
    if not isinstance(wrapper, str) or wrapper not in TEXT_MODEL_OF or not isinstance(text, dict):
        return config, source
    merged = dict(text)
    for key in _CARRIED_KEYS:
        if key in config and key not in merged:
            merged[key] = config[key]
    own = text.get("model_type")
    use_own = wrapper in _TEXT_CONFIG_NAMES_ITS_TYPE and isinstance(own, str) and own
    merged["model_type"] = own if use_own else TEXT_MODEL_OF[wrapper]
    return merged, f"text model of a {wrapper} config: {source}"


def _display(path: Path | str) -> str:
    """`path` with the home folder written `~` (shorter in a one-line message, and what users type)."""
    p = str(path)
    home = os.path.expanduser("~")
    if home not in ("", "/", "~") and (p == home or p.startswith(home + os.sep)):
        return "~" + p[len(home) :]
    return p


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _json_kind(value: object) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")
