"""The shared training engine (torch lives here only). Entry point: `python -m llmctl.engine PLAN.yaml`."""
