"""Starting the bench-net worker under torchrun from `llmctl bench-net` outside a launcher (`--standalone` on one
node; `--nnodes/--node-rank/--master-addr` for several, one command per node), with its stderr filtered and its
failures read back as one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from llmctl.childerrors import ChildErrors
from llmctl.errors import PREFIX, RuntimeFailure
from llmctl.launch.local import Rendezvous, module_argv
from llmctl.netbench import options as opts

WORKER_MODULE = "llmctl.netbench.worker"

# torchrun's own failure report (a traceback of the agent) is noise once the worker said what went wrong.
_TORCHRUN_NOISE = re.compile(r"^(Traceback \(most recent call last\)|[EWI]\d{4} .*torch/distributed/elastic)")
_JOINED = re.compile(r"waiting for clients\. (\d+)/(\d+) clients joined")
# c10d warns on every connection when addresses do not resolve to names (namespaces, bare clusters): harmless.
_HARMLESS = re.compile(r"^\[W\d{4} .*hostname of the client socket cannot be retrieved")


def torchrun_argv(cfg: opts.WorkerConfig, nproc_per_node: int, rdzv: Rendezvous) -> list[str]:
    """The torchrun command line, built by launch's `module_argv` (static rendezvous across nodes: node rank 0
    hosts the store). The ranks render nothing: this process prints the report."""
    return module_argv(
        WORKER_MODULE,
        [*cfg.to_argv(), "--no-render"],
        nproc_per_node,
        rdzv,
        max_restarts=0,
        # This interpreter's torchrun, never another one found on PATH: the ranks must import this llmctl.
        launcher=[sys.executable, "-m", "torch.distributed.run"],
    )


def run_worker(cfg: opts.WorkerConfig, nproc_per_node: int, rdzv: Rendezvous, tmp: Path) -> None:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several ranks, without its warning
    env.setdefault("TMPDIR", str(tmp))  # torchrun leaves torchelastic_* folders in TMPDIR
    if sys.stderr.isatty():
        env["LLMCTL_FORCE_TTY"] = "1"  # the worker's stderr is a pipe through us; keep the live progress bar
    log_path = tmp / "torchrun.log"
    # The workers record their failures here (llmctl.errors.report); their stderr lines are only shown.
    errors = ChildErrors.in_folder(tmp)
    env.update(errors.variable)
    try:
        proc = subprocess.Popen(
            torchrun_argv(cfg, nproc_per_node, rdzv),
            env=env,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
    except OSError as e:
        raise RuntimeFailure(f"cannot start torchrun: {e}") from None
    pump = threading.Thread(target=_filter_stderr, args=(proc.stderr, log_path), daemon=True)
    pump.start()
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait(timeout=30)
        raise
    pump.join(timeout=10)
    if rc != 0:
        errors.raise_first(count_others=True)
        log = log_path.read_text(errors="replace")
        joined = _JOINED.search(log)
        if joined:  # torchrun's static rendezvous: node rank 0's agent waited for the other nodes' agents
            raise RuntimeFailure(
                f"only {joined.group(1)} of {joined.group(2)} nodes joined the rendezvous at "
                f"{rdzv.master_addr}:{rdzv.master_port} within {cfg.timeout_s:g} s",
                hint="start `llmctl bench-net --nnodes N --node-rank I` on every node, same --master-addr/port",
            )
        tail = [ln for ln in log.splitlines() if ln.strip()][-1:] or ["?"]
        raise RuntimeFailure(f"torchrun exited with code {rc}: {tail[0].strip()[:300]}")


def _filter_stderr(stream, log_path: Path) -> None:  # noqa: ANN001 - a binary pipe
    """Pass the workers' stderr (progress bar) through; keep the workers' error lines and torchrun's own
    failure report out of the terminal (they go to a log; the error file gives our one line)."""
    muted = False
    with open(log_path, "wb") as log:
        for raw in iter(stream.readline, b""):
            log.write(raw)
            line = raw.decode(errors="replace")
            if line.startswith(PREFIX):
                continue
            muted = muted or bool(_TORCHRUN_NOISE.match(line))
            if not muted and not _HARMLESS.match(line):
                sys.stderr.write(line)
                sys.stderr.flush()
