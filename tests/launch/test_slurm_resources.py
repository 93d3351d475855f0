"""What a SLURM job asks for and how its environment is made, from the user's report:

    llmctl launch plan70b.yaml --slurm --dry-run -t 24:00:00 -p gpu -A myproj

rendered `--ntasks-per-node=1 --gpus-per-node=8` and nothing else: no CPUs for the node's 8 ranks, no memory, no
whole node, and no way to make the job's environment (modules, a venv, a container, HF_HOME, a token by name).
Each test starts from the user's command line (through the CLI) or from the renderer's parameters, and runs the
rendered shell where what matters is what bash does with it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from launch_helpers import REPO, write_stub
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.errors import InputError
from llmctl.launch import sharedfs, shell, slurm, slurm_resources
from llmctl.launch.preflight.options import PreflightOptions
from llmctl.launch.slurm_options import SlurmOptions

PLAN_70B = REPO / "examples" / "clusters" / "llama-3.1-70b-8x8-h100" / "plan.yaml"
USER_COMMAND = ["--slurm", "--dry-run", "-t", "24:00:00", "-p", "gpu", "-A", "myproj"]
NO_PREFLIGHT = PreflightOptions(enabled=False)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LLMCTL_JOBS_DIR", raising=False)
    (tmp_path / "plan70b.yaml").write_text(PLAN_70B.read_text())
    return tmp_path


def dry_run(*args: str) -> tuple[int, str, str]:
    """`llmctl launch plan70b.yaml ARGS`: exit code, the script (stdout), stderr."""
    r = CliRunner().invoke(app, ["launch", "plan70b.yaml", *args])
    return r.exit_code, r.stdout, r.stderr


def sbatch_lines(script: str) -> list[str]:
    return [ln for ln in script.splitlines() if ln.startswith("#SBATCH ")]


def params(**kw: object) -> slurm.SbatchParams:
    """A 70B-style job: 8 nodes x 8 H100, launched from /lustre/alice/runs."""
    base: dict[str, object] = dict(
        job_name="llama-3.1-70b",
        nodes=8,
        nproc_per_node=8,
        workdir="/lustre/alice/runs",
        job_dir="/lustre/alice/runs/llmctl-jobs/j1",
        plan_path="/lustre/alice/runs/llmctl-jobs/j1/plan.yaml",
        torchrun="/lustre/alice/venv/bin/torchrun",
        python="/lustre/alice/venv/bin/python",
        gpus_per_node=8,
        gpu="H100-SXM",
        time="24:00:00",
        partition="gpu",
        account="myproj",
    )
    base.update(kw)
    return slurm.make_params(**base)  # type: ignore[arg-type]


def run_bash(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", code], env=env, capture_output=True, text=True, timeout=30)


# --- resources: the user's command -------------------------------------------------------------------------------------
def test_the_reported_command_takes_whole_nodes_and_gives_the_step_their_cpus(workdir: Path) -> None:
    code, script, _ = dry_run(*USER_COMMAND)
    assert code == 0, script
    lines = sbatch_lines(script)
    for want in ("--ntasks-per-node=1", "--gpus-per-node=8", "--exclusive", "--mem=0", "--time=24:00:00"):
        assert f"#SBATCH {want}" in lines, want
    # All of a node's CPUs: not a number written in advance (it could exceed a node's and be refused).
    assert not any(ln.startswith("#SBATCH --cpus-per-task") for ln in lines)
    assert "SRUN_CPUS_PER_TASK=$(" in script and "export SRUN_CPUS_PER_TASK" in script
    # The full script is printed: the step's torchrun line ends it.
    assert script.startswith("#!/bin/bash\n") and script.rstrip().endswith('finish "$rc" step')


@pytest.mark.parametrize(
    "cpus_per_node, tasks, want",
    [("224(x2),192", 1, "192"), ("96", 1, "96"), ("72,64(x3)", 1, "64"), ("224(x2),192", 8, "24"), ("4", 8, "1")],
)
def test_the_step_gets_the_fewest_cpus_any_node_of_the_job_has(cpus_per_node: str, tasks: int, want: str) -> None:
    """The exported lines, run by bash with SLURM's variable: the fewest CPUs of any node (split over submitit's
    task per rank, at least one each), and a leftover SLURM_CPUS_PER_TASK of a submitting allocation cleared (srun
    refuses two different values)."""
    lines = params().resources.srun_cpus_lines(tasks_per_node=tasks)
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_CPUS_PER_NODE": cpus_per_node, "SLURM_CPUS_PER_TASK": "3"}
    out = run_bash("\n".join(lines) + '\necho "$SRUN_CPUS_PER_TASK ${SLURM_CPUS_PER_TASK-unset}"', env)
    assert out.stdout.split() == [want, "unset"], out.stderr


def test_the_srun_cpus_are_the_nodes_split_over_its_tasks() -> None:
    """srun_cpus_lines itself: one task per node (sbatch) gets the node's CPUs; submitit's one task per rank gets
    its share, never less than one."""
    res = slurm_resources.Resources(False, 32, "100G", "given")
    assert res.srun_cpus_lines() == ["export SRUN_CPUS_PER_TASK=32"]
    assert res.srun_cpus_lines(tasks_per_node=4) == ["export SRUN_CPUS_PER_TASK=8"]
    assert slurm_resources.Resources(False, 2, None, "given").srun_cpus_lines(4) == ["export SRUN_CPUS_PER_TASK=1"]
    assert slurm_resources.Resources(False, None, None, "default").srun_cpus_lines(4) == []


def test_part_of_a_node_asks_for_the_catalogs_share_per_gpu(workdir: Path) -> None:
    code, script, _ = dry_run(*USER_COMMAND, "--nproc-per-node", "4")
    assert code == 0, script
    lines = sbatch_lines(script)
    # H100-SXM in presets/gpus.yaml: 12 CPUs and 192 GiB per GPU
    assert "#SBATCH --cpus-per-task=48" in lines and "#SBATCH --mem=768G" in lines
    assert "#SBATCH --exclusive" not in lines
    assert "export SRUN_CPUS_PER_TASK=48" in script.splitlines()


@pytest.mark.parametrize(
    "flags, want, absent",
    [
        (["--cpus-per-task", "64", "--mem", "200g"], ["--exclusive", "--cpus-per-task=64", "--mem=200G"], []),
        (["--no-exclusive"], ["--cpus-per-task=96", "--mem=1536G"], ["--exclusive"]),
        (["--nproc-per-node", "2", "--exclusive"], ["--exclusive", "--mem=0"], ["--cpus-per-task=24"]),
        (["--nproc-per-node", "2", "--mem", "0"], ["--cpus-per-task=24", "--mem=0"], ["--exclusive"]),
        # What scripts said before these options existed sets the option, once.
        (["--sbatch-arg=--mem=64G", "--sbatch-arg=-c 16"], ["--mem=64G", "--cpus-per-task=16"], ["--mem=0"]),
        # Another memory form: no --mem of ours (sbatch refuses --mem with --mem-per-gpu).
        (["--nproc-per-node", "2", "--sbatch-arg=--mem-per-gpu=100G"], ["--mem-per-gpu=100G"], ["--mem=384G"]),
        (["--nproc-per-node", "2", "--sbatch-arg=--cpus-per-gpu=10"], ["--cpus-per-gpu=10"], ["--cpus-per-task=24"]),
    ],
)
def test_each_resource_is_overridden_by_its_flag(workdir: Path, flags: list[str], want: list[str], absent: list[str]):
    code, script, _ = dry_run(*USER_COMMAND, *flags)
    assert code == 0, script
    lines = sbatch_lines(script)
    for w in want:
        assert f"#SBATCH {w}" in lines, (w, lines)
        assert sum(ln.startswith(f"#SBATCH {w.split('=')[0]}") for ln in lines) == 1, (w, lines)  # written once
    for a in absent:
        assert f"#SBATCH {a}" not in lines, (a, lines)
    if "--cpus-per-task=64" in want:
        assert "export SRUN_CPUS_PER_TASK=64" in script.splitlines()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--mem", "200GB"], "--mem '200GB': not a SLURM memory size"),
        (["--mem", "lots"], "--mem 'lots'"),
        (["--cpus-per-task", "0"], "--cpus-per-task 0: must be at least 1"),
        (["--cpus-per-task", "-4"], "--cpus-per-task -4"),
        (["--sbatch-arg=--exclusive=user"], "--sbatch-arg --exclusive=user"),
        (["--sbatch-arg=-c many"], "expected a number of CPUs"),
        (["--sbatch-arg=--mem=1G", "--mem", "2G"], "give one"),
    ],
)
def test_bad_resource_values_are_one_line_exit_2(workdir: Path, flags: list[str], message: str) -> None:
    r = CliRunner().invoke(app, ["launch", "plan70b.yaml", *USER_COMMAND, *flags])
    assert r.exit_code == 2, r.output
    assert r.stdout == "" and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_resources_for_kinds_the_catalog_knows_less_about() -> None:
    def derive(gpu: str | None, gpus: int | None, nproc: int, **opts: object) -> slurm_resources.Resources:
        return slurm_resources.derive(SlurmOptions(**opts), nproc_per_node=nproc, gpus_per_node=gpus, gpu=gpu)

    # L4: in the catalog, without node facts -> llmctl's per-GPU defaults (8 CPUs, 32 GiB)
    assert derive("L4", 2, 2).directives() == ["--cpus-per-task=16", "--mem=64G"]
    # A kind the catalog does not know (the plan's GPU is not checked against it): the same defaults, no error
    assert derive("X9000", 4, 4).directives() == ["--cpus-per-task=32", "--mem=128G"]
    assert derive("X9000", 8, 8).directives() == ["--exclusive", "--mem=0"]
    # A100-40GB: 12 CPUs and 48 GiB per GPU (Perlmutter's 4-GPU node is the smallest share)
    assert derive("A100-40GB", 4, 4).directives() == ["--cpus-per-task=48", "--mem=192G"]
    # CPU ranks: one CPU each, the cluster's memory; not known (tune's CPU plans): the cluster's defaults
    assert derive(None, None, 3).directives() == ["--cpus-per-task=3"]
    r = slurm_resources.derive(SlurmOptions(), nproc_per_node=None, gpus_per_node=None, gpu=None)
    assert r.directives() == [] and r.srun_cpus_lines() == []


def test_the_catalogs_node_facts_are_validated() -> None:
    from llmctl.errors import SpecError
    from llmctl.spec.hardware import parse_catalog, resolve_gpu

    h100 = resolve_gpu("H100-SXM")
    assert (h100.node_gpus, h100.node_cpus_per_gpu, h100.node_memory_gib_per_gpu) == (8, 12, 192)
    entry = PLAN_70B.parent.parent.parent.parent / "llmctl" / "spec" / "presets" / "gpus.yaml"
    text = entry.read_text().split("\n- name: ")[1]  # the first entry, without node facts
    bad = "- name: " + text.rstrip() + "\n  node_cpus_per_gpu: 0\n"
    with pytest.raises(SpecError, match="node_cpus_per_gpu"):
        parse_catalog(bad, "test.yaml")


# --- --setup ------------------------------------------------------------------------------------------------------------
SETUP = ["module load cuda/12.4", "source /shared/venv/bin/activate", "export HF_HOME=/lustre/hf"]


def test_setup_lines_run_as_written_before_anything_runs_python(workdir: Path) -> None:
    flags = [a for line in SETUP for a in ("--setup", line)]
    code, script, _ = dry_run(*USER_COMMAND, *flags)
    assert code == 0, script
    lines = script.splitlines()
    where = [lines.index(line) for line in SETUP]  # each as written, on a line of its own
    assert where == sorted(where)
    first_python = lines.index('train_nodes=$("$LLMCTL_PYTHON" -m llmctl.launch.preflight) || {')
    step = next(i for i, ln in enumerate(lines) if ln.startswith("srun "))
    assert max(where) < first_python < step
    # A failing line stops the job through finish (the events file, the exit code).
    assert (
        lines[where[0] + 1] == 'llmctl_rc=$?; if [ "$llmctl_rc" != 0 ]; then finish "$llmctl_rc" "--setup line 1"; fi'
    )
    # The same lines for each node's step, and the interpreter from the PATH the activation makes.
    assert f"export LLMCTL_SETUP={shell.quote_lines(chr(10).join(SETUP))}" in lines
    assert "export LLMCTL_TORCHRUN=torchrun" in lines and "export LLMCTL_PYTHON=python3" in lines


def test_without_an_activation_the_launch_hosts_interpreter_stays(workdir: Path) -> None:
    p = params(setup=["module load cuda/12.4", "export HF_HOME=/lustre/hf"])
    assert (p.torchrun, p.python) == ("/lustre/alice/venv/bin/torchrun", "/lustre/alice/venv/bin/python")
    for line in ("conda activate train", ". /x/bin/activate", 'eval "$(pixi shell-hook)"', "export PATH=/o/bin:$PATH"):
        assert params(setup=[line]).torchrun == "torchrun", line
    assert params(setup=["conda deactivate"]).torchrun == "/lustre/alice/venv/bin/torchrun"


@pytest.mark.parametrize(
    "line, message",
    [
        ("module load a\nrm -rf /", "one line of shell code"),
        ("export A=1\r", "one line of shell code"),
        ("echo \0", "one line of shell code"),
        ("", "an empty line"),
        ("module load cuda \\", "ends with a backslash"),
        ("if true; then", "not one complete shell command line"),
        ("echo 'unclosed", "not one complete shell command line"),
        ("cat <<EOF", "not one complete shell command line"),  # would swallow the script's next lines
    ],
)
def test_a_setup_value_that_is_not_one_complete_line_is_refused(line: str, message: str) -> None:
    if "complete" in message and shutil.which("bash") is None:
        pytest.skip("no bash here to check the syntax with")
    with pytest.raises(InputError, match=message):
        SlurmOptions(setup=(line,))


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="\0", blacklist_categories=("Cs",))))
def test_the_setup_lines_word_gives_bash_back_exactly_the_lines(value: str) -> None:
    word = shell.quote_lines(value)
    assert "\n" not in word and "\r" not in word
    out = subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True)
    assert out.stdout == value.encode("utf-8", "surrogateescape")


def batch_env(tmp_path: Path, bindir: Path, **extra: str) -> dict[str, str]:
    return {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "41",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_JOB_CPUS_PER_NODE": "4",
        **extra,
    }


def stub_cluster(tmp_path: Path) -> Path:
    """srun runs its command once as node1's task (a fresh process, the environment passed as srun does);
    scontrol knows node1; torchrun records what the step gave it."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    write_stub(
        bindir,
        "scontrol",
        """case "$1 $2 $3" in
  "show hostnames"*) echo node1 ;;
  "-o show node") echo "NodeName=node1 Arch=x86_64 NodeAddr=10.0.0.9 NodeHostName=vm" ;;
  "show node"*) echo "NodeName=$3 Arch=x86_64 NodeAddr=10.0.0.1 NodeHostName=vm" ;;
esac""",
    )
    write_stub(bindir, "srun", 'while [[ "$1" == -* ]]; do shift; done\nSLURMD_NODENAME=node1 exec "$@"')
    write_stub(bindir, "scancel", "exit 0")
    # apptainer exec [options] IMAGE CMD...: runs CMD, as the container's process would
    write_stub(
        bindir,
        "apptainer",
        f'echo "$*" > {str(tmp_path / "apptainer-args")!r}\nshift\nwhile [[ "$1" == -* ]]; do shift; done\nshift\nexec "$@"',
    )
    record = tmp_path / "step"
    write_stub(
        bindir,
        "torchrun",
        f'{{ echo "HF_HOME=$HF_HOME"; echo "PROBE=${{PROBE:-}}"; echo "CPUS=$SRUN_CPUS_PER_TASK"; '
        f'echo "TOKEN=${{HF_TOKEN:+set}}"; echo "IN=${{LLMCTL_CONTAINER:-}}"; '
        f'echo "FORCED=${{APPTAINERENV_NCCL_DEBUG:-}}"; echo "ARGS=$*"; }} > {str(record)!r}',
    )
    return bindir


def test_setup_runs_on_the_batch_host_and_again_in_each_nodes_step(tmp_path: Path) -> None:
    """Run the rendered script with stubs: each --setup line runs once here and once in the step (a fresh bash on
    the node), what it exports reaches torchrun, and the script never contains the token passed by name."""
    bindir = stub_cluster(tmp_path)
    (tmp_path / "w" / "j").mkdir(parents=True)
    counter = tmp_path / "setup-runs"
    p = params(
        workdir=str(tmp_path / "w"),
        job_dir=str(tmp_path / "w" / "j"),
        plan_path=str(tmp_path / "w" / "j" / "plan.yaml"),
        torchrun="torchrun",
        preflight=NO_PREFLIGHT,
        setup=[f"echo ran >> {counter}", "export HF_HOME=/lustre/hf", "export PROBE=on-${SLURMD_NODENAME:-batch}"],
        env_names=["HF_TOKEN"],
    )
    script = slurm.render(p)
    assert "hf_s3cr3t" not in script
    run = run_bash(script, batch_env(tmp_path, bindir, HF_TOKEN="hf_s3cr3t"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert counter.read_text().splitlines() == ["ran", "ran"]  # batch host, then node1's step
    got = dict(ln.split("=", 1) for ln in (tmp_path / "step").read_text().splitlines())
    # HF_HOME reaches the step; PROBE is node1's own value: the step ran the line again, on its node
    assert got["HF_HOME"] == "/lustre/hf" and got["PROBE"] == "on-node1"
    assert got["CPUS"] == "4" and got["TOKEN"] == "set"
    assert "--local_addr=10.0.0.1" in got["ARGS"]


def test_a_failing_setup_line_ends_the_job_with_its_exit_code(tmp_path: Path) -> None:
    bindir = stub_cluster(tmp_path)
    (tmp_path / "w" / "j").mkdir(parents=True)
    p = params(
        workdir=str(tmp_path / "w"),
        job_dir=str(tmp_path / "w" / "j"),
        plan_path=str(tmp_path / "w" / "j" / "plan.yaml"),
        setup=["export A=1", "(exit 7)"],
    )
    run = run_bash(slurm.render(p), batch_env(tmp_path, bindir))
    assert run.returncode == 7, run.stdout + run.stderr
    assert "llmctl: --setup line 2 ended with exit code 7" in run.stdout
    assert (tmp_path / "w" / "j" / "events").read_text().startswith("exit 7 ")
    assert not (tmp_path / "step").exists()  # nothing ran python: no preflight, no step


def test_a_setup_line_that_fails_on_a_node_fails_that_step(tmp_path: Path) -> None:
    """The step's copy of the lines: a line that fails there (a module missing on that node, a host-only line in a
    container) stops the step with its exit code and a line naming the node, before torchrun."""
    bindir = stub_cluster(tmp_path)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "SLURMD_NODENAME": "node7", "LLMCTL_SETUP": "export A=1\n(exit 5)"}
    run = run_bash(slurm.node_step_script(), env)
    assert run.returncode == 5 and "--setup failed on node7 (exit 5): (exit 5)" in run.stderr
    assert not (tmp_path / "step").exists()


@pytest.mark.parametrize("container", ["pyxis", "apptainer"])
def test_a_container_job_runs_its_step_with_what_the_batch_host_looked_up(tmp_path: Path, container: str) -> None:
    """The rendered container job, run with stubs (srun, apptainer exec): the step runs inside (LLMCTL_CONTAINER),
    its node address comes from the batch host's lookup (there is no scontrol in an image), the setup line that
    guards itself skips a host-only command there, and the token reaches torchrun by name."""
    bindir = stub_cluster(tmp_path)
    (tmp_path / "w" / "j").mkdir(parents=True)
    image = {"container_image": "img"} if container == "pyxis" else {"apptainer": "/img.sif"}
    p = params(
        workdir=str(tmp_path / "w"),
        job_dir=str(tmp_path / "w" / "j"),
        plan_path=str(tmp_path / "w" / "j" / "plan.yaml"),
        preflight=NO_PREFLIGHT,
        env={"NCCL_DEBUG": "INFO"},
        env_names=["HF_TOKEN"],
        setup=['[ -n "${LLMCTL_CONTAINER:-}" ] || export HF_HOME=/host-only'],
        **image,
    )
    write_stub(bindir, "python3", 'echo "llmctl 9.9"')  # the image's python, as the image check runs it
    run = run_bash(slurm.render(p), batch_env(tmp_path, bindir, HF_TOKEN="hf_x"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "llmctl: the container image runs llmctl 9.9 on every node" in run.stdout
    got = dict(ln.split("=", 1) for ln in (tmp_path / "step").read_text().splitlines())
    assert got["IN"] == container and got["TOKEN"] == "set"
    assert "--local_addr=10.0.0.9" in got["ARGS"]  # from `scontrol -o show node` on the batch host
    assert got["HF_HOME"] == "/host-only"  # the batch host ran the line; its export reached the step
    if container == "apptainer":
        assert got["FORCED"] == "INFO"
        args = (tmp_path / "apptainer-args").read_text().split()
        assert args[:3] == ["exec", "--nv", f"--bind={tmp_path}/w:{tmp_path}/w"] and "/img.sif" in args


def test_the_step_finds_its_address_without_scontrol(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    write_stub(bindir, "torchrun", f'echo "$*" > {str(tmp_path / "args")!r}')
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin",  # no scontrol
        "SLURMD_NODENAME": "node1",
        "LLMCTL_NODE_ADDRS": "node10=10.0.0.10 node1=10.0.0.1 node2=10.0.0.2 ",
        "LLMCTL_TORCHRUN": "torchrun",
    }
    run = run_bash(slurm.node_step_script(container="pyxis"), env)
    assert run.returncode == 0, run.stderr
    assert "--local_addr=10.0.0.1" in (tmp_path / "args").read_text().split()


# --- --env NAME: secrets by name only -----------------------------------------------------------------------------------
def test_a_secret_passes_by_name_and_its_value_is_never_written(workdir: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_TOKEN", "hf_by_name_s3cr3t")
    code, script, err = dry_run(*USER_COMMAND, "--env", "HF_TOKEN", "--env", "NCCL_DEBUG=WARN")
    assert code == 0, script + err
    assert "hf_by_name_s3cr3t" not in script + err
    assert 'if [ -z "${HF_TOKEN+set}" ]; then' in script and "export NCCL_DEBUG=WARN" in script
    assert "export HF_TOKEN" not in script


@pytest.mark.parametrize(
    "value, message",
    [
        ("HF_TOKEN=hf_x", "--env HF_TOKEN=...: looks like a secret"),
        ("NOT_SET_ANYWHERE", "--env NOT_SET_ANYWHERE: not set in this environment"),
        ("1BAD", "--env '1BAD'"),
    ],
)
def test_env_values_that_cannot_pass(workdir: Path, monkeypatch: pytest.MonkeyPatch, value: str, message: str):
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    r = CliRunner().invoke(app, ["launch", "plan70b.yaml", *USER_COMMAND, "--env", value])
    assert r.exit_code == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    if "secret" in message:
        assert "pass it by name: --env HF_TOKEN" in r.stderr


def test_check_env_keeps_names_apart_from_values() -> None:
    env = shell.check_env(["A=1", "HF_TOKEN", "B=x=y"], environ={"HF_TOKEN": "hf_abcd"})
    assert dict(env) == {"A": "1", "B": "x=y"} and shell.env_names(env) == ("HF_TOKEN",)
    assert shell.env_names({"A": "1"}) == ()
    with pytest.raises(InputError, match="both by name"):
        shell.check_env(["A=1", "A"], environ={"A": "2"})


def test_a_name_missing_in_the_job_stops_it_before_anything_runs(tmp_path: Path) -> None:
    bindir = stub_cluster(tmp_path)
    (tmp_path / "w" / "j").mkdir(parents=True)
    p = params(
        workdir=str(tmp_path / "w"),
        job_dir=str(tmp_path / "w" / "j"),
        plan_path=str(tmp_path / "w" / "j" / "plan.yaml"),
        env_names=["HF_TOKEN"],
    )
    run = run_bash(slurm.render(p), batch_env(tmp_path, bindir))  # submitted with --export=NONE, say
    assert run.returncode == 1 and "HF_TOKEN (--env HF_TOKEN) is not in the job's environment" in run.stderr


# --- containers ---------------------------------------------------------------------------------------------------------
def step_command(script: str) -> str:
    """The training srun, its continued lines joined, up to the step's script."""
    lines = script.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("srun "))
    out = []
    while lines[i].endswith("\\"):
        out.append(lines[i][:-1].strip())
        i += 1
    out.append(lines[i].split(" '", 1)[0].strip())
    return " ".join(out)


def test_pyxis_runs_the_step_in_the_image_with_the_job_folders_mounted(workdir: Path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_pyxis_s3cr3t")
    image = "nvcr.io#nvidia/pytorch:24.05-py3"
    args = ["--container-image", image, "--container-mounts", "/lustre:/lustre,/scratch", "--no-preflight"]
    code, script, err = dry_run(*USER_COMMAND, *args, "--env", "HF_TOKEN", "--env", "NCCL_DEBUG=INFO")
    assert code == 0, script + err
    jobs_root = workdir / "llmctl-jobs"
    words = step_command(script).split()
    assert f"'--container-image={image}'" in words
    mounts = f"--container-mounts={workdir}:{workdir},/lustre:/lustre,/scratch:/scratch"  # the job folder is inside
    assert mounts in words and f"--container-workdir={workdir}" in words
    assert "--container-env=HF_TOKEN,NCCL_DEBUG" in words  # the user's variables win over the image's
    assert words[-2:] == ["bash", "-c"]
    assert str(jobs_root) in script  # the job folder is under the mounted workdir
    lines = script.splitlines()
    assert "export LLMCTL_TORCHRUN=torchrun" in lines and "export LLMCTL_CONTAINER=pyxis" in lines
    assert any(ln.startswith("LLMCTL_NODE_ADDRS=$(scontrol -o show node") for ln in lines)  # no scontrol inside
    assert "hf_pyxis_s3cr3t" not in script + err
    assert "note:" not in err  # the container's interpreter: nothing of this machine's to warn about


def test_apptainer_execs_the_step_in_the_image(workdir: Path) -> None:
    args = ["--apptainer", "/shared/img/torch.sif", "--container-mounts", "/lustre", "--no-preflight"]
    code, script, _ = dry_run(*USER_COMMAND, *args, "--env", "NCCL_DEBUG=INFO")
    assert code == 0, script
    cmd = step_command(script)
    assert cmd.endswith(
        f"apptainer exec --nv --bind={workdir}:{workdir},/lustre:/lustre --pwd={workdir} /shared/img/torch.sif bash -c"
    ), cmd
    lines = script.splitlines()
    assert 'export APPTAINERENV_NCCL_DEBUG="$NCCL_DEBUG"  # --env NCCL_DEBUG: wins over the image\'s own value' in lines
    assert "if ! command -v apptainer >/dev/null; then" in lines
    assert "export LLMCTL_CONTAINER=apptainer" in lines


def test_a_job_folder_outside_the_workdir_is_mounted_too_and_amd_gets_rocm() -> None:
    p = params(apptainer="/img.sif", job_dir="/scratch/jobs/j1", gpu="MI300X", preflight=NO_PREFLIGHT, nproc_per_node=4)
    assert "--rocm --bind=/lustre/alice/runs:/lustre/alice/runs,/scratch/jobs/j1:/scratch/jobs/j1" in step_command(
        slurm.render(p)
    )


def test_a_job_folder_beside_the_workdir_is_mounted_as_its_own() -> None:
    """The mount list itself: a job folder inside the workdir rides on its mount; one whose path only starts with
    the workdir's name (/work/run2 beside /work/run) is another folder and gets its own."""
    opts = SlurmOptions(container_image="img", container_mounts=("/data",))
    assert slurm.container_mounts(opts, "/work/run", "/work/run/llmctl-jobs/j1") == "/work/run:/work/run,/data:/data"
    assert slurm.container_mounts(opts, "/work/run/", "/work/run/llmctl-jobs/j1") == "/work/run/:/work/run/,/data:/data"
    assert slurm.container_mounts(opts, "/work/run", "/work/run2/jobs/j1") == (
        "/work/run:/work/run,/work/run2/jobs/j1:/work/run2/jobs/j1,/data:/data"
    )


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(container_image="img", apptainer="/x.sif"), "give one container"),
        (dict(container_mounts=["/a:/a"]), "only applies with --container-image or --apptainer"),
        (dict(container_image="img", container_mounts=["data:/data"]), "'data' is not an absolute path"),
        (dict(container_image="img", container_mounts=["/a:/b:ro:x"]), "expected SRC:DST"),
        (dict(container_image="img\nrm -rf /"), "one image name or path"),
        (dict(container_image="img", workdir="/w:1"), "cannot hold ',' or ':'"),
    ],
)
def test_container_options_that_cannot_work_are_refused(kw: dict[str, object], message: str) -> None:
    with pytest.raises(InputError, match=message):
        params(preflight=NO_PREFLIGHT, **kw)


@pytest.mark.parametrize("flag, image", [("--container-image", "img"), ("--apptainer", "/shared/img.sif")])
def test_a_container_job_runs_its_preflight_without_no_preflight(workdir: Path, flag: str, image: str) -> None:
    """The preflight's agents run in the container, started with the step's container words; the image check runs
    before it, in the container too."""
    import shlex

    code, script, err = dry_run(*USER_COMMAND, flag, image)
    assert code == 0, script + err
    lines = script.splitlines()
    agent = next(ln for ln in lines if ln.startswith("export LLMCTL_PREFLIGHT_AGENT="))
    value = subprocess.run(
        ["bash", "-c", agent + '\nprintf %s "$LLMCTL_PREFLIGHT_AGENT"'], capture_output=True, text=True
    )
    words = shlex.split(value.stdout)
    bash = words.index("bash")
    assert words[bash + 1] == "-c" and words[bash + 3 :] == ["llmctl-preflight"]
    assert 'exec "$LLMCTL_PYTHON" -m llmctl.launch.preflight agent "$@"' in words[bash + 2]
    assert 'done <<<"${LLMCTL_SETUP:-}"' in words[bash + 2]  # the --setup lines first, as in the step
    if flag == "--container-image":
        assert words[:1] == ["--container-image=img"]
    else:
        assert words[:2] == ["apptainer", "exec"] and image in words[:bash]
    first_check = lines.index(next(ln for ln in lines if ln.startswith("check_out=$(srun") and "bash -c" not in ln))
    assert image in "\n".join(lines[first_check : first_check + 3])  # the image check: srun ... in the container
    assert (
        lines.index(
            "if llmctl_err=$(\"$LLMCTL_PREFLIGHT_PYTHON\" -c 'import llmctl.launch.preflight' 2>&1 </dev/null); then"
        )
        > first_check
    )


# --- the interpreter on a local disk ------------------------------------------------------------------------------------
MOUNTINFO = r"""22 1 0:21 / / rw - ext4 /dev/sda1 rw
30 22 0:40 / /home rw - nfs4 server:/home rw
31 30 0:41 / /home/alice/scratch\040space rw - lustre 10.0.0.1@o2ib:/fs rw
32 22 0:42 / /mnt/gcs rw - fuse.gcsfuse bucket rw
"""


@pytest.mark.parametrize(
    "path, fstype, shared",
    [
        ("/opt/venv/bin/torchrun", "ext4", False),
        ("/home/alice/venv/bin/torchrun", "nfs4", True),
        ("/home/alice/scratch space/venv/bin/python", "lustre", True),
        ("/mnt/gcs/venv/bin/python", "fuse.gcsfuse", True),
    ],
)
def test_the_mount_of_a_path(path: str, fstype: str, shared: bool) -> None:
    m = sharedfs.mount_of(path, MOUNTINFO)
    assert m is not None and (m.fstype, m.shared) == (fstype, shared)


def test_the_mount_that_holds_a_path_is_the_deepest_then_the_latest() -> None:
    """mount_of's answer itself: a later mount at the same point hides the earlier (an NFS mounted over a local
    folder); /home2 is not inside /home; a file system of a type neither list knows is neither shared nor local, and
    gets no note."""
    table = MOUNTINFO + (
        "40 22 0:50 / /llmctl-t/opt rw - ext4 /dev/sdb1 rw\n"
        "41 22 0:51 / /llmctl-t/opt rw - nfs server:/opt rw\n"
        "42 22 0:52 / /llmctl-t/data rw - 9p data rw\n"
    )
    assert sharedfs.mount_of("/llmctl-t/opt/venv/bin/python", table) == sharedfs.Mount("/llmctl-t/opt", "nfs")
    assert sharedfs.mount_of("/home2/venv/bin/python", table) == sharedfs.Mount("/", "ext4")
    unknown = sharedfs.mount_of("/llmctl-t/data/venv/bin/python", table)
    assert unknown == sharedfs.Mount("/llmctl-t/data", "9p") and unknown.shared is None
    paths = ["/llmctl-t/data/venv/bin/python", "/llmctl-t/opt/venv/bin/python", "/home2/venv/bin/python"]
    assert sharedfs.local_paths(paths, table) == [("/home2/venv/bin/python", sharedfs.Mount("/", "ext4"))]


def test_a_local_interpreter_gets_one_note_naming_it_and_the_fix(workdir: Path, monkeypatch) -> None:
    table = workdir / "mountinfo"
    table.write_text(MOUNTINFO)  # this machine's interpreter is on / (ext4) in that table, unless under /home
    monkeypatch.setattr(sharedfs, "MOUNTINFO", table)
    torchrun = slurm.node_python_and_torchrun()[1]
    if not os.path.isabs(torchrun) or torchrun.startswith("/home/"):
        pytest.skip(f"torchrun here ({torchrun}) is not on the fake table's local disk")
    code, script, err = dry_run(*USER_COMMAND)
    assert code == 0
    notes = [ln for ln in err.splitlines() if ln.startswith("llmctl: note:")]
    assert len(notes) == 1 and shell.quote(torchrun) in notes[0] and "ext4 at /" in notes[0], err
    assert "--setup 'source /shared/venv/bin/activate'" in notes[0] and "--container-image" in notes[0]
    assert "note:" not in script  # stdout stays the script
    subprocess.run(["bash", "-n"], input=err, text=True, check=True)  # harmless where output is fed to a shell
    # Once the environment is the nodes' own, nothing to say.
    code, _, err = dry_run(*USER_COMMAND, "--setup", "source /shared/venv/bin/activate")
    assert code == 0 and "note:" not in err
    table.write_text(MOUNTINFO.replace(" - ext4 ", " - nfs "))
    code, _, err = dry_run(*USER_COMMAND)
    assert code == 0 and "note:" not in err


def test_no_note_for_a_shared_file_system_or_a_path_the_nodes_look_up() -> None:
    fix = "fix"
    assert sharedfs.interpreter_note(["/home/alice/venv/bin/torchrun"], fix, MOUNTINFO) is None
    assert sharedfs.interpreter_note(["torchrun", "python3"], fix, MOUNTINFO) is None
    note = sharedfs.interpreter_note(["/opt/v/bin/torchrun", "/opt/v/bin/python"], fix, MOUNTINFO)
    assert note is not None and note.count("/opt/v/bin/") == 1 and "ext4 at /" in note


# --- every variant is valid bash and shellcheck-clean -------------------------------------------------------------------
VARIANTS = {
    "whole-nodes": dict(),
    "part-of-a-node": dict(nproc_per_node=2, gpus_per_node=2, cpus_per_task=30, mem="100G"),
    "cpu-ranks": dict(gpus_per_node=None, gpu=None, nproc_per_node=2),
    "setup-and-env-by-name": dict(
        setup=[*SETUP, "PROBE=$(hostname); export PROBE", ". ~/.bashrc"], env={"A": "1"}, env_names=["HF_TOKEN", "X"]
    ),
    "pyxis": dict(
        container_image="nvcr.io#nvidia/pytorch:24.05-py3",
        container_mounts=["/lustre:/lustre:ro"],
        env_names=["HF_TOKEN"],
        setup=['[ -n "${LLMCTL_CONTAINER:-}" ] || module load cuda'],
        preflight=NO_PREFLIGHT,
    ),
    "apptainer": dict(apptainer="/shared/torch.sif", env_names=["HF_TOKEN"], preflight=NO_PREFLIGHT),
    # with the checks (the token submit writes) and the preflight in the container: skipped or, with spares, stopped
    "pyxis-preflight": dict(container_image="img", shared_token="abc", setup=["module load x"]),
    "apptainer-spare-nodes": dict(apptainer="/img.sif", shared_token="abc", preflight=PreflightOptions(spare_nodes=1)),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_is_valid_bash_and_shellcheck_clean(tmp_path: Path, name: str) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text(slurm.render(params(**VARIANTS[name])))
    subprocess.run(["bash", "-n", str(script)], check=True)
    if not shutil.which("shellcheck"):
        if os.environ.get("CI") == "true":
            pytest.fail("shellcheck missing in CI (scripts/system-deps.sh installs it)")
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    out = subprocess.run(["shellcheck", "-s", "bash", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


@pytest.mark.parametrize("container", [None, "pyxis"])
def test_the_step_script_itself_is_shellcheck_clean(tmp_path: Path, container: str | None) -> None:
    """The step's script is single-quoted in the job script, where shellcheck does not read it: lint it alone."""
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck not installed")
    script = tmp_path / "step.sh"
    script.write_text("#!/bin/bash\n" + slurm.node_step_script(container=container))
    out = subprocess.run(["shellcheck", "-s", "bash", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


# --- submitit and tune carry the same job -------------------------------------------------------------------------------
def test_submitit_carries_the_same_job(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("submitit")
    monkeypatch.setenv("HF_TOKEN", "hf_submitit_s3cr3t")
    base = ["--executor", "submitit", "-t", "24:00:00", "-p", "gpu", "--dry-run"]
    r = CliRunner().invoke(app, ["launch", "plan70b.yaml", *base, "--setup", "module load cuda", "--env", "HF_TOKEN"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    for want in ("#SBATCH --exclusive", "#SBATCH --mem=0", "#SBATCH --ntasks-per-node=8", "module load cuda"):
        assert want in lines, want
    # all of a node's CPUs, split over its 8 tasks (one per rank)
    assert any(ln.startswith("SRUN_CPUS_PER_TASK=$(( $(echo") and ln.endswith("/ 8 ))") for ln in lines)
    assert 'if [ -z "${HF_TOKEN+set}" ]; then' in r.stdout and "hf_submitit_s3cr3t" not in r.output
    assert lines.index("module load cuda") < next(i for i, ln in enumerate(lines) if ln.startswith("srun "))
    part = CliRunner().invoke(app, ["launch", "plan70b.yaml", *base, "--nproc-per-node", "4"])
    assert "#SBATCH --cpus-per-task=12" in part.stdout.splitlines() and "#SBATCH --mem=768G" in part.stdout
    for flags, message in (
        (["--container-image", "img"], "the submitit executor runs this machine's Python"),
        (["--cpus-per-task", "4"], "one task per rank"),
    ):
        bad = CliRunner().invoke(app, ["launch", "plan70b.yaml", *base, "--no-preflight", *flags])
        assert bad.exit_code == 2 and message in bad.stderr, bad.output


def test_tune_gets_the_same_resources_and_setup_and_refuses_containers(tmp_path: Path) -> None:
    def tune(**kw: object) -> str:
        return slurm.render_tune(
            slurm.make_tune_params(
                job_name="tune-70b", nodes=2, workdir="/w", tune_dir="/w/t", torchrun="/v/torchrun", python="/v/python",
                gpus_per_node=4, gpu="H100-SXM", **kw,
            )
        )  # fmt: skip

    text = tune(setup=["source /shared/venv/bin/activate"])
    lines = text.splitlines()
    assert "#SBATCH --cpus-per-task=48" in lines and "#SBATCH --mem=768G" in lines
    assert "export SRUN_CPUS_PER_TASK=48" in lines
    assert lines.index("source /shared/venv/bin/activate") < lines.index("exec python3 -m llmctl.tune.job /w/t")
    script = tmp_path / "tune.sbatch"
    script.write_text(text)
    if shutil.which("shellcheck"):
        out = subprocess.run(["shellcheck", "-s", "bash", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout
    with pytest.raises(InputError, match="outside any container"):
        tune(container_image="img")
