"""The preflight: a check of every allocated node before training, the first thing an sbatch job does
(templates/slurm.sbatch.j2) unless `llmctl launch --no-preflight`. Torch-free; the torch half is
llmctl.netbench.quick, which torchrun starts on the nodes.

What runs where, in one job:
1. On the batch host, `python -m llmctl.launch.preflight` (`main.main`, `host.run`): lists the allocated nodes, runs
   two srun steps, decides, logs, appends to the job's events file and prints the nodes to train on (stdout: the
   only thing it prints there; the script reads it). Exit 1 (one line on stderr) when the job must stop.
2. The node step, on every node at once, each alone: `srun` -> `python -m llmctl.launch.preflight agent node`, which
   starts the node's ranks as torchrun would (`node.run_node_ranks`) -> `python -m llmctl.netbench.quick node`: the
   devices are there (the plan's GPU count, each with the memory the plan predicts; on a CPU the ranks start), an
   all-reduce among the node's ranks. In a container job (--container-image, --apptainer) the agent of both steps
   starts in the container, as the training step does: srun's container options, the --setup lines, then the
   container's python (`host.agent_command`, from the script's LLMCTL_PREFLIGHT_AGENT); the batch host's half stays
   outside (it runs srun, scontrol and sinfo) with the Python llmctl was launched with.
3. The cross step, on the nodes that passed, together: `agent cross` execs torchrun with a c10d rendezvous as the
   training uses (`node.cross_command`), running bench-net's worker in quick mode: the all-reduce over all of them
   and a few pairwise rounds. bench-net's rules (`llmctl.netbench.report.judge_nodes`, needs 3 nodes or more) name
   slow nodes and links.
4. Back on the batch host (`decision.decide`): failed and slow nodes are dropped, then, while more nodes remain than
   the plan needs (`--spare-nodes N` asked SLURM for N more), the worst of the rest. Too few left: the job stops,
   naming the nodes, and is requeued without them when the partition has others (`requeue`). Bandwidth well below
   what the plan assumed is a warning with the figures (a stop with --preflight-strict).

Files, under <job folder>/preflight/<job id>.<restart>/: node-<name>.json and node-<name>.errors.jsonl (step 2),
bench.json and cross.errors.jsonl (step 3), result.json (step 4). The events file gets one `preflight ok|warning|
failed <time> restart R: ...` line each (`llmctl status` shows the last).

Modules, one concern each, none importing the package above it: `options` (the launch flags, which the backends
import), `decision` (pure: which nodes train), `job` (the job's environment, files and log lines), `host` (the
batch host's steps), `requeue` (SLURM requeue without the failed nodes), `node` (the agent on each node), `main`.
"""
