"""Several runs of the engine's main in ONE plain process (a world of one, no torchrun), with file damage between
them: `python resume_runs.py OUT.json ACTIONS.json`. Importing torch and transformers is most of a tiny run's cost,
so the resume cases (tests/engine/test_resume_runs.py) share one process.

ACTIONS is a list of {"plan": PATH, "env": {NAME: VALUE}} (a run: the environment set for it alone) and
{"truncate": PATH} (the file cut to half). OUT gets one {"code": exit code, "errors": the `llmctl: error:` lines}
per run, in order.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path


def finish(code: int) -> None:
    """Exit without the interpreter's teardown, as the engine's __main__ does (tests/engine/engine_runs.py)."""
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def main(out: Path, actions: list[dict]) -> None:
    from llmctl.engine.__main__ import main as engine_main

    results = []
    for action in actions:
        if "truncate" in action:
            f = Path(action["truncate"])
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
            continue
        saved = dict(os.environ)
        os.environ.update(action.get("env", {}))
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                code = engine_main([action["plan"]])
        finally:
            os.environ.clear()
            os.environ.update(saved)
        errors = [line for line in err.getvalue().splitlines() if line.startswith("llmctl: error:")]
        results.append({"code": code, "errors": errors})
        out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))
    finish(0)
