"""SLURM via sbatch: a pure renderer (`render(params) -> str`, tested against a golden file), `submit`, and the
`sbatch` launch backend built from them.

Every value that reaches the script is either validated for an `#SBATCH` line (see `shell.check_directive`),
shell-quoted in the body (the `sq` filter), or made one printable line in a comment (the `comment` filter); the one
exception is `--setup`, shell code the user wrote, written as given after `shell.check_setup_line` made sure it is one
complete line. Torch-free.

The job's environment (what a demanding user expects, and why):
- Each node's step is a fresh `bash -c` started by srun on another node. srun passes the batch shell's environment
  to it (srun --export=ALL, the default; the script sets SLURM_EXPORT_ENV=ALL so that a job submitted with
  --export=NONE still does), so what `module load`, `source .../activate`, `conda activate` and `export` set reaches
  the step. The step still runs the `--setup` lines again (from LLMCTL_SETUP) before torchrun: what is not an
  exported variable (shell functions, values a line computes on its own node) and a container's environment (the
  image's variables win over the host's) are made where torchrun runs.
- The interpreter: the launch host's torchrun/python (absolute paths, right when they are on a file system the nodes
  share), unless a container runs the steps or a --setup line activates an environment: then `torchrun` and
  `python3` from the PATH the job made. A --setup line can export LLMCTL_TORCHRUN / LLMCTL_PYTHON to choose others.
- Variables passed by name (`--env HF_TOKEN`) reach the job because sbatch exports the submitting environment
  (--export=ALL); the script checks they arrived, never writes their values, and lets them win over a container
  image's own (pyxis --container-env, apptainer APPTAINERENV_NAME).
- Before any python: a check step makes every node read the token `submit` wrote in the job folder (SHARED_MARKER,
  outside any container), and with a container an image check runs `python -m llmctl --version` in it; each failure
  is one line in the log and the events file, and its own exit code. A container job's preflight starts its agents
  in the container (`preflight_agent_words`); its batch-host half runs outside, with the launch host's Python.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2

import llmctl
from llmctl.errors import InputError, RuntimeFailure
from llmctl.fileio import write_atomic
from llmctl.launch import jobs, local, sharedfs, shell, slurm_options, slurm_resources
from llmctl.launch.backends import Job, SlurmBackend, check_run_folders_free
from llmctl.launch.local import ENGINE_MODULE
from llmctl.launch.preflight.options import PreflightOptions
from llmctl.launch.slurm_options import SlurmOptions

TEMPLATE_NAME = "slurm.sbatch.j2"
TUNE_TEMPLATE_NAME = "tune.sbatch.j2"
DEFAULT_MAX_REQUEUES = 20
RDZV_PORT_BASE = 29500
# Kept importable from here: the sbatch renderer's callers and tests know them by these names.
DEFAULT_SIGNAL_LEAD_S = slurm_options.DEFAULT_SIGNAL_LEAD_S
parse_time_s = slurm_options.parse_time_s
TUNE_RDZV_PORT_BASE = 33500
"""`llmctl tune --slurm` jobs: each trial's rendezvous port is this + job id % 2000 + the trial's run, clear of the
training's ports (29500 + 2000) and the preflight's (31500 + 2000)."""

# The job step on each node: one torchrun agent per node, rendezvous (c10d) hosted by $LLMCTL_RDZV_NODE at
# $LLMCTL_RDZV_ADDR:$LLMCTL_RDZV_PORT, running the engine on $LLMCTL_PLAN. Single-quoted into `bash -c` (sbatch
# template) or passed as one argument (tune's trials), so SLURMD_NODENAME and the node's own address expand on each
# node. First the --setup lines (LLMCTL_SETUP, one per line, each must succeed; stdin closed so that a line cannot
# read the others); then the node's address: from LLMCTL_NODE_ADDRS ("node=addr ...", looked up by the batch shell
# when the step runs in a container without scontrol), else from scontrol. torchrun handles SIGUSR1 (forwarding it to
# the ranks) instead of dying from it, and waits up to the shutdown timeout for them to finish their checkpoint.
_NODE_SETUP = """
{container}while IFS= read -r llmctl_line; do
  [ -n "$llmctl_line" ] || continue
  eval "$llmctl_line" </dev/null || {{
    llmctl_rc=$?
    echo "llmctl: --setup failed on $SLURMD_NODENAME (exit $llmctl_rc): $llmctl_line" >&2
    exit "$llmctl_rc"
  }}
done <<<"${{LLMCTL_SETUP:-}}"
"""
_NODE_STEP_SCRIPT = """node_addr=
for llmctl_pair in ${{LLMCTL_NODE_ADDRS:-}}; do
  if [ "${{llmctl_pair%%=*}}" = "$SLURMD_NODENAME" ]; then node_addr=${{llmctl_pair#*=}}; fi
done
if [ -z "$node_addr" ]; then
  node_addr=$(scontrol show node "$SLURMD_NODENAME" | sed -n "s/.*NodeAddr=\\([^ ]*\\).*/\\1/p" | head -n 1)
fi
is_host=0
if [ "$SLURMD_NODENAME" = "$LLMCTL_RDZV_NODE" ]; then is_host=1; fi
exec "$LLMCTL_TORCHRUN" \\
  --nnodes="$LLMCTL_NNODES" \\
  --nproc_per_node="$LLMCTL_NPROC_PER_NODE" \\
  --rdzv_backend=c10d \\
  --rdzv_id="$SLURM_JOB_ID" \\
  --rdzv_endpoint="$LLMCTL_RDZV_ADDR:$LLMCTL_RDZV_PORT" \\
  --rdzv_conf=is_host="$is_host" \\
  --local_addr="$node_addr" \\
  --max_restarts=0 \\
  --signals_to_handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \\
  --shutdown_timeout="$LLMCTL_SHUTDOWN_TIMEOUT_S" \\
  --module {engine_module} "$LLMCTL_PLAN"
"""


def node_step_script(engine_module: str = ENGINE_MODULE, container: str | None = None) -> str:
    """The step's script; inside a container (pyxis or apptainer) it sets LLMCTL_CONTAINER to say so first, so that
    a --setup line meant for the host only can be skipped there: `[ -n "${LLMCTL_CONTAINER:-}" ] || module load x`."""
    return node_setup_script(container) + _NODE_STEP_SCRIPT.format(engine_module=engine_module)


def node_setup_script(container: str | None = None) -> str:
    """The start of every script a job runs on a node (its step, the image check, the preflight's agents in a
    container): LLMCTL_CONTAINER inside a container, then the --setup lines (LLMCTL_SETUP), each of which must
    succeed."""
    prefix = f"export LLMCTL_CONTAINER={container}\n" if container else ""
    return _NODE_SETUP.format(container=prefix)


SHARED_MARKER = ".llmctl-shared"
"""The file in the job folder that `llmctl launch` writes at submit, holding a random token (the job script holds
the same): every node must read that token there, or the job folder is not the one the submitting host wrote."""
DRY_RUN_TOKEN = "written-at-submit"
"""The token a --dry-run's script shows (the real one is random, made when the job folder is)."""
SHARED_CHECK_EXIT = 4
"""The job's exit code when a node does not share the job folder (the script's check step)."""
IMAGE_CHECK_EXIT = 5
"""The job's exit code when the container image cannot run `python -m llmctl` on a node."""
CHECK_PREFIX = "llmctl-check:"
"""How a check step's task marks its one line (`llmctl-check: KIND NODE: WHY`), for the batch shell to find."""

# The shared-folder check on each node, outside any container (the container's mounts need the folder on the node
# itself): the marker must hold this job's token. `head -c`: a foreign file cannot flood the job log.
SHARED_CHECK_SCRIPT = f"""
marker="$LLMCTL_JOB_DIR/{SHARED_MARKER}"
if ! got=$(head -c 200 -- "$marker" 2>&1); then
  why="${{got##*: }}"
  echo "{CHECK_PREFIX} shared $SLURMD_NODENAME: cannot read $marker there: ${{why:-no reason given}}"
  exit 1
fi
if [ "$got" != "$LLMCTL_SHARED_TOKEN" ]; then
  echo "{CHECK_PREFIX} shared $SLURMD_NODENAME: $marker there holds another token than the one written at submit"
  exit 1
fi
"""

_IMAGE_CHECK = f"""if ! llmctl_out=$("$LLMCTL_PYTHON" -m llmctl --version 2>&1 </dev/null); then
  echo "{CHECK_PREFIX} image $SLURMD_NODENAME: $(printf "%s\\n" "$llmctl_out" | grep -v "^[[:space:]]*\\$" | tail -n 1)"
  exit 1
fi
echo "{CHECK_PREFIX} ok $SLURMD_NODENAME: $llmctl_out"
"""


def image_check_script(container: str) -> str:
    """The image check on each node, inside the container (after the --setup lines, as the step runs them): the
    container's python runs `-m llmctl --version`; on failure one line with the last line it printed."""
    return node_setup_script(container) + _IMAGE_CHECK


def preflight_agent_words(params: SbatchParams) -> str:
    """With a container: the command the preflight's batch host prefixes to `node|cross ...` to start its agent on
    each node inside the container (`LLMCTL_PREFLIGHT_AGENT`, shell words that llmctl.launch.preflight.host splits
    back): the container's srun options or `apptainer exec ... IMAGE`, then the --setup lines and the container's
    python. Empty without one (the agent is the batch host's Python)."""
    words = container_argv(params)
    if not words:
        return ""
    script = node_setup_script(params.slurm.container) + 'exec "$LLMCTL_PYTHON" -m llmctl.launch.preflight agent "$@"\n'
    return shell.join([*words, "bash", "-c", script, "llmctl-preflight"])


def node_step_argv(nodes: list[str], engine_module: str = ENGINE_MODULE) -> list[str]:
    """The srun step that runs the engine on `nodes` (one torchrun per node): the LLMCTL_* variables the script reads
    come from the environment (the sbatch script exports them; tune's runner passes them)."""
    return [
        "srun",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        f"--nodelist={','.join(nodes)}",
        "--ntasks-per-node=1",
        "bash",
        "-c",
        node_step_script(engine_module),
    ]


@dataclass(frozen=True)
class SbatchParams:
    """Everything the template needs. Build with `make_params` (which validates); `render` is pure."""

    job_name: str
    nodes: int
    nproc_per_node: int
    workdir: str
    """Where the engine runs: the directory launch ran in (the plan's relative paths resolve against its file's folder:
    llmctl.spec.planpaths)."""
    job_dir: str
    plan_path: str
    torchrun: str
    python: str = "python3"
    """The Python that runs the preflight on the batch host (the torchrun's own where llmctl knows it)."""
    gpus_per_node: int | None = None
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    """The user's SLURM options (validated when built)."""
    preflight: PreflightOptions = field(default_factory=PreflightOptions)
    env: dict[str, str] = field(default_factory=dict)
    env_names: tuple[str, ...] = ()
    """Variables passed by name from the submitting environment: checked in the job, their values never written."""
    resources: slurm_resources.Resources = field(
        default_factory=lambda: slurm_resources.Resources(False, None, None, "the cluster's defaults")
    )
    """What each node gets (llmctl.launch.slurm_resources.derive; `make_params` fills it in)."""
    interpreter: str = "this machine's"
    """Whose torchrun and python the job runs, in words (`job_interpreter`)."""
    gpu_runtime: str | None = None
    """apptainer's GPU option for the plan's devices: "--nv" (NVIDIA), "--rocm" (AMD), None (CPU)."""
    max_requeues: int = DEFAULT_MAX_REQUEUES
    rdzv_port_base: int = RDZV_PORT_BASE
    engine_module: str = ENGINE_MODULE
    llmctl_version: str = llmctl.__version__
    preflight_python: str = "python3"
    """With a container: the Python that runs the preflight's batch-host half, outside the container (the one llmctl
    was launched with); its agents run inside. Without one the preflight runs `python`."""
    shared_token: str = ""
    """The token `submit` wrote in the job folder (SHARED_MARKER); the script checks that every node reads it there.
    Empty: no check (a script rendered without a job folder)."""

    @property
    def shutdown_timeout_s(self) -> int:
        # torchrun waits this long for the ranks to checkpoint and exit before SIGKILL; keep 10 s for the rest.
        return max(10, self.slurm.signal_lead_s - 10)


def make_params(
    *,
    job_name: str,
    nodes: int,
    nproc_per_node: int,
    workdir: str,
    job_dir: str,
    plan_path: str,
    torchrun: str,
    python: str = "python3",
    gpus_per_node: int | None = None,
    gpu: str | None = None,
    env: dict[str, str] | None = None,
    env_names: Iterable[str] = (),
    max_requeues: int = DEFAULT_MAX_REQUEUES,
    preflight: PreflightOptions | None = None,
    shared_token: str = "",
    **slurm: Any,
) -> SbatchParams:
    """Validate user values and build the renderer's input. `slurm` holds SlurmOptions by name (time,
    partition, ..., extra_sbatch_args, signal_lead_s, cpus_per_task, mem, exclusive, setup, container_image,
    apptainer, container_mounts); an unknown name is an error listing the valid ones. `gpu`: the plan's GPU kind
    (the catalog's node facts size the resources). Raises InputError naming the bad option."""
    if nodes < 1:
        raise InputError(f"--nodes {nodes}: must be at least 1")
    if shared_token and not re.fullmatch(r"[A-Za-z0-9_-]+", shared_token):
        raise InputError(f"shared_token {shared_token!r}: letters, digits, '-' and '_' only")
    options = SlurmOptions.from_kwargs(**slurm)
    for key, value in (env or {}).items():  # what --env checked; again here for callers of this API
        shell.check_env_value(shell.check_env_name(key), value)
    env_names = tuple(shell.check_env_name(k) for k in dict.fromkeys(env_names))
    preflight = preflight or PreflightOptions()
    if options.container is not None:
        _check_container(options, workdir, job_dir)
    launch_python = python
    python, torchrun, interpreter = job_interpreter(options, python, torchrun)
    return SbatchParams(
        job_name=shell.safe_name(job_name),
        nodes=nodes,
        nproc_per_node=nproc_per_node,
        workdir=workdir,
        job_dir=job_dir,
        plan_path=plan_path,
        torchrun=torchrun,
        python=python,
        gpus_per_node=gpus_per_node,
        slurm=options,
        env=dict(env or {}),
        env_names=env_names,
        resources=slurm_resources.derive(options, nproc_per_node=nproc_per_node, gpus_per_node=gpus_per_node, gpu=gpu),
        interpreter=interpreter,
        gpu_runtime=_gpu_runtime(gpu) if gpus_per_node else None,
        max_requeues=max_requeues,
        preflight=preflight,
        preflight_python=launch_python if options.container is not None else python,
        shared_token=shared_token,
    )


def _check_container(options: SlurmOptions, workdir: str, job_dir: str) -> None:
    flag = "--container-image" if options.container == "pyxis" else "--apptainer"
    for what, path in (("the workdir", workdir), ("the job folder", job_dir)):
        if any(c in path for c in ",:") or not path.isprintable():
            raise InputError(
                f"{flag}: {what} {path!r} is mounted into the container, and a mount path cannot hold ',' or ':'",
                hint="launch from a folder (or with a --jobs-dir) without them",
            )


def _gpu_runtime(gpu: str | None) -> str:
    """apptainer's option that brings the host's GPU driver into the container: --rocm for AMD Instinct (the
    catalog's cdna architectures), else --nv (apptainer exec --nv / --rocm, apptainer.org/docs/user/main/gpu.html)."""
    from llmctl.spec.hardware import resolve_gpu

    try:
        return "--rocm" if gpu and resolve_gpu(gpu).architecture.startswith("cdna") else "--nv"
    except InputError:
        return "--nv"


# A --setup line that activates an environment: a venv's or conda's `activate`, `spack env activate`,
# `eval "$(pixi shell-hook)"`, or one that sets PATH. `module load` is not one: a module adds libraries or tools
# as often as an interpreter, and the launch host's (shared) venv usually still is the one meant.
_ACTIVATES = re.compile(r"\bactivate\b|\bPATH=|\bshell-hook\b")


def job_interpreter(options: SlurmOptions, python: str, torchrun: str) -> tuple[str, str, str]:
    """(python, torchrun, whose in words) for the job: the container's, or the environment a --setup line
    activates (both from PATH: `python3`, `torchrun`), else the given ones (the launch host's)."""
    if options.container is not None:
        return "python3", "torchrun", "the container's, from its PATH"
    active = next((line for line in options.setup if _ACTIVATES.search(line)), None)
    if active is not None:
        return "python3", "torchrun", f"from the PATH that --setup {active!r} makes"
    return python, torchrun, "this machine's (the one that ran llmctl launch)"


def template_text(name: str = TEMPLATE_NAME) -> str:
    """The template shipped in the wheel (llmctl/templates), else the repository's top-level templates/."""
    try:
        shipped = resources.files("llmctl") / "templates" / name
        if shipped.is_file():
            return shipped.read_text()
    except (FileNotFoundError, ModuleNotFoundError):
        pass
    repo = Path(__file__).resolve().parents[2] / "templates" / name
    if not repo.is_file():
        raise RuntimeFailure(f"{name} not found (looked in llmctl/templates and {repo.parent})")
    return repo.read_text()


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["sq"] = shell.quote
    env.filters["lines"] = shell.quote_lines
    env.filters["comment"] = shell.comment
    return env


def render(params: SbatchParams, template: str | None = None) -> str:
    """Pure: parameters in, script text out."""
    context = {f.name: getattr(params, f.name) for f in fields(params) if f.name not in ("slurm", "preflight")}
    options = params.slurm
    context.update(
        preflight=params.preflight.enabled,
        preflight_strict=params.preflight.strict,
        spare_nodes=params.preflight.spare_nodes,
        alloc_nodes=params.nodes + params.preflight.spare_nodes,
        directives=options.directives(),
        extra_sbatch_args=options.extra_sbatch_args,
        signal_lead_s=options.signal_lead_s,
        shutdown_timeout_s=params.shutdown_timeout_s,
        setup=options.setup,
        setup_text="\n".join(options.setup),
        srun_cpus_lines=params.resources.srun_cpus_lines(),
        container=options.container,
        container_env=sorted({*params.env, *params.env_names}),
        step_words=_container_words(params),
        node_step_script=node_step_script(params.engine_module, options.container),
        image=options.container_image or options.apptainer or "",
        check_prefix=CHECK_PREFIX,
        shared_marker=SHARED_MARKER,
        shared_check_script=SHARED_CHECK_SCRIPT,
        shared_check_exit=SHARED_CHECK_EXIT,
        image_check_script=image_check_script(options.container) if options.container else "",
        image_check_exit=IMAGE_CHECK_EXIT,
        preflight_agent=preflight_agent_words(params),
    )
    return _environment().from_string(template if template is not None else template_text()).render(context)


def container_mounts(options: SlurmOptions, workdir: str, job_dir: str) -> str:
    """The container's mounts, SRC:DST[,...]: the workdir and the job folder (unless inside it) at their own paths,
    then the user's (`SRC` alone is SRC:SRC)."""
    own = [workdir] + ([] if (job_dir + "/").startswith(workdir.rstrip("/") + "/") else [job_dir])
    user = [m if ":" in m else f"{m}:{m}" for m in options.mounts]
    return ",".join([f"{p}:{p}" for p in own] + user)


def _container_parts(params: SbatchParams) -> list[list[str]]:
    """pyxis's srun options, or `apptainer exec ... IMAGE`, in groups of words; none without a container."""
    options = params.slurm
    mounts = container_mounts(options, params.workdir, params.job_dir)
    if options.container == "pyxis":
        parts = [
            [f"--container-image={options.container_image}"],
            [f"--container-mounts={mounts}"],
            [f"--container-workdir={params.workdir}"],
        ]
        names = sorted({*params.env, *params.env_names})
        if names:  # pyxis: by default the image's value of a variable wins over the host's; these win here
            parts.append([f"--container-env={','.join(names)}"])
        return parts
    if options.container == "apptainer":
        runtime = [params.gpu_runtime] if params.gpu_runtime else []
        return [["apptainer", "exec", *runtime, f"--bind={mounts}", f"--pwd={params.workdir}", str(options.apptainer)]]
    return []


def container_argv(params: SbatchParams) -> list[str]:
    """What goes between a step's srun options and its command to run it in the container (empty without one)."""
    return [w for words in _container_parts(params) for w in words]


def _container_words(params: SbatchParams) -> str:
    """`container_argv` for the template, shell-quoted, each part on a continued line. Empty without a container."""
    parts = _container_parts(params)
    if not parts:
        return ""
    return "".join(f"\\\n  {shell.join(words)} " for words in parts) + "\\\n  "


@dataclass(frozen=True)
class TuneParams:
    """What templates/tune.sbatch.j2 needs: one allocation of the plan's nodes that runs `llmctl.tune.job`."""

    job_name: str
    nodes: int
    workdir: str
    tune_dir: str
    torchrun: str
    python: str
    gpus_per_node: int | None = None
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    resources: slurm_resources.Resources = field(
        default_factory=lambda: slurm_resources.Resources(False, None, None, "the cluster's defaults")
    )
    interpreter: str = "this machine's"
    rdzv_port_base: int = TUNE_RDZV_PORT_BASE
    llmctl_version: str = llmctl.__version__


def make_tune_params(
    *,
    job_name: str,
    nodes: int,
    workdir: str,
    tune_dir: str,
    torchrun: str,
    python: str,
    gpus_per_node: int | None = None,
    nproc_per_node: int | None = None,
    gpu: str | None = None,
    **slurm: Any,
) -> TuneParams:
    """Validated as `make_params` validates a launch's (the same SlurmOptions, the same derived resources and
    --setup lines). The job gets the submitting environment (sbatch's default), as a launch's job does. Containers
    are refused: the trial runner (`python -m llmctl.tune.job`) runs on the batch host."""
    if nodes < 1:
        raise InputError(f"--nodes {nodes}: must be at least 1")
    options = SlurmOptions.from_kwargs(**slurm)
    if options.container is not None:
        flag = "--container-image" if options.container == "pyxis" else "--apptainer"
        raise InputError(
            f"{flag}: llmctl tune --slurm runs its trial runner on the batch host, outside any container",
            hint="use --setup lines that make the environment instead",
        )
    python, torchrun, interpreter = job_interpreter(options, python, torchrun)
    return TuneParams(
        job_name=shell.safe_name(job_name),
        nodes=nodes,
        workdir=workdir,
        tune_dir=tune_dir,
        torchrun=torchrun,
        python=python,
        gpus_per_node=gpus_per_node,
        slurm=options,
        resources=slurm_resources.derive(
            options, nproc_per_node=nproc_per_node or gpus_per_node, gpus_per_node=gpus_per_node, gpu=gpu
        ),
        interpreter=interpreter,
    )


def render_tune(params: TuneParams) -> str:
    """Pure: the tune job's script."""
    context = {f.name: getattr(params, f.name) for f in fields(params) if f.name != "slurm"}
    context.update(
        directives=params.slurm.directives(),
        extra_sbatch_args=params.slurm.extra_sbatch_args,
        shutdown_timeout_s=max(10, params.slurm.signal_lead_s - 10),
        setup=params.slurm.setup,
        setup_text="\n".join(params.slurm.setup),
        srun_cpus_lines=params.resources.srun_cpus_lines(),
    )
    return _environment().from_string(template_text(TUNE_TEMPLATE_NAME)).render(context)


def node_python_and_torchrun() -> tuple[str, str]:
    """What the nodes run: the login node's torchrun if it is one executable (a shared venv), else the compute
    node's PATH; the batch host's Python: this one when the torchrun is its venv's, else the nodes' python3.
    (`job_interpreter` then prefers a container's or an activated environment's.)"""
    command = local.torchrun_command()
    beside = len(command) == 1 and Path(command[0]).parent == Path(sys.executable).parent
    return (sys.executable if beside else "python3"), (command[0] if len(command) == 1 else "torchrun")


SBATCH_FIX = (
    "make the environment on the nodes with --setup 'source /shared/venv/bin/activate' - a venv on a shared file "
    "system - or a module, or run in a container: --container-image or --apptainer"
)


PREFLIGHT_FIX = (
    "a container job's preflight runs its batch-host half outside the container with it, and a batch host that cannot "
    "skips the preflight (stops, with --spare-nodes or --preflight-strict) - launch from a venv on a shared file system"
)


def _say_interpreter_note(params: SbatchParams) -> None:
    """The one note of `sharedfs.interpreter_note`, on stderr: at submit and with --dry-run."""
    note = sharedfs.interpreter_note([params.torchrun, params.python], SBATCH_FIX)
    if note is None and params.slurm.container is not None and params.preflight.enabled:
        note = sharedfs.interpreter_note([params.preflight_python], PREFLIGHT_FIX)
    if note is not None:
        print(f"llmctl: note: {note}", file=sys.stderr, flush=True)


def submit(script_path: Path, job_dir: Path) -> str:
    """sbatch the script from its job folder (so relative log paths land there); return the job id."""
    try:
        out = subprocess.run(
            ["sbatch", "--parsable", script_path.name],
            cwd=job_dir,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except FileNotFoundError:
        raise RuntimeFailure("sbatch not found", hint="run on a SLURM login node, or use --dry-run") from None
    except subprocess.TimeoutExpired:
        raise RuntimeFailure("sbatch did not answer within 60 s") from None
    if out.returncode != 0:
        msg = (out.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise RuntimeFailure(f"sbatch failed: {msg}", hint=f"the script is in {job_dir}")
    job_id = out.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise RuntimeFailure(f"sbatch printed an unexpected job id: {out.stdout.strip()!r}")
    return job_id


def write_shared_marker(folder: Path) -> str:
    """A fresh random token in the job folder's SHARED_MARKER (the job checks that every node reads it); returns it."""
    import secrets

    token = secrets.token_hex(16)
    write_atomic(folder / SHARED_MARKER, token + "\n")
    return token


def params_for(job: Job, folder: Path) -> SbatchParams:
    """The template's parameters for a job whose folder is (or, for --dry-run, would be) `folder`."""
    python, torchrun = node_python_and_torchrun()
    return make_params(
        job_name=job.name,
        nodes=job.nodes,
        nproc_per_node=job.nproc_per_node,
        workdir=str(job.workdir),
        job_dir=str(folder),
        plan_path=str(folder / "plan.yaml"),
        torchrun=torchrun,
        python=python,
        gpus_per_node=job.nproc_per_node if job.plan.hardware.gpu else None,
        gpu=job.plan.hardware.gpu,
        env=dict(job.env),
        env_names=shell.env_names(job.env),
        preflight=job.preflight,
        **{f.name: getattr(job.slurm, f.name) for f in fields(job.slurm)},
    )


class SbatchBackend(SlurmBackend):
    name = "sbatch"
    help = "SLURM: templates/slurm.sbatch.j2 rendered and submitted with sbatch"
    preflight = True

    def render(self, job: Job) -> str:
        # The script as submitted, but for the token that submit writes in the job folder.
        params = replace(params_for(job, job.dry_run_folder()), shared_token=DRY_RUN_TOKEN)
        job.effective_plan  # noqa: B018 - validates the resized plan, as a real launch would
        _say_interpreter_note(params)
        return render(params)

    def submit(self, job: Job) -> jobs.JobRecord:
        # Validate everything before creating anything on disk.
        params = params_for(job, job.dry_run_folder())
        job.effective_plan  # noqa: B018
        check_run_folders_free(job)
        folder = job.new_folder()
        token = write_shared_marker(folder)
        params = replace(params, job_dir=str(folder), plan_path=str(folder / "plan.yaml"), shared_token=token)
        script = folder / "job.sbatch"
        write_atomic(script, render(params), mode=0o755)
        job_id = submit(script, folder)
        _say_interpreter_note(params)  # with the submitted job (a failed sbatch is its one line alone)
        record = job.record(
            self.name, job_id, folder, [folder / f"slurm-{job_id}.out"], ["sbatch", "--parsable", script.name]
        )
        record.save()
        return record
