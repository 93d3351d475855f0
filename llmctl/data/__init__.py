"""Training data at scale: `llmctl data prepare` turns text, JSON lines, CSV, parquet and Hugging Face datasets into
sharded memory-mapped token files (llmctl.data.prepare), which the engine opens with llmctl.data.format.

Torch-free: format.py needs numpy only; the readers import pyarrow / datasets lazily (the `[data]` extra).
"""
