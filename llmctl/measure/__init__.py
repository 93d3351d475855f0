"""What runs torch to measure a model, apart from the trainer (llmctl.engine) and the torch-free planner.

- `fake`: any transformers causal LM measured on fake tensors (parameter counts, bytes saved for backward), for
  model types outside the analytical families (llmctl.families); `cache` keeps its results on disk and `hf`
  builds and reads the model, `forward` runs its training forward as on a GPU.
- `saved`: the one saved-bytes harness: what autograd saves for backward, once per storage, by region.
- `memtrack`: live tensor memory of a training step (forward and backward peaks) under a TorchDispatchMode.

Importing this package, or `fake` and `cache`, imports no torch: planning commands reach them lazily, and a cache
hit never imports torch. `saved`, `forward` and `memtrack` need it.
"""
