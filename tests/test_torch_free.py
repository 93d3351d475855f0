"""The planning commands never import torch or transformers (checked in a fresh interpreter)."""

import subprocess
import sys

import pytest

CHECK = """
import sys
sys.argv = {argv!r}
from llmctl.cli.main import main
try:
    main()
except SystemExit as e:
    code = e.code
else:
    code = 0
heavy = sorted(m for m in ("torch", "transformers", "numpy", "matplotlib") if m in sys.modules)
print("HEAVY=" + ",".join(heavy), "CODE=" + str(code), file=sys.stderr)
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["llmctl", "--help"],
        ["llmctl", "estimate-memory", "llama-3.1-70b", "--gpu", "H100-SXM", "--nodes", "4", "--gpus-per-node", "8"],
        ["llmctl", "estimate", "gpt2", "--json"],
        ["llmctl", "estimate-memory", "--list-models"],
    ],
)
def test_no_torch_import(argv):
    r = subprocess.run([sys.executable, "-c", CHECK.format(argv=argv)], capture_output=True, text=True, timeout=60)
    last = r.stderr.strip().splitlines()[-1]
    assert last == "HEAVY= CODE=0", r.stderr[-2000:]
