"""Run plans through the engine's main in this one process, world of one (tests/engine/test_one_rank_adapters.py).

argv: OUT PLAN [PLAN ...]; a plan path prefixed with `fsdp:` runs with FSDP2 forced on (the rule
llmctl.spec.setup.fsdp_wraps patched to True), as the engine ran a world of one before adapters left FSDP2. Writes
{plan: exit code} to OUT."""

from __future__ import annotations

import json
import os
import sys

import llmctl.spec.setup as setup
from llmctl.engine.__main__ import main

out, codes, rule = sys.argv[1], {}, setup.fsdp_wraps
for arg in sys.argv[2:]:
    forced = arg.startswith("fsdp:")
    setup.fsdp_wraps = (lambda *a: True) if forced else rule
    codes[arg] = main([arg.removeprefix("fsdp:")])
with open(out, "w") as f:
    json.dump(codes, f)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # as the engine's own __main__ leaves (its docstring: no teardown after the process group is gone)
