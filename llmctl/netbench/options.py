"""bench-net options and launch environment, parsed and checked without torch.

The CLI validates here before it starts any process, so a bad size or dtype is one line, not 8 tracebacks.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import asdict, dataclass

from llmctl.errors import InputError
from llmctl.secrets import is_secret_name, secret_values

# The collectives the worker sweeps (names as in torch.distributed): the shared registry's, in its order. Imported
# here from the torch-free spec, not from report.py, so that the CLI parses options without the pydantic schema.
from llmctl.spec.collectives import COLLECTIVES
from llmctl.units import parse_bytes

# nccl-tests' `-b 1M -e 1G -f 2` sweep on GPUs; on CPUs (gloo over sockets) 64 MiB already shows the plateau.
DEFAULT_SIZES_GPU = "1MiB..1GiB"
DEFAULT_SIZES_CPU = "1MiB..64MiB"
# Quick mode (`WorkerConfig.quick`): the size `llmctl plan` reads a bench-net curve at on GPUs
# (llmctl.plan.network.DEFAULT_BENCH_SIZE_BYTES, FSDP bucket range); on CPUs a quarter of it, which gloo over
# sockets already runs near its plateau at. With the CPU budget of 64 MiB per timed iteration
# (worker.calls_per_iter) a group costs about (1 + QUICK_ITERS) x 64 MiB of traffic: well under a second.
QUICK_SIZE_GPU = "64MiB"
QUICK_SIZE_CPU = "16MiB"
QUICK_ITERS = 3
QUICK_PAIR_ROUNDS = 3
DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}


def parse_size(text: str) -> int:
    """'64MiB', '64M', '1.5G', '4096' -> bytes (binary units, as nccl-tests' -b/-e)."""
    return parse_bytes(text, "message size")


def parse_sizes(text: str) -> list[int]:
    """'1MiB..64MiB' (x2 steps), 'A..B:F' (xF steps), or a comma list '1M,8M,64M' -> sorted unique bytes."""
    text = text.strip()
    if ".." in text:
        lo_s, _, rest = text.partition("..")
        hi_s, _, factor_s = rest.partition(":")
        lo, hi = parse_size(lo_s), parse_size(hi_s)
        try:
            factor = int(factor_s) if factor_s else 2
        except ValueError:
            raise InputError(f"bad size step {factor_s!r} in {text!r} (an integer factor, e.g. :2)") from None
        if factor < 2:
            raise InputError(f"size step must be an integer >= 2, got {factor} in {text!r}")
        if hi < lo:
            raise InputError(f"size range {text!r} ends below its start")
        sizes, s = [], lo
        while s <= hi:
            sizes.append(s)
            s *= factor
        return sizes
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise InputError("no message sizes given", hint="e.g. --sizes 1MiB..64MiB or --sizes 1M,16M")
    return sorted({parse_size(p) for p in parts})


def parse_dtype(text: str) -> str:
    try:
        return DTYPES[text.strip().lower()]
    except KeyError:
        raise InputError(f"unknown dtype {text!r}", hint="choose fp32, bf16 or fp16") from None


def parse_collectives(text: str) -> list[str]:
    names = [c.strip().replace("-", "_") for c in text.split(",") if c.strip()]
    aliases = {
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
        "sendrecv": "send_recv",
        "alltoall": "all_to_all",  # nccl-tests' alltoall_perf
        "all_to_all_single": "all_to_all",
    }
    names = [aliases.get(n, n) for n in names]
    bad = [n for n in names if n not in COLLECTIVES]
    if bad or not names:
        raise InputError(
            f"unknown collective {', '.join(bad) or '(none)'}", hint=f"choose from {', '.join(COLLECTIVES)}"
        )
    return [c for c in COLLECTIVES if c in names]


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker rank needs; passed on the command line from the CLI to each rank."""

    json_path: str
    sizes: str | None = None
    """None: the device's default range."""
    dtype: str | None = None
    """None: bf16 on GPUs, fp32 on CPUs (fp32 is faster than bf16 on CPUs without AMX)."""
    iters: int | None = None
    warmup: int | None = None
    collectives: str = ",".join(COLLECTIVES)
    slow_fraction: float = 0.7
    timeout_s: float = 300.0
    pair_size: str | None = None
    """Message size of the pairwise inter-node test; None: the largest swept size, at most 64 MiB."""
    max_pair_rounds: int = 8
    progress: bool = True

    @classmethod
    def quick(cls, json_path: str, on_gpu: bool, timeout_s: float = 60.0) -> WorkerConfig:
        """bench-net's quick mode (the launch preflight's check across nodes): seconds, not a sweep. One message
        size, the all-reduce only, a few timed iterations, and up to `QUICK_PAIR_ROUNDS` pairwise rounds, so that
        each node meets two or three partners and bench-net's best-link rule can tell a slow node from its
        partner (one round would give both ends of a slow link the same score)."""
        return cls(
            json_path=json_path,
            sizes=QUICK_SIZE_GPU if on_gpu else QUICK_SIZE_CPU,
            iters=QUICK_ITERS,
            warmup=1,
            collectives="all_reduce",
            timeout_s=timeout_s,
            max_pair_rounds=QUICK_PAIR_ROUNDS,
            progress=False,
        )

    def validate(self) -> None:
        if self.sizes is not None:
            parse_sizes(self.sizes)
        if self.dtype is not None:
            parse_dtype(self.dtype)
        if self.pair_size is not None:
            parse_size(self.pair_size)
        parse_collectives(self.collectives)
        for name, v, lo in (("iters", self.iters, 1), ("warmup", self.warmup, 0)):
            if v is not None and v < lo:
                raise InputError(f"--{name} must be >= {lo}, got {v}")
        if not 0 < self.slow_fraction < 1:
            raise InputError(f"--slow-fraction must be between 0 and 1, got {self.slow_fraction}")
        if self.timeout_s <= 0:
            raise InputError(f"--timeout must be positive, got {self.timeout_s}")
        if self.max_pair_rounds < 1:
            raise InputError(f"--max-pair-rounds must be >= 1, got {self.max_pair_rounds}")

    def to_argv(self) -> list[str]:
        argv = []
        for k, v in asdict(self).items():
            if v is None:
                continue
            flag = "--" + k.replace("_", "-")
            if isinstance(v, bool):
                argv.append(flag if v else "--no-" + k.replace("_", "-"))
            else:
                argv += [flag, str(v)]
        return argv


# ---------------------------------------------------------------------------------------------- environment


def node_name() -> str:
    """This node's name: LLMCTL_NODE_NAME (network namespaces share one hostname) or the hostname."""
    return os.environ.get("LLMCTL_NODE_NAME") or socket.gethostname()


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    launcher: str
    """'torchrun' or 'srun'."""
    agent_store: bool
    """torchrun's agent hosts the TCPStore at MASTER_ADDR:MASTER_PORT; every rank is a client."""


def _int_env(env: dict[str, str], name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise InputError(f"environment variable {name} is missing or not an integer") from None


def inside_launcher(env: dict[str, str] | None = None) -> str | None:
    """'torchrun' when started by torchrun (or anything that sets RANK/WORLD_SIZE), 'srun' inside an srun
    step with several tasks, else None (the CLI then starts torchrun itself)."""
    env = dict(os.environ) if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env and "LOCAL_RANK" in env:
        return "torchrun"
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return "srun"
    return None


def _slurm_tasks_on_node(env: dict[str, str]) -> int:
    # SLURM_TASKS_PER_NODE looks like "4(x2),3"; with equal counts the first entry is the answer.
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int_env(env, "SLURM_NTASKS_PER_NODE")
    first = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1")).split(",")[0]
    return int(first.split("(")[0])


def _first_slurm_host(env: dict[str, str]) -> str:
    import subprocess

    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise InputError("inside srun but SLURM_JOB_NODELIST is not set", hint="export MASTER_ADDR")
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        raise InputError(
            "cannot resolve the first node of the allocation with scontrol",
            hint="export MASTER_ADDR=<address of the first node>",
        ) from None
    return out.split()[0]


def dist_env(env: dict[str, str] | None = None) -> DistEnv:
    """Rank layout from torchrun's variables, or from SLURM's when started directly by srun."""
    env = dict(os.environ) if env is None else env
    kind = inside_launcher(env)
    if kind == "torchrun":
        world = _int_env(env, "WORLD_SIZE")
        return DistEnv(
            rank=_int_env(env, "RANK"),
            world_size=world,
            local_rank=_int_env(env, "LOCAL_RANK"),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", "0"))),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int_env(env, "MASTER_PORT"),
            launcher="torchrun",
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        )
    if kind == "srun":
        return DistEnv(
            rank=_int_env(env, "SLURM_PROCID"),
            world_size=_int_env(env, "SLURM_NTASKS"),
            local_rank=_int_env(env, "SLURM_LOCALID"),
            local_world_size=_slurm_tasks_on_node(env),
            node_rank=_int_env(env, "SLURM_NODEID"),
            master_addr=env.get("MASTER_ADDR") or _first_slurm_host(env),
            master_port=int(env.get("MASTER_PORT", "29512")),
            launcher="srun",
            agent_store=False,
        )
    raise InputError(
        "not inside torchrun or srun (no RANK/WORLD_SIZE/LOCAL_RANK or SLURM_PROCID)",
        hint="run `llmctl bench-net --nproc-per-node K`, which starts torchrun",
    )


_RECORDED = re.compile(
    r"^(NCCL_|TORCH_NCCL_|GLOO_|TP_SOCKET_IFNAME$|FI_|UCX_|CUDA_VISIBLE_DEVICES$|OMP_NUM_THREADS$|"
    r"LLMCTL_NODE_NAME$)"
)


def recorded_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that change collective performance (NCCL_*, GLOO_SOCKET_IFNAME, ...); never a secret, by name
    or by value (launch's rule: `llmctl.secrets`)."""
    env = dict(os.environ) if env is None else env
    secrets = set(secret_values(env))
    return {k: v for k, v in sorted(env.items()) if _RECORDED.match(k) and not is_secret_name(k) and v not in secrets}
