"""`llmctl launch/status/logs` through the CLI, without a real SLURM: stub sbatch/squeue on PATH, a stub torchrun
for exit codes, and one real local torchrun run of the engine."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import HOSTILE, REPO, TINY_PLAN, minimal_plan_yaml, pwned, write_stub
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.launch import local

SECRETS = {
    "HF_TOKEN": "hf_s3cr3t_value_1",
    "WANDB_API_KEY": "wandb_s3cr3t_2",
    "DB_PASSWORD": "pw_s3cr3t_3",
    "MY_SERVICE_SECRET": "svc_s3cr3t_4",
}


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LLMCTL_JOBS_DIR", raising=False)
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    return tmp_path


@pytest.fixture
def fake_slurm(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """sbatch prints a job id; squeue/sacct/scontrol know nothing (so status falls back to the job folder)."""
    bindir = workdir / "fakebin"
    bindir.mkdir()
    write_stub(bindir, "sbatch", f'echo "$PWD" > {str(workdir / "sbatch-cwd")!r}; echo "123;cluster"')
    for name in ("squeue", "sacct", "scontrol"):
        write_stub(bindir, name, "exit 1")
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return bindir


def plan_file(folder: Path, name: str = "plan.yaml", **kw: object) -> Path:
    p = folder / name
    p.write_text(minimal_plan_yaml(**kw))  # type: ignore[arg-type]
    return p


def test_local_dry_run_prints_exact_quoted_command(workdir: Path) -> None:
    plan = plan_file(workdir, name=f"my plan {HOSTILE}.yaml")
    code, out = invoke("launch", str(plan), "--dry-run")
    assert code == 0, out
    argv = shlex.split(out.strip())
    assert argv == local.torchrun_argv(plan, 2)
    assert argv[1:5] == ["--standalone", "--nnodes=1", "--nproc_per_node=2", "--module"]
    assert not pwned(workdir)


def test_local_dry_run_quotes_the_environment_it_prints(workdir: Path) -> None:
    """--env values in the printed command are shell words: a value with spaces and $(...) reads back as itself."""
    plan = plan_file(workdir)
    value = f"a b $(touch {workdir}/pwned)"
    code, out = invoke("launch", str(plan), "--env", f"NCCL_DEBUG_SUBSYS={value}", "--dry-run")
    assert code == 0, out
    words = shlex.split(out.strip())
    assert words[0] == f"NCCL_DEBUG_SUBSYS={value}" and words[1:] == local.torchrun_argv(plan, 2)
    assert not pwned(workdir)


def test_local_nproc_override_runs_a_copy_and_keeps_the_plan(workdir: Path) -> None:
    plan = plan_file(workdir)
    before = plan.read_bytes()
    code, out = invoke("launch", str(plan), "--nproc-per-node", "1", "--dry-run")
    assert code == 0 and "--nproc_per_node=1" in out
    assert plan.read_bytes() == before


def test_local_exit_code_is_propagated(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "torchrun_command", lambda: [sys.executable, "-c", "import sys; sys.exit(3)"])
    code, out = invoke("launch", str(plan_file(workdir)))
    assert code == 3
    folder = next((workdir / "llmctl-jobs").iterdir())
    job_id = json.loads((folder / "job.json").read_text())["job_id"]
    assert out.strip().splitlines()[-1] == (
        f"llmctl: error: the run exited with code 3 (its output: {folder}/console.log, or `llmctl logs {job_id}`)"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--partition", "gpu"], "--partition only apply with --slurm"),
        (["--nproc-per-node", "two"], "--nproc-per-node 'two'"),
        (["--executor", "pbs"], "--executor 'pbs'"),
        (["--slurm", "--time", "soon"], "--time 'soon'"),
        (["--slurm", "--partition", "a;reboot"], "--partition 'a;reboot'"),
        (["--slurm", "--time", "3", "--signal-lead", "300"], "--time 3"),
        (["--slurm", "--env", "HF_TOKEN=abc"], "--env HF_TOKEN"),
        (["--slurm", "--env", f"HARMLESS={SECRETS['WANDB_API_KEY']}"], "--env HARMLESS"),
        (["--slurm", "--sbatch-arg", "--mem=1G\ntouch PWNED"], "--sbatch-arg"),
    ],
)
def test_bad_options_one_line_exit_2_nothing_written(workdir: Path, args: list[str], message: str) -> None:
    plan = plan_file(workdir)
    code, out = invoke("launch", str(plan), *args)
    assert code == 2, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmctl: error: ") and message in lines[0], out
    assert not (workdir / "llmctl-jobs").exists()
    assert not pwned(workdir)


def test_multi_node_plan_needs_slurm_locally(workdir: Path) -> None:
    code, out = invoke("launch", str(plan_file(workdir, nodes=2)))
    assert code == 2 and "add --slurm" in out


@pytest.mark.parametrize(
    "content, message",
    [(None, "no such plan file"), ("model: [", "not valid YAML"), ("version: 1\nmodel: {preset: x}\n", "training")],
)
def test_bad_plan_one_line(workdir: Path, content: str | None, message: str) -> None:
    p = workdir / "bad.yaml"
    if content is not None:
        p.write_text(content)
    code, out = invoke("launch", str(p), "--slurm")
    assert code == 2 and message in out and len(out.strip().splitlines()) == 1, out


def test_slurm_dry_run_prints_valid_script_without_secrets(workdir: Path) -> None:
    code, out = invoke(
        "launch",
        str(plan_file(workdir, nodes=2)),
        "--slurm",
        "--partition",
        "debug",
        "--nccl-debug",
        "INFO",
        "--dry-run",
    )
    assert code == 0, out
    assert "#SBATCH --nodes=2" in out and "#SBATCH --partition=debug" in out and "export NCCL_DEBUG=INFO" in out
    assert "GLOO_SOCKET_IFNAME" not in out  # network settings only when asked
    subprocess.run(["bash", "-n"], input=out, text=True, check=True)
    assert not any(v in out for v in SECRETS.values())
    assert not (workdir / "llmctl-jobs").exists()


def test_slurm_submit_writes_job_folder(workdir: Path, fake_slurm: Path) -> None:
    plan = plan_file(workdir, name="p.yaml", nodes=2)
    before = plan.read_bytes()
    code, out = invoke("launch", str(plan), "--slurm", "--time", "1:00:00", "--socket-ifname", "eth0")
    assert code == 0, out
    assert "submitted job 123" in out
    folder = next((workdir / "llmctl-jobs").iterdir())
    assert f"job folder: {folder}" in out and f"log: {folder}/slurm-123.out" in out
    assert sorted(p.name for p in folder.iterdir()) == [".llmctl-shared", "job.json", "job.sbatch", "plan.yaml"]
    assert (workdir / "sbatch-cwd").read_text().strip() == str(folder)  # logs land in the job folder
    script = (folder / "job.sbatch").read_text()
    assert f"export LLMCTL_PLAN={folder}/plan.yaml" in script and "export GLOO_SOCKET_IFNAME=eth0" in script
    assert plan.read_bytes() == before
    for f in folder.iterdir():
        text = f.read_text()
        assert not any(v in text for v in SECRETS.values()), f"secret written into {f.name}"
    # status and logs fall back to the folder when SLURM knows nothing about the job.
    code, out = invoke("status")
    assert code == 0 and "123" in out and "UNKNOWN" in out
    (folder / "events").write_text("exit 0 2026-01-01T00:00:00Z restart 0\n")
    (folder / "slurm-123.out").write_text("step 3/3 loss 1.0\n")
    code, out = invoke("status", "123")
    assert code == 0 and "COMPLETED" in out
    code, out = invoke("logs", "123")
    assert code == 0 and out == "step 3/3 loss 1.0\n"
    code, out = invoke("logs", "123", "--follow")  # the job is over: prints and returns
    assert code == 0 and out == "step 3/3 loss 1.0\n"


def test_slurm_submit_hostile_names_and_paths(workdir: Path, fake_slurm: Path) -> None:
    """A hostile plan name, plan path, jobs dir and cwd: the job script stays valid and runs nothing extra. (A plan
    name with a line break is refused when the plan is read: tests/launch/test_injection.py.)"""
    hostile_dir = workdir / HOSTILE
    hostile_dir.mkdir()
    os.chdir(hostile_dir)
    # The plan's relative paths resolve against its folder, and a plan's paths are one line: a plan in the hostile
    # folder (a line break in its name) is refused in one line; the same plan file name beside it runs.
    refused = hostile_dir / f"plan {HOSTILE}.yaml"
    refused.write_text(minimal_plan_yaml(name=HOSTILE.replace("\n", " "), nodes=2))
    code, out = invoke("launch", str(refused), "--slurm", "--jobs-dir", str(hostile_dir / f"jobs {HOSTILE}"))
    assert code == 2 and len(out.strip().splitlines()) == 1 and "checkpoint.dir: 'checkpoints' resolves" in out, out
    plan = workdir / f"plan {HOSTILE}.yaml"
    plan.write_text(minimal_plan_yaml(name=HOSTILE.replace("\n", " "), nodes=2))
    code, out = invoke("launch", str(plan), "--slurm", "--jobs-dir", str(hostile_dir / f"jobs {HOSTILE}"))
    assert code == 0, out
    folder = next((hostile_dir / f"jobs {HOSTILE}").iterdir())
    script = folder / "job.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert not pwned(workdir)


def test_sbatch_failure_is_one_line(workdir: Path, fake_slurm: Path) -> None:
    write_stub(fake_slurm, "sbatch", 'echo "sbatch: error: invalid partition specified: nope" >&2; exit 1')
    code, out = invoke("launch", str(plan_file(workdir)), "--slurm", "-p", "nope")
    assert code == 1
    assert (
        out.strip().splitlines() == [out.strip().splitlines()[0]]
        and "sbatch failed: sbatch: error: invalid partition specified: nope" in out
    )


def test_status_unknown_job(workdir: Path) -> None:
    code, out = invoke("logs", "999")
    assert code == 2 and "no job '999'" in out


def test_cli_module_does_not_import_torch() -> None:
    code = "import sys, llmctl.cli.main, llmctl.launch.slurm, llmctl.launch.jobs; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.dist
def test_local_launch_runs_the_engine(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real torchrun of the engine on 2 CPU processes: output streams through, exit 0, metrics written."""
    if not (REPO / "llmctl" / "engine" / "__main__.py").is_file() or not TINY_PLAN.is_file():
        pytest.skip("the engine or examples/tiny-cpu.yaml is not there yet")
    import yaml

    monkeypatch.setenv("TMPDIR", str(workdir))
    plan = yaml.safe_load(TINY_PLAN.read_text())
    plan["training"]["max_steps"] = 4
    plan["data"]["paths"] = [str(TINY_PLAN.parent / p) for p in plan["data"]["paths"]]  # relative to the plan
    plan["checkpoint"]["dir"] = None
    plan["logging"] = {"dir": str(workdir / "run"), "interval_steps": 2}
    (workdir / "plan.yaml").write_text(yaml.safe_dump(plan))
    env = {k: v for k, v in os.environ.items() if k not in SECRETS}
    run = subprocess.run(
        [sys.executable, "-m", "llmctl", "launch", "plan.yaml", "--allow-no-checkpoint"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "--standalone" in run.stderr and "step 4/4" in run.stdout + run.stderr
    assert (workdir / "run" / "metrics.jsonl").is_file()


def test_submitit_hostile_paths(workdir: Path, fake_slurm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """submitit quotes #SBATCH values, but a line break would still escape the comment: such a jobs dir is
    refused; other hostile characters go through, and running submitit's script executes nothing extra."""
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR1")  # restored after the test
    write_stub(fake_slurm, "sbatch", 'echo "Submitted batch job 123"')
    write_stub(fake_slurm, "srun", "exit 0")
    plan = plan_file(workdir, nodes=2)
    code, out = invoke("launch", str(plan), "--executor", "submitit", "--jobs-dir", str(workdir / "a\nb"))
    assert code == 2 and "line breaks" in out and not (workdir / "a\nb").exists()
    code, out = invoke("launch", str(plan), "--executor", "submitit", "--jobs-dir", str(workdir / "jobs-%j"))
    assert code == 2 and "%" in out
    hostile = HOSTILE.replace("\n", " ").replace("%", "")
    code, out = invoke("launch", str(plan), "--executor", "submitit", "--jobs-dir", str(workdir / hostile))
    assert code == 0, out
    assert "submitted job 123 (submitit, 2 nodes x 2 processes)" in out
    script = next((workdir / hostile).glob("*/submitit/*_submission.sh"))
    text = script.read_text()
    assert "#SBATCH --signal=USR1@300" in text and "#SBATCH --ntasks-per-node=2" in text
    subprocess.run(
        ["bash", str(script)], cwd=workdir, env={**os.environ, "SLURM_JOB_ID": "123"}, check=True, capture_output=True
    )
    assert not pwned(workdir)


def test_resize_that_breaks_the_plan_is_refused(workdir: Path) -> None:
    plan = workdir / "hybrid.yaml"
    plan.write_text(minimal_plan_yaml(nodes=2, nproc=4) + "parallel:\n  sharding: hybrid\n  shard_size: 4\n")
    code, out = invoke("launch", str(plan), "--slurm", "--nproc-per-node", "3", "--dry-run")
    assert code == 2 and "a shard group of 4 does not divide the 6 data-parallel ranks" in out, out


def test_submitit_dry_run_prints_submitits_script(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR1")
    code, out = invoke(
        "launch", str(plan_file(workdir, nodes=2)), "--executor", "submitit", "-t", "1:00:00", "--dry-run"
    )
    assert code == 0, out
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --signal=USR1@300",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --time=60",
    ):
        assert line in out.splitlines(), line
    subprocess.run(["bash", "-n"], input=out, text=True, check=True)
    assert not (workdir / "llmctl-jobs").exists()
