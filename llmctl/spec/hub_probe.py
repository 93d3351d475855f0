"""Is the Hugging Face Hub reachable from here? One TCP connection, bounded in time, before any download.

Why: hf_hub_download retries a HEAD that fails on a network error with backoff (huggingface_hub.file_download: "No
local file found. Retrying..", then http_backoff sleeping 1+2+4+8+8 s and logging "Retrying in 8s [Retry 5/5]"), and
no public setting turns that off: HF_HUB_ETAG_TIMEOUT bounds the first HEAD only, the retried one uses a fixed 60 s.
On a machine without network that is 24 s of warnings before one line of error. A connection that does not open in
PROBE_TIMEOUT_S means the download cannot work either, and the caller says so at once.

The connection goes where huggingface_hub's HTTP client would send the request: the endpoint ($HF_ENDPOINT, as
huggingface_hub.constants reads it) or the proxy its client takes from the environment (httpx and requests both read
HTTP(S)_PROXY / ALL_PROXY / NO_PROXY through urllib.request.getproxies, the scheme's own proxy before ALL_PROXY).
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from llmctl.errors import SpecError

# A TCP handshake to the Hub takes well under 0.5 s from anywhere with a route; 3 s leaves room for a slow DNS answer
# and a loaded proxy, and is what a user waits for before the one-line error on a machine without network.
PROBE_TIMEOUT_S = 3.0

# huggingface_hub.constants: _HF_DEFAULT_ENDPOINT, and _HF_DEFAULT_STAGING_ENDPOINT under HUGGINGFACE_CO_STAGING.
DEFAULT_ENDPOINT = "https://huggingface.co"
STAGING_ENDPOINT = "https://hub-ci.huggingface.co"
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}
_DEFAULT_PORTS = {"http": 80, "https": 443, "socks5": 1080, "socks5h": 1080}


@dataclass(frozen=True)
class ProbeTarget:
    """Where the probe connects, and how a message names it (a proxy without its user and password)."""

    host: str
    port: int
    name: str


def hub_endpoint() -> str:
    """The Hub's URL as huggingface_hub.constants.ENDPOINT sets it: $HF_ENDPOINT without a trailing '/' (an empty
    value counts as set), the staging Hub when HUGGINGFACE_CO_STAGING is true, else https://huggingface.co. Read at
    call time: huggingface_hub reads it at its import, which in an llmctl process comes after this."""
    if os.environ.get("HUGGINGFACE_CO_STAGING", "").strip().upper() in _TRUE_VALUES:
        return STAGING_ENDPOINT
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def probe_target(endpoint: str) -> ProbeTarget:
    """The endpoint's host and port, or those of the proxy the HTTP client would use for it. SpecError when
    $HF_ENDPOINT or the proxy variable is not an http(s) URL (huggingface_hub would fail on it too, later)."""
    url = _split(endpoint, "HF_ENDPOINT", ("http", "https"))
    host = url.hostname or ""
    import urllib.request  # http.client, email: imported only when a download is about to happen

    proxies = urllib.request.getproxies()
    proxy = proxies.get(url.scheme) or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass_environment(host, proxies):
        purl = _split(proxy if "://" in proxy else f"http://{proxy}", "the proxy variable", tuple(_DEFAULT_PORTS))
        port = purl.port or _DEFAULT_PORTS[purl.scheme]
        return ProbeTarget(purl.hostname or "", port, f"the proxy {purl.scheme}://{_host_port(purl.hostname, port)}")
    return ProbeTarget(host, url.port or _DEFAULT_PORTS[url.scheme], endpoint)


def unreachable_reason(target: ProbeTarget, timeout_s: float | None = None) -> str | None:
    """None when a TCP connection to `target` opens within timeout_s (PROBE_TIMEOUT_S when None), else why not in a
    few words ("Name or service not known", "Connection refused", "no answer in 3 s"). The name lookup counts too:
    it runs in a daemon thread that is left behind when it outlasts timeout_s (getaddrinfo itself has no timeout,
    and an unreachable name server makes it wait 5 s per try in glibc's default resolv.conf)."""
    timeout_s = PROBE_TIMEOUT_S if timeout_s is None else timeout_s
    result: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((target.host, target.port), timeout=timeout_s).close()
            result.append(None)
        except OSError as e:
            result.append(_reason(e, timeout_s))

    thread = threading.Thread(target=connect, name="llmctl-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return result[0] if result else f"no answer in {timeout_s:g} s"


def _reason(e: OSError, timeout_s: float) -> str:
    if isinstance(e, TimeoutError):  # socket.timeout is TimeoutError since Python 3.10
        return f"no answer in {timeout_s:g} s"
    return e.strerror or str(e) or type(e).__name__


def _split(value: str, what: str, schemes: tuple[str, ...]) -> SplitResult:
    try:
        url = urlsplit(value)
        url.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError:
        url = None
    if url is None or url.scheme not in schemes or not url.hostname:
        raise SpecError(
            f"{what} {_without_password(value)!r} is not a URL the Hugging Face Hub client can use",
            hint=f"write it as {schemes[0]}://host[:port], e.g. {DEFAULT_ENDPOINT}"
            if what == "HF_ENDPOINT"
            else "write it as http://host:port",
        )
    return url


def _host_port(host: str | None, port: int) -> str:
    host = host or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _without_password(value: str) -> str:
    """A proxy URL may carry user:password@: never shown."""
    scheme, sep, rest = value.rpartition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"
