"""Torch-free planning math: memory model, FLOPs, communication, planner."""
