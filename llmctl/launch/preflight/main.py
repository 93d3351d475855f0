"""`python -m llmctl.launch.preflight [--strict]` on the batch host (stdout: the nodes to train on; exit 1: the job
stops; exit 3: it was requeued without the failed nodes), or `... agent node|cross ...` on each node."""

from __future__ import annotations

import os
import sys

from llmctl.errors import InputError
from llmctl.errors import report as report_error
from llmctl.launch.preflight.decision import nodelist
from llmctl.launch.preflight.host import run
from llmctl.launch.preflight.job import JobContext
from llmctl.launch.preflight.node import agent
from llmctl.launch.preflight.requeue import REQUEUED_EXIT, requeue


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args[:1] == ["agent"]:
            return agent(args[1:])
        unknown = [a for a in args if a != "--strict"]
        if unknown:
            raise InputError(
                f"unexpected arguments {unknown}", hint="usage: python -m llmctl.launch.preflight [--strict]"
            )
        d = run(strict="--strict" in args)
        if not d.ok and d.exclude and requeue(JobContext.from_env(), d, dict(os.environ)):
            return REQUEUED_EXIT
    except Exception as e:  # LlmctlError, or a bug: one line in the job log, and the job stops rather than trains blind
        return report_error(e)
    if not d.ok:
        return 1
    print(nodelist(d.train), flush=True)
    return 0
