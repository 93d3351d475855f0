"""Which environment variables hold secrets. One rule for every place llmctl writes the environment down: launch
never puts them into a job script, a job folder or a log; bench-net never records them in its JSON. Torch-free."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

# A name whose last word says what it holds (HF_TOKEN, WANDB_API_KEY, DB_PASSWORD, GOOGLE_APPLICATION_CREDENTIALS),
# plus well-known names that the suffix already covers but are listed so that the intent is plain.
_SECRET_NAME = re.compile(r"(^|_)(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)$", re.IGNORECASE)
_SECRET_EXACT = {"HF_TOKEN", "WANDB_API_KEY", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY"}


def is_secret_name(name: str) -> bool:
    return name.upper() in _SECRET_EXACT or bool(_SECRET_NAME.search(name))


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of secret-looking variables in the environment (to check nothing we write contains them)."""
    env = os.environ if environ is None else environ
    return [v for k, v in env.items() if is_secret_name(k) and len(v) >= 4]


# A URL that carries a password: scheme://user:password@host (RFC 3986 userinfo; postgres://u:pw@db, redis://:pw@h,
# http://u:pw@proxy). A port (host:8080/...) has no '@' before the first '/'; a user alone (ssh://git@host) no ':'.
_URL_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/@\s]*:[^/@\s]+@")
_SUBSTRING_MIN = 8
"""A secret's value is looked for inside other values from this length on (a 4-character one only as a whole value:
short strings turn up by chance)."""


def secret_in_value(value: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Why `value` holds a secret, in words (None: it does not seem to): the value of a secret-named variable of the
    environment, whole or inside it (`http://u:$HF_TOKEN@proxy` as the shell expanded it), or a URL's password."""
    env = os.environ if environ is None else environ
    for name, secret in sorted(env.items()):
        if (
            is_secret_name(name)
            and len(secret) >= 4
            and (value == secret or (len(secret) >= _SUBSTRING_MIN and secret in value))
        ):
            return f"it holds the value of ${name}"
    if _URL_PASSWORD.search(value):
        return "it holds a password in a URL: user:password@"
    return None
