"""What each node of a SLURM job gets: CPUs, memory, whole nodes. Derived from the node and the ranks, each value
overridable by the option of the same name (`SlurmOptions.cpus_per_task`, `mem`, `exclusive`). Torch-free.

The sbatch executor runs ONE task per node (torchrun starts the node's ranks), so that task needs the CPUs of all
the node's ranks. Without --cpus-per-task a task gets one CPU, and the CPU binding of many sites then puts every rank
of the node on it: the reason this module exists.

- A job on all the GPUs of a node (the GPU catalog's `node_gpus`) takes the whole node: `--exclusive` and `--mem=0`.
  sbatch's --exclusive gives the job all CPUs and GRES of its nodes "but only as much memory as it requested";
  --mem=0 "grants the job access to all of the memory on each node" (https://slurm.schedmd.com/sbatch.html#OPT_exclusive,
  #OPT_mem). The step's task then gets all of the node's CPUs: the fewest any node of the allocation has, read from
  SLURM_JOB_CPUS_PER_NODE when the job runs (a number written in advance could be more than a node has, and sbatch
  would refuse the job, or less, and the ranks would lose cores).
- A job on part of a node asks for a per-GPU share of CPUs and memory: the catalog's `node_cpus_per_gpu` and
  `node_memory_gib_per_gpu` (the smallest share among common nodes of that GPU kind), else the defaults below.
- CPU ranks (a plan without GPUs, gloo): one CPU per rank, memory as the cluster's default (DefMemPerCPU/Node).

Since Slurm 22.05 srun does not inherit --cpus-per-task from sbatch ("It must be requested again with the call to
srun or set with the SRUN_CPUS_PER_TASK environment variable", sbatch(1) --cpus-per-task): the job script exports
SRUN_CPUS_PER_TASK (`srun_cpus_lines`), which every srun of the job (the preflight's, the training step) reads.
Sites: NERSC Perlmutter and JSC JUWELS Booster give whole GPU nodes in their regular queues (4 GPUs each); cloud
clusters (AWS ParallelCluster / SageMaker HyperPod p5, GCP a3 through Cluster Toolkit) schedule 8-GPU nodes, where
a job on all 8 GPUs is a whole node.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.errors import LlmctlError
from llmctl.launch.slurm_options import SlurmOptions

DEFAULT_NODE_GPUS = 8
"""GPUs per node for a GPU kind the catalog does not know: HGX/DGX and OAM baseboards hold 8, and so do the largest
GPU instances of AWS (p4d, p5), GCP (a2-*-8g, a3) and Azure (ND A100 v4, ND H100 v5)."""
DEFAULT_CPUS_PER_GPU = 8
"""CPUs per GPU on part of a node when the catalog has no `node_cpus_per_gpu` for the kind: AWS p3.16xlarge (64 vCPU
for 8 V100) is the smallest share among common GPU nodes (torchx named_resources_aws; aws.amazon.com/ec2/instance-
types/p3); the L4/L40S/A10G 8-GPU instances (GCP g2-standard-96, AWS g5/g6/g6e.48xlarge) have 12 to 24."""
DEFAULT_MEMORY_GIB_PER_GPU = 32
"""Host memory per GPU on part of a node when the catalog does not say: GCP g2-standard-96 (384 GB for 8 L4) and AWS
g4dn.metal (384 GiB for 8 T4) give 48 GB per GPU, the smallest share among common GPU nodes; 32 GiB leaves room for
what SLURM keeps back for the OS."""
CPUS_PER_CPU_RANK = 1
"""CPUs per rank for a plan without GPUs: torchrun sets OMP_NUM_THREADS=1 for each rank when it starts several
(torch.distributed.run), so a rank computes on one core."""


@dataclass(frozen=True)
class NodeShare:
    """What one GPU of a node of this kind may ask for, and how many GPUs make the whole node."""

    node_gpus: int
    cpus_per_gpu: int
    memory_gib_per_gpu: int
    source: str
    """Where the numbers come from, for the job script's comment."""


def node_share(gpu: str | None) -> NodeShare:
    """The catalog's facts for a GPU kind, the defaults where it has none (or does not know the kind: the plan's
    GPU is not checked against the catalog, which can grow on the cluster)."""
    from llmctl.spec.hardware import resolve_gpu

    spec = None
    if gpu:
        try:
            spec = resolve_gpu(gpu)
        except LlmctlError:
            spec = None
    if spec is None:
        what = f"{gpu}: not in the GPU catalog" if gpu else "no GPU kind"
        return NodeShare(DEFAULT_NODE_GPUS, DEFAULT_CPUS_PER_GPU, DEFAULT_MEMORY_GIB_PER_GPU, f"defaults; {what}")
    known = spec.node_cpus_per_gpu is not None and spec.node_memory_gib_per_gpu is not None
    return NodeShare(
        spec.node_gpus,
        spec.node_cpus_per_gpu or DEFAULT_CPUS_PER_GPU,
        spec.node_memory_gib_per_gpu or DEFAULT_MEMORY_GIB_PER_GPU,
        f"GPU catalog: {spec.name}" if known else f"defaults; GPU catalog: {spec.name} without node facts",
    )


@dataclass(frozen=True)
class Resources:
    """The job's per-node resource lines. `cpus_per_task` None with `exclusive`: all of the node's CPUs, read when
    the job runs; None without: the cluster's default (one CPU). `mem` None: the cluster's default."""

    exclusive: bool
    cpus_per_task: int | None
    mem: str | None
    why: str
    """One line for the job script: where the values come from."""

    def directives(self) -> list[str]:
        """`#SBATCH` options, in the order the template writes them."""
        out = ["--exclusive"] if self.exclusive else []
        if self.cpus_per_task is not None:
            out.append(f"--cpus-per-task={self.cpus_per_task}")
        if self.mem is not None:
            out.append(f"--mem={self.mem}")
        return out

    def srun_cpus_lines(self, tasks_per_node: int = 1) -> list[str]:
        """Shell lines that export SRUN_CPUS_PER_TASK for the job's sruns (`tasks_per_node` tasks share a node's
        CPUs: submitit runs one per rank). Nothing when the job asks for no CPUs (the cluster's default)."""
        if self.cpus_per_task is not None:
            return [f"export SRUN_CPUS_PER_TASK={max(1, self.cpus_per_task // tasks_per_node)}"]
        if not self.exclusive:
            return []
        # "72(x2),64": CPUs per node of the allocation; the fewest, so that a step fits on every node.
        fewest = "$(echo \"$SLURM_JOB_CPUS_PER_NODE\" | tr ',' '\\n' | sed 's/(.*//' | sort -n | head -n 1)"
        share = fewest if tasks_per_node == 1 else f"$(( {fewest} / {tasks_per_node} ))"
        return [
            # Left over from a submitting allocation (sbatch passes the environment): srun refuses two values.
            "unset SLURM_CPUS_PER_TASK SLURM_TRES_PER_TASK",
            f"SRUN_CPUS_PER_TASK={share}",
            *(['[ "$SRUN_CPUS_PER_TASK" -ge 1 ] || SRUN_CPUS_PER_TASK=1'] if tasks_per_node > 1 else []),
            "export SRUN_CPUS_PER_TASK",
        ]


def derive(
    options: SlurmOptions, *, nproc_per_node: int | None, gpus_per_node: int | None, gpu: str | None
) -> Resources:
    """The resources for nodes that each run `nproc_per_node` ranks on `gpus_per_node` GPUs (None: CPU ranks) of
    kind `gpu`, with the user's --cpus-per-task / --mem / --exclusive taking precedence. `nproc_per_node` None: not
    known (the CPUs are then the cluster's default)."""
    sbatch_args = options.sbatch_arg_names()
    own_cpus = sbatch_args & {"--cpus-per-gpu"}  # sbatch refuses it with --cpus-per-task
    own_mem = sbatch_args & {"--mem-per-cpu", "--mem-per-gpu"}  # mutually exclusive with --mem (sbatch --mem)
    if gpus_per_node:
        share = node_share(gpu)
        full = gpus_per_node >= share.node_gpus
        exclusive = full if options.exclusive is None else options.exclusive
        if exclusive:
            why = (
                "--exclusive: the whole node"
                if options.exclusive
                else (f"{gpus_per_node} of {share.node_gpus} GPUs ({share.source}): the whole node")
            )
            cpus, mem = options.cpus_per_task, options.mem or "0"
        else:
            why = (
                f"{gpus_per_node} of {share.node_gpus} GPUs: {share.cpus_per_gpu} CPUs and "
                f"{share.memory_gib_per_gpu} GiB per GPU ({share.source})"
            )
            cpus = options.cpus_per_task or gpus_per_node * share.cpus_per_gpu
            mem = options.mem or f"{gpus_per_node * share.memory_gib_per_gpu}G"
    elif options.exclusive:
        exclusive, why, cpus, mem = True, "--exclusive: the whole node", options.cpus_per_task, options.mem or "0"
    else:
        exclusive = False
        ranks = f"{nproc_per_node} CPU rank(s)" if nproc_per_node else "CPU ranks"
        why = f"{ranks}, {CPUS_PER_CPU_RANK} CPU each; memory: the cluster's default"
        cpus = options.cpus_per_task or (nproc_per_node * CPUS_PER_CPU_RANK if nproc_per_node else None)
        mem = options.mem
    given = [f"{flag} {v}" for flag, v in (("--cpus-per-task", options.cpus_per_task), ("--mem", options.mem)) if v]
    if given:
        why += f"; {', '.join(given)} given"
    return Resources(
        exclusive=exclusive,
        cpus_per_task=None if own_cpus else cpus,
        mem=None if own_mem else mem,
        why=why,
    )
