"""The preflight's agent on each node (`python -m llmctl.launch.preflight agent node|cross`, started by srun): the
node step starts the node's ranks as torchrun would (`run_node_ranks`), the cross step execs torchrun with the
training's c10d rendezvous (`cross_command`); both run llmctl.netbench.quick."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from llmctl.errors import InputError, RuntimeFailure
from llmctl.launch.preflight.job import log_path, step_errors


def cross_command(argv: list[str], env: dict[str, str] | None = None) -> list[str]:
    """On one node, inside the cross step: the torchrun command for this node (exec'd by `agent`), from
    `--nnodes N --rdzv-node NODE --rdzv-endpoint ADDR:PORT --join-timeout-s S [-- worker args]`: the rendezvous the
    training uses, hosted by the named node, every agent bound to its node's address (fake nodes may share a host)."""
    from llmctl.launch.jobs import node_addr
    from llmctl.launch.local import torchrun_command

    env = dict(os.environ) if env is None else env
    sep = argv.index("--") if "--" in argv else len(argv)
    opts, worker_args = dict(zip(argv[:sep:2], argv[1:sep:2])), argv[sep + 1 :]
    node = env.get("SLURMD_NODENAME") or ""
    addr = own_addr(node, env) or node_addr(node)
    if addr is None:
        raise RuntimeFailure(f"scontrol knows no address for this node ({node!r})")
    torchrun = [env["LLMCTL_TORCHRUN"]] if env.get("LLMCTL_TORCHRUN") else torchrun_command()
    return [
        *torchrun,
        f"--nnodes={opts['--nnodes']}",
        f"--nproc_per_node={env.get('LLMCTL_PREFLIGHT_NPROC', '1')}",
        "--rdzv_backend=c10d",
        f"--rdzv_id=preflight-{env.get('SLURM_JOB_ID', '0')}-{env.get('SLURM_RESTART_COUNT', '0')}",
        f"--rdzv_endpoint={opts['--rdzv-endpoint']}",
        f"--rdzv_conf=is_host={int(node == opts['--rdzv-node'])},join_timeout={opts['--join-timeout-s']}",
        f"--local_addr={addr}",
        "--max_restarts=0",
        "--module",
        "llmctl.netbench.quick",
        "cross",
        *worker_args,
    ]


def own_addr(node: str, env: dict[str, str]) -> str | None:
    """This node's address from LLMCTL_NODE_ADDRS ("node=addr ...": a container job's script looks them up, as an
    image need not have scontrol), or None."""
    for pair in env.get("LLMCTL_NODE_ADDRS", "").split():
        name, _, addr = pair.partition("=")
        if name == node and addr:
            return addr
    return None


def rank_env(env: dict[str, str], nproc: int, rank: int, port: int) -> dict[str, str]:
    """What torchrun --standalone gives local rank `rank` of `nproc` on one node (the variables
    llmctl.netbench.options.dist_env and torch's env:// initialization read)."""
    out = {
        **env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    if nproc > 1:
        out.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default: K ranks do not each take every core
    return out


def run_node_ranks(worker_args: list[str], env: dict[str, str] | None = None) -> int:
    """On one node, inside the node step: start the node's ranks as torchrun would (`rank_env`), wait for them, and
    stop the others when one fails (torchrun's --max_restarts=0). Not torchrun itself: its agent imports torch too,
    which is half the step on a busy node; torchrun runs in the cross step and in training."""
    import signal
    import socket

    env = dict(os.environ) if env is None else env
    nproc = int(env.get("LLMCTL_PREFLIGHT_NPROC", "1"))
    with socket.socket() as sock:  # a free port for rank 0's store (loopback: the ranks share this node)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [sys.executable, "-m", "llmctl.netbench.quick", "node", *worker_args]
    procs = [subprocess.Popen(argv, env=rank_env(env, nproc, r, port)) for r in range(nproc)]

    def stop(*_: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()

    previous = signal.signal(signal.SIGTERM, lambda *_: (stop(), sys.exit(143)))  # srun's, at the step timeout
    first = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed and not first:
                first = failed[0]
                stop()
            if all(c is not None for c in codes):
                return first or next((c for c in codes if c), 0)
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGTERM, previous)


def agent(args: list[str]) -> int:
    """`agent node|cross [step options] -- worker args` on one node: its ranks record their failures in the step's
    error file and write their output to a log file per node and step (the job log gets the batch host's summary
    lines, which name that file when something failed). The cross step does not return: it execs torchrun."""
    node = os.environ.get("SLURMD_NODENAME") or ""
    out = Path(args[args.index("--out") + 1]) if "--out" in args else Path(".")
    os.environ["LLMCTL_NODE_NAME"] = node  # bench-net names nodes by it (fake nodes share one hostname)
    step = args[0] if args else ""
    if step not in ("node", "cross"):
        raise InputError(f"agent step {step!r}: expected node or cross")
    os.environ.update(step_errors(out, step, node).variable)
    log = os.open(log_path(out, step, node), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    rest = args[1:]
    if step == "node":
        return run_node_ranks(rest[rest.index("--") + 1 :] if "--" in rest else rest)
    command = cross_command(rest)
    os.execvp(command[0], command)
