"""The SLURM options a user can give, declared once. Torch-free.

`SlurmOptions` is the single declaration: each field carries its command-line flags and help, and
`__post_init__` validates every value in one place. From it are derived the `llmctl launch` options
(`cli_parameters`), the sbatch template's `#SBATCH` lines (`directives`) and submitit's executor parameters
(`submitit_parameters`). Options are passed by name (`from_kwargs`): an unknown name is an error that lists the
valid ones, as submitit does for its executor parameters.

Besides what SLURM is asked for (time, partition, ...), the options say what the job's nodes get (CPUs, memory,
whole nodes: the values given here override what llmctl.launch.slurm_resources derives from the node and the ranks)
and how the job's environment is made (`--setup` lines, a container through pyxis or apptainer).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field, fields
from typing import Annotated, Any, get_origin, get_type_hints

from llmctl.errors import InputError, suggest
from llmctl.launch import shell

DEFAULT_SIGNAL_LEAD_S = 300
"""Seconds before the time limit at which SIGUSR1 arrives: enough for a large sharded checkpoint."""
# sbatch options llmctl writes itself: the checkpoint-and-requeue machinery depends on them.
_RESERVED_SBATCH = ("--signal", "--requeue", "--no-requeue", "--output", "--open-mode")
# sbatch options that are llmctl options of their own (derived by default), by field: an --sbatch-arg that gives one
# (as scripts did before these options existed) sets the option instead, so that no line is written twice.
_OWN_OPTION = {"--cpus-per-task": "cpus_per_task", "-c": "cpus_per_task", "--mem": "mem", "--exclusive": "exclusive"}
# SLURM memory sizes: a number with an optional K|M|G|T (MiB without one; 0 = all the node's memory): sbatch --mem,
# https://slurm.schedmd.com/sbatch.html#OPT_mem
_MEM = re.compile(r"^(\d+)([KMGT]?)$", re.IGNORECASE)
# submitit always writes --time; without --time we ask for a day (the partition may cap it).
_SUBMITIT_DEFAULT_TIME_S = 24 * 3600


def _option(*flags: str, help: str, directive: bool = False) -> dict[str, Any]:
    """Field metadata: the command-line flags, the help text, and whether the value is an `#SBATCH --<name>=`
    line of its own (validated with `shell.check_directive`)."""
    return {"flags": flags, "help": help, "directive": directive}


@dataclass(frozen=True)
class SlurmOptions:
    """What a user may ask SLURM for. Build with `from_kwargs` (names checked); construction validates."""

    time: str | None = field(
        default=None, metadata=_option("--time", "-t", help="Time limit, e.g. 4:00:00 or 2-00:00:00.", directive=True)
    )
    partition: str | None = field(
        default=None, metadata=_option("--partition", "-p", help="SLURM partition.", directive=True)
    )
    account: str | None = field(
        default=None, metadata=_option("--account", "-A", help="SLURM account.", directive=True)
    )
    qos: str | None = field(default=None, metadata=_option("--qos", help="SLURM QOS.", directive=True))
    constraint: str | None = field(
        default=None, metadata=_option("--constraint", "-C", help="SLURM node features, e.g. a100.", directive=True)
    )
    exclude: str | None = field(
        default=None, metadata=_option("--exclude", "-x", help="Nodes to avoid, e.g. gpu[03,07].", directive=True)
    )
    extra_sbatch_args: tuple[str, ...] = field(
        default=(), metadata=_option("--sbatch-arg", help="Extra sbatch option, repeatable: --sbatch-arg=--mem=0")
    )
    signal_lead_s: int = field(
        default=DEFAULT_SIGNAL_LEAD_S,
        metadata=_option("--signal-lead", help="Seconds before the time limit to signal a checkpoint (SIGUSR1)."),
    )
    cpus_per_task: int | None = field(
        default=None,
        metadata=_option(
            "--cpus-per-task",
            help="CPUs for each node's ranks together (one SLURM task per node runs torchrun). Default: all of the "
            "node's CPUs with --exclusive, else a per-GPU share (llmctl.launch.slurm_resources).",
        ),
    )
    mem: str | None = field(
        default=None,
        metadata=_option(
            "--mem",
            help="Memory per node, SLURM size syntax (e.g. 200G; 0 = all of it). Default: 0 with --exclusive, else "
            "a per-GPU share.",
        ),
    )
    exclusive: bool | None = field(
        default=None,
        metadata=_option(
            "--exclusive/--no-exclusive",
            help="Whole nodes for the job. Default: on when the job uses all GPUs of a node (the GPU catalog's "
            "node_gpus), else off.",
        ),
    )
    setup: tuple[str, ...] = field(
        default=(),
        metadata=_option(
            "--setup",
            help="A shell line that makes the job's environment, repeatable, run as written before anything runs "
            "python, on the batch host and in each node's step: --setup 'module load cuda' --setup 'source "
            "/shared/venv/bin/activate'.",
        ),
    )
    container_image: str | None = field(
        default=None,
        metadata=_option(
            "--container-image",
            help="Run each node's step in this container image through pyxis/enroot (srun --container-image), "
            "e.g. nvcr.io#nvidia/pytorch:24.05-py3 or a .sqsh file. Its python3 and torchrun run the engine.",
        ),
    )
    apptainer: str | None = field(
        default=None,
        metadata=_option(
            "--apptainer",
            help="Run each node's step in this apptainer image (apptainer exec --nv IMAGE), e.g. /shared/torch.sif.",
        ),
    )
    container_mounts: tuple[str, ...] = field(
        default=(),
        metadata=_option(
            "--container-mounts",
            help="SRC:DST[:FLAGS][,...] more mounts for the container, repeatable (the workdir and the job folder "
            "are always mounted): e.g. /lustre:/lustre.",
        ),
    )

    def __post_init__(self) -> None:
        # Lists from the command line become tuples: the options are hashable and cannot change after checks.
        object.__setattr__(self, "extra_sbatch_args", tuple(self.extra_sbatch_args or ()))
        if self.signal_lead_s < 10:
            raise InputError(f"--signal-lead {self.signal_lead_s}: must be at least 10 seconds")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata["directive"] and value is not None:
                shell.check_directive(f.name, value)
        if self.time is not None and parse_time_s(self.time) <= self.signal_lead_s:
            raise InputError(
                f"--time {self.time}: the job would get its checkpoint signal ({self.signal_lead_s} s before the end) "
                "before it starts",
                hint="give a longer --time or a smaller --signal-lead",
            )
        kept = []
        for arg in self.extra_sbatch_args:
            shell.check_sbatch_arg(arg)
            if arg.split("=")[0] in _RESERVED_SBATCH:
                raise InputError(f"--sbatch-arg {arg}: llmctl sets this itself (it drives checkpoint and requeue)")
            if _sbatch_name(arg) in _OWN_OPTION:
                self._take_sbatch_arg(arg)
            else:
                kept.append(arg)
        object.__setattr__(self, "extra_sbatch_args", tuple(kept))
        self._check_resources()
        self._check_environment()

    def _take_sbatch_arg(self, arg: str) -> None:
        """--sbatch-arg=--mem=0, --exclusive, -c 8 ...: set the option of the same name (its own flag wins when it
        says the same; saying something else is an error)."""
        name = _sbatch_name(arg)
        field_name = _OWN_OPTION[name]
        flag = "--" + field_name.replace("_", "-")
        raw = arg[len(name) :].lstrip("= ").strip()
        value: Any
        if field_name == "exclusive":
            if raw:
                raise InputError(
                    f"--sbatch-arg {arg}: llmctl writes the --exclusive line itself", hint="use --exclusive"
                )
            value = True
        elif field_name == "cpus_per_task":
            if not raw.isdigit():
                raise InputError(f"--sbatch-arg {arg}: expected a number of CPUs", hint="use --cpus-per-task N")
            value = int(raw)
        else:
            value = raw
        current = getattr(self, field_name)
        if current is not None and str(current).upper() != str(value).upper():
            raise InputError(f"--sbatch-arg {arg} and {flag} {current}: give one", hint=f"use {flag}")
        object.__setattr__(self, field_name, value)

    def _check_resources(self) -> None:
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise InputError(f"--cpus-per-task {self.cpus_per_task}: must be at least 1")
        if self.mem is not None:
            m = _MEM.match(self.mem.strip())
            if not m:
                raise InputError(
                    f"--mem {self.mem!r}: not a SLURM memory size",
                    hint="a number with an optional K, M, G or T (MiB without one), e.g. 200G; 0 means all of it",
                )
            object.__setattr__(self, "mem", m.group(1) + m.group(2).upper())

    def _check_environment(self) -> None:
        for name in ("setup", "container_mounts"):
            object.__setattr__(self, name, tuple(getattr(self, name) or ()))
        for line in self.setup:
            shell.check_setup_line(line)
        if self.container_image is not None and self.apptainer is not None:
            raise InputError("--container-image and --apptainer: give one container (pyxis/enroot or apptainer)")
        for flag, value in (("--container-image", self.container_image), ("--apptainer", self.apptainer)):
            if value is not None and (not value.strip() or not value.isprintable() or value != value.strip()):
                raise InputError(f"--{flag.lstrip('-')} {value!r}: one image name or path, on one line")
            if value is not None and value.startswith("-"):  # apptainer exec would read it as one of its options
                raise InputError(
                    f"{flag} {value!r}: an image name or path cannot start with '-' (it would be read as an option)",
                    hint=f"write a path that starts otherwise, e.g. {flag} ./{value}",
                )
        if self.container_mounts and self.container is None:
            raise InputError("--container-mounts only applies with --container-image or --apptainer")
        for spec in self.mounts:
            check_mount(spec)

    @property
    def container(self) -> str | None:
        """Which container runs the node steps: "pyxis", "apptainer" or None."""
        if self.container_image is not None:
            return "pyxis"
        return "apptainer" if self.apptainer is not None else None

    @property
    def mounts(self) -> tuple[str, ...]:
        """The user's mounts, one SRC[:DST[:FLAGS]] each (--container-mounts values split at commas)."""
        return tuple(m for value in self.container_mounts for m in value.split(","))

    def sbatch_arg_names(self) -> set[str]:
        """The names of the sbatch options given with --sbatch-arg (--mem-per-gpu, -G, ...), to see what they ask for."""
        return {_sbatch_name(a) for a in self.extra_sbatch_args}

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_kwargs(cls, **values: Any) -> SlurmOptions:
        """Options by name. None (an option not given on the command line) means the default."""
        unknown = sorted(set(values) - set(cls.names()))
        if unknown:
            hint = suggest(unknown[0], cls.names())
            raise InputError(
                f"unknown SLURM option {unknown[0]!r}: valid options are {', '.join(cls.names())}", hint=hint
            )
        return cls(**{k: v for k, v in values.items() if v is not None})

    @classmethod
    def given_flags(cls, values: dict[str, Any]) -> list[str]:
        """The flags of options given a value that asks SLURM for something (for "only apply with --slurm").
        Options with a working default (the signal lead) are left out: they ask for nothing by themselves."""
        return [
            f.metadata["flags"][0].split("/")[0]
            for f in fields(cls)
            if f.default in (None, ()) and f.name in values and values[f.name] not in (None, (), [])
        ]

    def directives(self) -> list[tuple[str, str]]:
        """`#SBATCH --<name>=<value>` pairs for the options given, in declaration order (validated values)."""
        return [
            (f.name, getattr(self, f.name))
            for f in fields(self)
            if f.metadata["directive"] and getattr(self, f.name) is not None
        ]

    @property
    def time_s(self) -> int | None:
        return parse_time_s(self.time) if self.time is not None else None

    def submitit_parameters(self) -> dict[str, Any]:
        """These options as submitit.SlurmExecutor parameters (the job's own size and name are the caller's)."""
        additional: dict[str, Any] = {"requeue": True, "open-mode": "append"}
        for arg in self.extra_sbatch_args:
            key, _, value = arg.lstrip("-").partition("=")
            additional[key] = value if value else True
        params: dict[str, Any] = {
            # submitit's time is in minutes: round up so the signal lead still fits.
            "time": max(1, -(-(self.time_s or _SUBMITIT_DEFAULT_TIME_S) // 60)),
            "signal_delay_s": self.signal_lead_s,
            "additional_parameters": additional,
        }
        # The other directives have submitit parameters of the same name.
        params.update((name, value) for name, value in self.directives() if name != "time")
        return params


def cli_parameters() -> list[inspect.Parameter]:
    """One typer option per field (keyword parameters named like the fields), for a command's signature."""
    import typer

    hints = get_type_hints(SlurmOptions)
    out = []
    for f in fields(SlurmOptions):
        kind, default = hints[f.name], f.default
        if get_origin(kind) is tuple:  # a repeatable option: typer collects a list (None when not given)
            kind, default = list[str] | None, None
        option = typer.Option(*f.metadata["flags"], help=f.metadata["help"])
        out.append(
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, option]
            )
        )
    return out


def _sbatch_name(arg: str) -> str:
    """The option an --sbatch-arg value sets: `--mem=1G` -> --mem, `-c8` / `-c 8` -> -c."""
    name = arg.split("=")[0].split()[0]
    return name[:2] if not name.startswith("--") else name


def check_mount(spec: str) -> str:
    """One container mount, SRC[:DST[:FLAGS]] with absolute paths: pyxis (--container-mounts) and apptainer (--bind)
    both split the list at commas and each mount at colons, so a path cannot hold either."""
    parts = spec.split(":")
    if not spec or len(parts) > 3 or not all(parts) or not spec.isprintable() or any(c.isspace() for c in spec):
        raise InputError(f"--container-mounts {spec!r}: expected SRC:DST[:FLAGS], e.g. /lustre:/lustre")
    for path in parts[:2]:
        if not path.startswith("/"):
            raise InputError(f"--container-mounts {spec!r}: {path!r} is not an absolute path")
    return spec


_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time_s(value: str) -> int:
    """SLURM --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S -> seconds."""
    m = _TIME.match(value)
    if not m:
        raise InputError(
            f"--time {value!r}: not a SLURM time", hint="use minutes, HH:MM:SS or D-HH:MM:SS, e.g. 4:00:00"
        )
    days, a, b, c = m.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, s = (nums + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + mi) * 60 + s
    if len(nums) == 1:
        return nums[0] * 60
    if len(nums) == 2:
        return nums[0] * 60 + nums[1]
    return (nums[0] * 60 + nums[1]) * 60 + nums[2]
