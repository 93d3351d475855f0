"""`python -m llmctl.launch.preflight`: the batch host's preflight, or `... agent node|cross` on each node."""

import sys

from llmctl.launch.preflight.main import main

if __name__ == "__main__":
    sys.exit(main())
