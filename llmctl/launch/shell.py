"""Quoting and validation for everything that ends up in a shell command or an sbatch script. Torch-free.

Two contexts, two rules:
- shell words (script body, printed commands): `shlex.quote`, which is safe for any string, newlines included;
- `#SBATCH` lines: sbatch reads them itself and bash sees them as comments, so a newline would end the comment
  and turn the rest into a command. Values there must be a single line of plain characters; we validate
  (and say which characters are allowed) instead of trying to quote.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping

from llmctl.errors import InputError

# Environment variable names that hold secrets: never written into a script, a job folder or a log. One rule,
# shared with bench-net's recorded environment.
from llmctl.secrets import is_secret_name as is_secret_name  # re-exported
from llmctl.secrets import secret_values as secret_values  # re-exported

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# What each #SBATCH value may contain. SLURM names are [A-Za-z0-9_.-]; node lists add [],; constraints add &|*()!.
_DIRECTIVE_CHARS = {
    "partition": r"[A-Za-z0-9_.,-]+",
    "account": r"[A-Za-z0-9_.-]+",
    "qos": r"[A-Za-z0-9_.-]+",
    "constraint": r"[A-Za-z0-9_.,&|*()!\[\]:-]+",
    "exclude": r"[A-Za-z0-9_.,\[\]-]+",
    "time": r"[0-9:-]+",
}


def quote(value: object) -> str:
    """One shell word, whatever the value contains."""
    return shlex.quote(str(value))


def join(argv: Iterable[object]) -> str:
    """A command line that a POSIX shell splits back into exactly `argv`."""
    return " ".join(quote(a) for a in argv)


def check_directive(option: str, value: str) -> str:
    """Validate a value that goes into an `#SBATCH --<option>=<value>` line."""
    pattern = _DIRECTIVE_CHARS[option]
    if not re.fullmatch(pattern, value):
        allowed = pattern.strip("[]+").replace("\\", "")
        raise InputError(
            f"--{option} {value!r}: not a valid SLURM {option}",
            hint=f"allowed characters: {allowed}",
        )
    return value


def check_sbatch_arg(arg: str) -> str:
    """An extra `#SBATCH` argument: one line, starting with '-', no shell metacharacters that could matter."""
    if not arg.startswith("-") or any(c in arg for c in "\n\r\0") or not arg.isprintable():
        raise InputError(
            f"--sbatch-arg {arg!r}: must be a single sbatch option on one line, like --mem=64G",
        )
    return arg


def check_env(assignments: Iterable[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Parse KEY=VALUE pairs for the job's environment, refusing secrets (by name or by value)."""
    known_secrets = set(secret_values(environ))
    out: dict[str, str] = {}
    for a in assignments:
        key, sep, value = a.partition("=")
        if not sep or not _ENV_NAME.match(key):
            raise InputError(f"--env {a!r}: expected NAME=VALUE with NAME like NCCL_DEBUG")
        if is_secret_name(key) or value in known_secrets:
            raise InputError(
                f"--env {key}: looks like a secret and would be written into the job script",
                hint="export it in your shell before launching; SLURM passes the environment to the job",
            )
        out[key] = value
    return out


_NAME_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def safe_name(name: str, max_len: int = 48) -> str:
    """A job or folder name made of [A-Za-z0-9_.-] only (used in #SBATCH --job-name and folder names)."""
    cleaned = _NAME_SAFE.sub("_", name).strip("._-")[:max_len]
    return cleaned or "llmctl"
