"""Torch-free specifications: models, hardware, and the plan file (the contract between plan/launch/engine)."""
