"""Quoting and validation for everything that ends up in a shell command or an sbatch script. Torch-free.

Two contexts, two rules:
- shell words (script body, printed commands): `shlex.quote`, which is safe for any string, newlines included;
- `#SBATCH` lines: sbatch reads them itself and bash sees them as comments, so a newline would end the comment
  and turn the rest into a command. Values there must be a single line of plain characters; we validate
  (and say which characters are allowed) instead of trying to quote.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterable, Mapping

from llmctl.errors import InputError, one_line

# Environment variable names that hold secrets: never written into a script, a job folder or a log. One rule,
# shared with bench-net's recorded environment.
from llmctl.secrets import is_secret_name, secret_in_value

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""A POSIX environment variable name, matched whole (`re.fullmatch`: `$` would also take a trailing line break)."""

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


def comment(value: object) -> str:
    """Text for a `#` comment of a script: one line of printable characters, every other character written as its
    escape (a line break would end the comment and make the rest a command). The values that reach comments are
    validated where they are read (llmctl.spec.text); this is the script's own guard."""
    return one_line(str(value))


def quote_lines(value: str) -> str:
    """One bash word on one line for a multi-line value: ANSI-C quoting, $'...' with backslash, quote, newline, CR and
    tab escaped (bash(1), QUOTING). For the --setup lines, so that the script shows each as a command only once."""
    escaped = value.replace("\\", "\\\\").replace("'", "\\'")
    for char, escape in (("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t")):
        escaped = escaped.replace(char, escape)
    return f"$'{escaped}'"


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


class JobEnv(dict[str, str]):
    """The job's environment as `--env` gave it: NAME=VALUE pairs written into the job (this dict), and `by_name`,
    variables the job inherits from the submitting environment whose values are never written anywhere (secrets).
    A dict, so that every backend that only knows assignments keeps working; a local run inherits `by_name` anyway."""

    by_name: tuple[str, ...] = ()


def check_env_name(name: str, given: str | None = None) -> str:
    """An environment variable name ([A-Za-z_][A-Za-z0-9_]*, whole): it is written into scripts unquoted."""
    if not _ENV_NAME.fullmatch(name):
        raise InputError(
            f"--env {(given if given is not None else name)!r}: expected NAME=VALUE, or NAME to pass it from this "
            "environment (a NAME is letters, digits and _, not starting with a digit)"
        )
    return name


def check_env_value(key: str, value: str, environ: Mapping[str, str] | None = None) -> str:
    """A NAME=VALUE that will be written into the job: refused when it is, or holds, a secret (a secret's name, the
    value of one of this environment's secrets, a URL's password). Such a value goes by name: exported in the
    submitting shell, it reaches the job through sbatch's environment (--export=ALL) and is never written."""
    why = "its name says so" if is_secret_name(key) else secret_in_value(value, environ)
    if why is not None:
        raise InputError(
            f"--env {key}=...: looks like a secret ({why}) and would be written into the job script",
            hint=f"export {key} in your shell and pass it by name: --env {key} (its value is never written)",
        )
    return value


def check_env(assignments: Iterable[str], environ: Mapping[str, str] | None = None) -> JobEnv:
    """Parse `--env` values: NAME=VALUE (written into the job; secrets refused, by name or by value) or NAME alone
    (passed by name from this environment, where it must be set: its value is never written)."""
    env = os.environ if environ is None else environ
    out, by_name = JobEnv(), []
    for a in assignments:
        key, sep, value = a.partition("=")
        check_env_name(key, a)
        if not sep:
            if key not in env:
                raise InputError(
                    f"--env {key}: not set in this environment",
                    hint=f"export {key} before launching: the job inherits it by name and its value is never written",
                )
            if key not in by_name:
                by_name.append(key)
            continue
        out[key] = check_env_value(key, value, env)
    clash = sorted(set(out) & set(by_name))
    if clash:
        raise InputError(f"--env {clash[0]}: given both by name and as {clash[0]}=VALUE")
    out.by_name = tuple(by_name)
    return out


def env_names(env: Mapping[str, str]) -> tuple[str, ...]:
    """The variables passed by name in a job's environment (`JobEnv.by_name`; none for a plain dict)."""
    return tuple(getattr(env, "by_name", ()))


def check_setup_line(line: str) -> str:
    """A `--setup` line: shell code run as written in the job script, so it must be one complete line: no line
    break, NUL or other control character (tab aside), no trailing backslash (it would join the script's next line),
    and complete shell syntax with no here-document (checked with `bash -n`, which runs nothing), so that it cannot
    swallow the lines llmctl writes after it."""
    if any(c in line for c in "\n\r\0") or not line.replace("\t", " ").isprintable():
        raise InputError(f"--setup {line!r}: one line of shell code, without line breaks or control characters")
    if not line.strip():
        raise InputError("--setup '': an empty line")
    if (len(line) - len(line.rstrip("\\"))) % 2:
        raise InputError(f"--setup {line!r}: ends with a backslash, which would join the script's next line")
    bash = shutil.which("bash")
    if bash is not None:  # a SLURM login node has bash; elsewhere the job's own bash reports a bad line
        out = subprocess.run([bash, "-n", "-c", line], capture_output=True, text=True, timeout=10, check=False)
        problem = (out.stderr.strip().splitlines() or [""])[-1]
        if out.returncode != 0 or problem:
            raise InputError(
                f"--setup {line!r}: not one complete shell command line ({problem.removeprefix('bash: -c: ')})",
                hint="each --setup is one line; give several --setup for several lines",
            )
    return line


_NAME_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def safe_name(name: str, max_len: int = 48) -> str:
    """A job or folder name made of [A-Za-z0-9_.-] only (used in #SBATCH --job-name and folder names)."""
    cleaned = _NAME_SAFE.sub("_", name).strip("._-")[:max_len]
    return cleaned or "llmctl"


def job_env(env: list[str], socket_ifname: str | None, nccl_debug: str | None) -> JobEnv:
    """`llmctl launch`'s job environment: the --env values (NAME=VALUE pairs, and `by_name`, the variables passed by
    name from this environment; check_env) and the network settings it asked for."""
    out = check_env(env)
    if socket_ifname:
        out["NCCL_SOCKET_IFNAME"] = socket_ifname
        out["GLOO_SOCKET_IFNAME"] = socket_ifname
    if nccl_debug:
        out["NCCL_DEBUG"] = nccl_debug
    return out
