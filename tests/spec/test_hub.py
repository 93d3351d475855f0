"""Hub ids to config.json: the local cache (huggingface_hub's layout and env vars) first, then a download whose
errors are one line each. No network: downloads are either forbidden (HF_HUB_OFFLINE=1) or a fake hf_hub_download
that raises huggingface_hub's real exception classes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmctl.errors import SpecError
from llmctl.spec import hub, hub_probe

SHA = "a" * 40
OLD_SHA = "b" * 40
CONFIG = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2}

_HF_ENV = (
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_HOME",
    "XDG_CACHE_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No variable of the machine running the tests leaks in; HOME is a fresh folder, and downloads are forbidden
    unless a test allows them (with a fake hf_hub_download)."""
    for name in _HF_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The probe before a download finds the Hub reachable without a connection (test_hub_offline.py tests it).
    monkeypatch.setattr(hub_probe, "unreachable_reason", lambda target, timeout_s=None: None)


def add_snapshot(
    cache: Path, repo_id: str, sha: str, config: object = CONFIG, ref: str | None = "main", raw: str | None = None
) -> Path:
    """A model in the hub cache as huggingface_hub lays it out: the file in blobs/, a relative link to it in
    snapshots/<sha>/, the sha in refs/<ref>."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blob = repo / "blobs" / f"blob-{sha[:8]}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_text(raw if raw is not None else json.dumps(config))
    link = repo / "snapshots" / sha / "config.json"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(sha)
    return link


# --- looks_like_hub_id ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B", "google/gemma-3-4b-it", "org_1/model.v2_final", "a/b", "A1/x_"],
)
def test_hub_ids(text) -> None:
    assert hub.looks_like_hub_id(text)


@pytest.mark.parametrize(
    "text",
    [
        "Qwen3-8B",  # no org: a preset name or a file
        "a/b/c",
        "/abs/path",
        "./a",
        "org/config.json",
        "org/CONFIG.JSON",
        "org/",
        "/name",
        "-org/name",
        "org/.name",
        "org/name-",
        "org/name.",
        "org/na--me",
        "org/na..me",
        "org/name.git",
        "org/na me",
        "org/café",
        "org/" + "x" * 97,
        "",
    ],
)
def test_not_hub_ids(text) -> None:
    assert not hub.looks_like_hub_id(text)


def test_an_existing_local_path_is_not_a_hub_id(tmp_path, monkeypatch) -> None:
    (tmp_path / "org" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not hub.looks_like_hub_id("org/model")
    assert hub.looks_like_hub_id("org/other")


# --- where the cache is ----------------------------------------------------------------------------------------------


def test_cache_dir_follows_huggingface_hub_precedence(tmp_path, monkeypatch) -> None:
    home = tmp_path / "home"
    assert hub.hub_cache_dir() == home / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", "~/hf")  # expanded, like huggingface_hub.constants does
    assert hub.hub_cache_dir() == home / "hf" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "legacy"))
    assert hub.hub_cache_dir() == tmp_path / "legacy"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "new"))
    assert hub.hub_cache_dir() == tmp_path / "new"


def test_cache_dir_agrees_with_installed_huggingface_hub(tmp_path) -> None:
    """The same answer as huggingface_hub.constants.HF_HUB_CACHE for each layer of variables (a fresh interpreter
    each time: it reads them at import)."""
    pytest.importorskip("huggingface_hub")
    layers = [
        {},
        {"XDG_CACHE_HOME": str(tmp_path / "xdg")},
        {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "HF_HOME": str(tmp_path / "hf")},
        {"HF_HOME": str(tmp_path / "hf"), "HUGGINGFACE_HUB_CACHE": str(tmp_path / "legacy")},
        {"HUGGINGFACE_HUB_CACHE": str(tmp_path / "legacy"), "HF_HUB_CACHE": str(tmp_path / "new")},
    ]
    code = (
        "import huggingface_hub.constants as c; from llmctl.spec import hub; print(c.HF_HUB_CACHE, hub.hub_cache_dir())"
    )
    for layer in layers:
        env = {k: v for k, v in os.environ.items() if k not in _HF_ENV} | layer
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        theirs, ours = out.stdout.split()
        assert theirs == ours, layer


@pytest.mark.parametrize(
    "env",
    [
        {"HF_HUB_CACHE": "{cache}"},
        {"HUGGINGFACE_HUB_CACHE": "{cache}", "HF_HOME": "{tmp}/elsewhere"},
        {"HF_HOME": "{tmp}/hf"},
        {"XDG_CACHE_HOME": "{tmp}/xdg"},
        {},
    ],
)
def test_found_through_each_variable(tmp_path, monkeypatch, env) -> None:
    cache = {
        "HF_HUB_CACHE": tmp_path / "cache",
        "HUGGINGFACE_HUB_CACHE": tmp_path / "cache",
        "HF_HOME": tmp_path / "hf" / "hub",
        "XDG_CACHE_HOME": tmp_path / "xdg" / "huggingface" / "hub",
    }.get(next(iter(env), ""), tmp_path / "home" / ".cache" / "huggingface" / "hub")
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(cache=cache, tmp=tmp_path))
    link = add_snapshot(cache, "Qwen/Qwen3-8B", SHA)
    config, source = hub.load_hub_config("Qwen/Qwen3-8B")
    assert config == CONFIG
    if env:
        assert source == str(link)
    else:  # under HOME: written with ~
        assert source == f"~/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/{SHA}/config.json"


# --- the cache layout ------------------------------------------------------------------------------------------------


def test_ref_picks_the_snapshot(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    add_snapshot(tmp_path, "org/m", OLD_SHA, {"model_type": "old"}, ref="v1")
    add_snapshot(tmp_path, "org/m", SHA, {"model_type": "new"}, ref="main")
    assert hub.load_hub_config("org/m")[0] == {"model_type": "new"}
    config, source = hub.load_hub_config("org/m", revision="v1")
    assert config == {"model_type": "old"} and OLD_SHA in source
    # A commit sha names its snapshot folder; a ref with a slash (refs/pr/1) is a nested file, as in huggingface_hub.
    assert hub.load_hub_config("org/m", revision=OLD_SHA)[0] == {"model_type": "old"}
    add_snapshot(tmp_path, "org/m", "c" * 40, {"model_type": "pr"}, ref="refs/pr/1")
    assert hub.load_hub_config("org/m", revision="refs/pr/1")[0] == {"model_type": "pr"}


def test_without_refs_the_newest_snapshot_with_a_config(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    old = add_snapshot(tmp_path, "org/m", OLD_SHA, {"model_type": "old"}, ref=None)
    new = add_snapshot(tmp_path, "org/m", SHA, {"model_type": "new"}, ref=None)
    os.utime(old.parent, (1_000, 1_000))
    os.utime(new.parent, (2_000, 2_000))
    (tmp_path / "models--org--m" / "snapshots" / ("d" * 40)).mkdir()  # newest, but without a config.json
    assert hub.load_hub_config("org/m") == ({"model_type": "new"}, str(new))
    os.utime(old.parent, (3_000, 3_000))
    assert hub.load_hub_config("org/m")[0] == {"model_type": "old"}


def test_an_explicit_revision_never_falls_back_to_another_snapshot(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    add_snapshot(tmp_path, "org/m", SHA, ref=None)
    with pytest.raises(SpecError, match="not in the local Hugging Face cache"):
        hub.load_hub_config("org/m", revision="v2")


def test_offline_and_not_cached_is_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(SpecError) as e:
        hub.load_hub_config("Qwen/Qwen3-8B")
    assert e.value.message == (
        f"Qwen/Qwen3-8B: config.json is not in the local Hugging Face cache ({tmp_path}) and HF_HUB_OFFLINE=1"
        " forbids downloading it"
    )
    assert "pass a config.json path" in e.value.hint and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "env,offline",
    [
        ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE=1"),
        ({"HF_HUB_OFFLINE": "True"}, "HF_HUB_OFFLINE=True"),
        ({"HF_HUB_OFFLINE": "on"}, "HF_HUB_OFFLINE=on"),
        ({"TRANSFORMERS_OFFLINE": "YES"}, "TRANSFORMERS_OFFLINE=YES"),
        ({"TRANSFORMERS_OFFLINE": "0"}, None),
        ({"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"}, None),  # huggingface_hub: the first one set decides
        ({"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "1"}, "TRANSFORMERS_OFFLINE=1"),
        ({}, None),
    ],
)
def test_offline_setting(monkeypatch, env, offline) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert hub.offline_setting() == offline


def test_a_broken_link_is_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    link = add_snapshot(tmp_path, "org/m", SHA)
    link.resolve().unlink()  # the blob is gone, the link stays
    with pytest.raises(SpecError, match="broken link in the Hugging Face cache") as e:
        hub.load_hub_config("org/m")
    assert str(tmp_path / "models--org--m") in e.value.hint


@pytest.mark.parametrize(
    "raw,needle",
    [
        ("[1, 2]", "a config.json is a JSON object (model_type, hidden_size, ...), not a list"),
        ('"gemma"', "not a string"),
        ("null", "not a null"),
        ("{", "is not valid JSON"),
        ("", "empty config.json"),
    ],
)
def test_a_config_that_is_not_a_json_object(tmp_path, monkeypatch, raw, needle) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    add_snapshot(tmp_path, "org/m", SHA, raw=raw)
    with pytest.raises(SpecError, match=None) as e:
        hub.load_hub_config("org/m")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_bad_repo_id_is_refused(monkeypatch) -> None:
    with pytest.raises(SpecError, match="not a Hugging Face Hub model id"):
        hub.load_hub_config("a/b/c")


# --- multimodal wrappers ---------------------------------------------------------------------------------------------


def test_gemma3_gives_its_text_model(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    wrapper = {
        "model_type": "gemma3",
        "torch_dtype": "bfloat16",
        "text_config": {"hidden_size": 2560, "num_hidden_layers": 34, "model_type": "gemma3_text"},
        "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"},
    }
    link = add_snapshot(tmp_path, "google/gemma-3-4b-it", SHA, wrapper)
    config, source = hub.load_hub_config("google/gemma-3-4b-it")
    assert config == {
        "hidden_size": 2560,
        "num_hidden_layers": 34,
        "model_type": "gemma3_text",
        "torch_dtype": "bfloat16",
    }
    assert source == f"text model of a gemma3 config: {link}"


def test_llama4_text_config_without_model_type() -> None:
    config, source = hub.unwrap_text_config(
        {"model_type": "llama4", "tie_word_embeddings": False, "text_config": {"hidden_size": 5120}}, "x"
    )
    assert config == {"hidden_size": 5120, "model_type": "llama4_text", "tie_word_embeddings": False}
    assert source == "text model of a llama4 config: x"


def test_auto_wrappers_keep_their_text_models_type() -> None:
    assert hub.unwrap_text_config({"model_type": "mistral3", "text_config": {"model_type": "ministral"}}, "x")[0] == {
        "model_type": "ministral"
    }
    assert hub.unwrap_text_config({"model_type": "llava", "text_config": {}}, "x")[0] == {"model_type": "llama"}


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "qwen3", "hidden_size": 8},
        {"model_type": "qwen2_5_vl", "hidden_size": 8, "vision_config": {}},  # flat: the LM numbers at the top
        {"model_type": "gemma3", "text_config": None},
        {"model_type": "t5", "text_config": {"model_type": "x"}},  # not a listed wrapper
    ],
)
def test_other_configs_are_unchanged(config) -> None:
    assert hub.unwrap_text_config(config, "src") == (config, "src")


def test_text_model_types_match_transformers() -> None:
    """Each TEXT_MODEL_OF entry is the model_type transformers gives the wrapper's text sub-config (its class's
    model_type, or for an AutoConfig sub-config the default it declares)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for wrapper, text_type in hub.TEXT_MODEL_OF.items():
        if wrapper not in CONFIG_MAPPING:
            continue  # an older transformers: nothing to compare with
        sub = CONFIG_MAPPING[wrapper].sub_configs["text_config"]
        if sub is transformers.AutoConfig:
            assert wrapper in hub._TEXT_CONFIG_NAMES_ITS_TYPE, wrapper
            assert CONFIG_MAPPING[wrapper]().text_config.model_type == text_type, wrapper
        else:
            assert sub.model_type == text_type, wrapper


# --- the download path -----------------------------------------------------------------------------------------------


def _response(status: int):
    httpx2 = pytest.importorskip("httpx2")
    return httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/org/m/resolve/main/x"))


def _hub_errors() -> list[tuple[BaseException, str, str]]:
    """(the exception hf_hub_download raises, what the message says, what the hint says)."""
    errors = pytest.importorskip("huggingface_hub.errors")
    httpx2 = pytest.importorskip("httpx2")
    return [
        (errors.GatedRepoError("403 gated", response=_response(403)), "is a gated repository", "HF_TOKEN"),
        (errors.RepositoryNotFoundError("404", response=_response(404)), "no such model repository", "HF_TOKEN"),
        (errors.RevisionNotFoundError("404", response=_response(404)), "has no revision 'v9'", "branch, tag"),
        (errors.RemoteEntryNotFoundError("404", response=_response(404)), "has no config.json at revision", "path"),
        (
            errors.LocalEntryNotFoundError("connection is off"),
            "cannot reach the Hugging Face Hub",
            "hf download org/m config.json --revision v9",
        ),
        (errors.HfHubHTTPError("502 Bad Gateway\nmore", response=_response(502)), "answered 502", "retry later"),
        (errors.HFValidationError("Invalid rev"), "refused by huggingface_hub: Invalid rev", ""),
        (
            httpx2.ProxyError("proxy said no"),
            "cannot reach the Hugging Face Hub (ProxyError",
            "hf download org/m config.json --revision v9",
        ),
        (ConnectionError("reset"), "cannot reach the Hugging Face Hub", "hf download org/m config.json --revision v9"),
        (OSError(28, "No space left on device"), "cannot store config.json", "HF_HUB_CACHE"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_each_download_error_is_one_line(tmp_path, monkeypatch, case) -> None:
    error, needle, hint = _hub_errors()[case]
    import huggingface_hub

    def fake_download(repo_id, filename, revision=None):
        raise error

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    with pytest.raises(SpecError) as e:
        hub.load_hub_config("org/m", revision="v9")
    assert needle in e.value.message and hint in (e.value.hint or "")
    assert "\n" not in str(e.value) and e.value.__cause__ is None


def test_a_download_is_read_and_unwrapped(tmp_path, monkeypatch) -> None:
    import huggingface_hub

    calls = []
    downloaded = tmp_path / "dl" / "config.json"
    downloaded.parent.mkdir()
    downloaded.write_text(json.dumps({"model_type": "gemma3", "text_config": {"hidden_size": 8}}))

    def fake_download(repo_id, filename, revision=None):
        calls.append((repo_id, filename, revision))
        return str(downloaded)

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    config, source = hub.load_hub_config("google/gemma-3-4b-it", revision="main")
    assert calls == [("google/gemma-3-4b-it", "config.json", "main")]
    assert config == {"hidden_size": 8, "model_type": "gemma3_text"}
    assert source == f"text model of a gemma3 config: downloaded from the Hugging Face Hub ({downloaded})"


def test_without_huggingface_hub_installed(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # `import huggingface_hub` raises ImportError
    with pytest.raises(SpecError, match="needs huggingface_hub, which is not installed") as e:
        hub.load_hub_config("org/m")
    assert "pip install 'llmctl[hub]'" in e.value.hint


def test_the_cache_is_read_without_huggingface_hub(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    add_snapshot(tmp_path, "org/m", SHA)
    assert hub.load_hub_config("org/m")[0] == CONFIG


def test_importing_hub_imports_no_heavy_package() -> None:
    code = (
        "import sys, llmctl.spec.hub; "
        "print(sorted(m for m in ('torch', 'transformers', 'huggingface_hub') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
