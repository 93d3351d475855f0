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
