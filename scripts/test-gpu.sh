#!/usr/bin/env bash
# The GPU tier (`make test-gpu`): pytest -m gpu on a machine with CUDA; elsewhere one line saying why nothing ran,
# exit 0. PY is the interpreter that holds a CUDA torch (the Makefile's venv, or the machine's own python3).
# Its figures land in $LLMCTL_GPU_RUN_DIR/report.json (default runs/gpu-tier/report.json).
set -u
PY="${PY:-python3}"
why=$("$PY" - <<'PYEOF' 2>&1
try:
    import torch
except Exception as e:
    print(f"torch does not import ({type(e).__name__}: {e})")
else:
    if not torch.cuda.is_available():
        print(f"no CUDA GPU on this machine (torch {torch.__version__}, built for CUDA {torch.version.cuda})")
PYEOF
)
if [ -n "$why" ]; then
    echo "test-gpu: nothing ran: $why"
    exit 0
fi
exec "$PY" -m pytest -m gpu tests/gpu -v -rs --durations=20 -p no:cacheprovider "$@"
