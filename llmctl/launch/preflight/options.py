"""The preflight's `llmctl launch --slurm` flags, validated (a `Job` field: llmctl.launch.backends imports this
module alone, not the preflight itself)."""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.bounds import LIMITS
from llmctl.errors import InputError


@dataclass(frozen=True)
class PreflightOptions:
    """`llmctl launch --slurm` options for the preflight (the sbatch executor runs it)."""

    enabled: bool = True
    """--no-preflight turns it off."""
    strict: bool = False
    """--preflight-strict: bandwidth well below the plan's assumption stops the job instead of warning."""
    spare_nodes: int = 0
    """--spare-nodes N: ask SLURM for N more nodes than the plan needs; the preflight drops the worst N."""

    def __post_init__(self) -> None:
        if not 0 <= self.spare_nodes <= LIMITS["--nodes"]:
            raise InputError(f"--spare-nodes {self.spare_nodes}: must be between 0 and {int(LIMITS['--nodes']):,}")
        if not self.enabled and self.spare_nodes:
            raise InputError(
                "--spare-nodes needs the preflight (it picks which nodes to leave out)", hint="drop --no-preflight"
            )
        if not self.enabled and self.strict:
            raise InputError("--preflight-strict with --no-preflight: give one")

    @property
    def given(self) -> list[str]:
        """The flags given a non-default value (for "only apply with ...")."""
        return [
            flag
            for flag, on in (
                ("--no-preflight", not self.enabled),
                ("--preflight-strict", self.strict),
                ("--spare-nodes", bool(self.spare_nodes)),
            )
            if on
        ]
