"""A hub id on a machine without network: the one-line error comes at once, never after huggingface_hub's 24 s of
retries. HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE make no network call at all; otherwise one short TCP probe goes where
huggingface_hub's client would connect (HF_ENDPOINT, or the proxy for it). No test here reaches beyond 127.0.0.1:
the Hub is a closed or a listening local port, and a silent network is a connect that blocks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.errors import SpecError
from llmctl.spec import hub, hub_probe

MODEL = "Qwen/Qwen2.5-Coder-7B"
CONFIG = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2}

_ENV = (
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_HOME",
    "XDG_CACHE_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_ENDPOINT",
    "HUGGINGFACE_CO_STAGING",
    *(f"{scheme}_proxy" for scheme in ("http", "https", "all", "no")),
    *(f"{scheme}_PROXY" for scheme in ("HTTP", "HTTPS", "ALL", "NO")),
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """Nothing of the machine running the tests leaks in (its proxies, its cache, its HF_ENDPOINT); the cache lives
    under HF_HOME in a fresh folder, so that the message must name HF_HOME/hub."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


@pytest.fixture
def downloads(monkeypatch, tmp_path) -> list[tuple]:
    """hf_hub_download replaced: each call is recorded and gets a config.json written under tmp_path."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    calls: list[tuple] = []
    path = tmp_path / "downloaded" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(CONFIG))

    def fake_download(repo_id, filename, revision=None):
        calls.append((repo_id, filename, revision))
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    return calls


@pytest.fixture
def connects(monkeypatch) -> list[tuple]:
    """Every socket connection or name lookup the code attempts, recorded; each fails as a network-less machine
    would (so a call that should not happen also cannot reach anything)."""
    calls: list[tuple] = []

    def no_connect(address, *args, **kwargs):
        calls.append(("connect", address))
        raise OSError(101, "Network is unreachable")

    def no_lookup(host, *args, **kwargs):
        calls.append(("getaddrinfo", host))
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", no_connect)
    monkeypatch.setattr(socket, "getaddrinfo", no_lookup)
    return calls


@pytest.fixture
def listening():
    """A local port that accepts connections (the backlog holds them; nothing needs to answer)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


def closed_port() -> int:
    """A local port nobody listens on: bound by the kernel's choice, then released (connect is refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fill_hint_needles(cache: Path) -> list[str]:
    return [f"`hf download {MODEL} config.json`", "models--Qwen--Qwen2.5-Coder-7B", str(cache), "config.json path"]


# --- HF_HUB_OFFLINE: no network call at all -------------------------------------------------------------------------


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"TRANSFORMERS_OFFLINE": "1"}])
def test_offline_makes_no_network_call(monkeypatch, tmp_path, downloads, connects, env) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SpecError) as e:
        hub.load_hub_config(MODEL)
    assert connects == [] and downloads == []
    cache = tmp_path / "hf" / "hub"
    name, value = next(iter(env.items()))
    assert e.value.message == (
        f"{MODEL}: config.json is not in the local Hugging Face cache ({cache}) and {name}={value} forbids"
        " downloading it"
    )
    assert all(needle in e.value.hint for needle in fill_hint_needles(cache)), e.value.hint
    assert "\n" not in str(e.value)


def test_offline_reads_a_filled_cache(monkeypatch, tmp_path, downloads, connects) -> None:
    """What the hint tells the user to do (copy models--org--name into the cache) is enough."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = tmp_path / "hf" / "hub" / "models--Qwen--Qwen2.5-Coder-7B" / "snapshots" / ("c" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(CONFIG))
    config, _ = hub.load_hub_config(MODEL)
    assert config == CONFIG and connects == [] and downloads == []


def test_the_hint_names_the_revision(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SpecError) as e:
        hub.load_hub_config(MODEL, revision="v1.1")
    assert f"`hf download {MODEL} config.json --revision v1.1`" in e.value.hint


# --- online: one short probe before any download --------------------------------------------------------------------


def test_an_unreachable_hub_is_one_line_at_once(monkeypatch, tmp_path, downloads) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint + "/")  # huggingface_hub strips the trailing '/'
    start = time.monotonic()
    with pytest.raises(SpecError) as e:
        hub.load_hub_config(MODEL)
    assert time.monotonic() - start < 1.0
    assert downloads == []  # huggingface_hub, and its retries, never ran
    cache = tmp_path / "hf" / "hub"
    assert e.value.message == (
        f"{MODEL}: config.json is not in the local Hugging Face cache ({cache}) and the Hugging Face Hub cannot be"
        f" reached ({endpoint}: Connection refused)"
    )
    assert all(needle in e.value.hint for needle in fill_hint_needles(cache)), e.value.hint
    assert "\n" not in str(e.value)


def test_a_reachable_hub_goes_on_to_download(monkeypatch, tmp_path, downloads, listening) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{listening}")
    config, source = hub.load_hub_config(MODEL, revision="main")
    assert downloads == [(MODEL, "config.json", "main")]
    assert config == CONFIG and source.startswith("downloaded from the Hugging Face Hub")


def test_the_default_endpoint_is_the_hub(monkeypatch, connects) -> None:
    """No HF_ENDPOINT: huggingface.co on 443 (the probe's lookup fails here: `connects` refuses all)."""
    target = hub_probe.probe_target(hub_probe.hub_endpoint())
    assert (target.host, target.port, target.name) == ("huggingface.co", 443, "https://huggingface.co")
    monkeypatch.setenv("HUGGINGFACE_CO_STAGING", "1")
    assert hub_probe.hub_endpoint() == "https://hub-ci.huggingface.co"


@pytest.mark.parametrize(
    "scheme,env,reached",
    [
        ("http", {"HTTP_PROXY": "{proxy}"}, True),
        ("http", {"http_proxy": "{proxy}"}, True),
        ("https", {"HTTPS_PROXY": "{proxy}"}, True),
        ("https", {"ALL_PROXY": "{proxy}"}, True),
        ("http", {"HTTPS_PROXY": "{proxy}"}, False),  # a proxy for the other scheme is not used
        ("http", {"HTTP_PROXY": "{proxy}", "NO_PROXY": "127.0.0.1"}, False),  # NO_PROXY: straight to the endpoint
        ("http", {"HTTP_PROXY": "{proxy}", "NO_PROXY": "*"}, False),
        ("https", {"HTTPS_PROXY": "{proxy}", "ALL_PROXY": "http://127.0.0.1:{closed}"}, True),  # the scheme's wins
    ],
)
def test_the_probe_goes_where_the_client_would(monkeypatch, downloads, listening, scheme, env, reached) -> None:
    """The endpoint is closed and the proxy listens: the download goes ahead exactly when the proxy would be used."""
    closed = closed_port()
    monkeypatch.setenv("HF_ENDPOINT", f"{scheme}://127.0.0.1:{closed}")
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(proxy=f"http://127.0.0.1:{listening}", closed=closed))
    if reached:
        hub.load_hub_config(MODEL)
        assert downloads == [(MODEL, "config.json", None)]
    else:
        with pytest.raises(SpecError, match=f"127.0.0.1:{closed}: Connection refused"):
            hub.load_hub_config(MODEL)
        assert downloads == []


def test_a_closed_proxy_is_named_without_its_password(monkeypatch, downloads, listening) -> None:
    port = closed_port()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{listening}")  # reachable, but the client would not go there
    monkeypatch.setenv("HTTP_PROXY", f"http://alice:s3cret@127.0.0.1:{port}")
    with pytest.raises(SpecError) as e:
        hub.load_hub_config(MODEL)
    assert f"(the proxy http://127.0.0.1:{port}: Connection refused)" in e.value.message
    assert "s3cret" not in str(e.value) and "alice" not in str(e.value)
    assert downloads == []


def test_a_silent_network_gives_up_after_the_probe_timeout(monkeypatch, downloads) -> None:
    """A connect (or a name lookup) that never answers: the probe waits PROBE_TIMEOUT_S, not the connect's own."""
    release = threading.Event()

    def hang(address, timeout=None, *args, **kwargs):
        release.wait(30)  # a lookup without a timeout: the probe must not wait for it
        raise OSError("released")

    monkeypatch.setattr(socket, "create_connection", hang)
    monkeypatch.setattr(hub_probe, "PROBE_TIMEOUT_S", 0.3)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")
    start = time.monotonic()
    try:
        with pytest.raises(SpecError, match=r"\(http://127.0.0.1:1: no answer in 0.3 s\)"):
            hub.load_hub_config(MODEL)
        assert time.monotonic() - start < 2.0
    finally:
        release.set()
    assert downloads == []


def test_the_probe_timeout_is_a_few_seconds() -> None:
    assert 1.0 <= hub_probe.PROBE_TIMEOUT_S <= 3.0


@pytest.mark.parametrize(
    "var,value,needle",
    [
        ("HF_ENDPOINT", "huggingface.co", "HF_ENDPOINT 'huggingface.co' is not a URL"),
        ("HF_ENDPOINT", "", "HF_ENDPOINT '' is not a URL"),
        ("HF_ENDPOINT", "http://127.0.0.1:99999", "is not a URL"),
        ("HTTPS_PROXY", "ftp://bob:pw@proxy:21", "the proxy variable 'ftp://proxy:21' is not a URL"),
    ],
)
def test_a_bad_endpoint_or_proxy_is_one_line(monkeypatch, downloads, connects, var, value, needle) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(SpecError) as e:
        hub.load_hub_config(MODEL)
    assert needle in e.value.message and "pw" not in str(e.value)
    assert downloads == [] and connects == []


# --- every command that takes a hub id goes through it ---------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["estimate-memory", MODEL],
        ["plan", MODEL, "--gpu", "H100-SXM"],
        ["tune", MODEL, "--gpu", "H100-SXM"],
    ],
)
def test_each_command_fails_fast_in_one_line(monkeypatch, tmp_path, downloads, args) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    start = time.monotonic()
    r = CliRunner().invoke(app, args)
    assert time.monotonic() - start < 5.0
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    assert MODEL in lines[0] and "cannot be reached" in lines[0] and f"hf download {MODEL} config.json" in lines[0]
    assert downloads == []


def test_the_cli_without_network_prints_no_retries(tmp_path) -> None:
    """The user's report, end to end with the real huggingface_hub: `llmctl estimate-memory Qwen/Qwen2.5-Coder-7B`
    printed `Retrying in 8s [Retry 5/5]` for 24 s before its error; now one line, in the probe's time."""
    pytest.importorskip("huggingface_hub")
    env = {k: v for k, v in os.environ.items() if k not in _ENV}
    env.update(
        HOME=str(tmp_path / "home"), HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}"
    )
    start = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "llmctl", "estimate-memory", MODEL],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - start
    assert r.returncode == 2, r.stderr
    assert "Retry" not in r.stderr and "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if line.strip()] == [r.stderr.strip()]
    assert "cannot be reached" in r.stderr and str(tmp_path / "hf" / "hub") in r.stderr
    assert elapsed < 15.0  # the import of the CLI included; the retries alone took 23 s
