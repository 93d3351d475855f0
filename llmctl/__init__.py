"""llmctl: from "train model M on hardware H" to a running, well-tuned training job."""

__version__ = "0.1.0"
