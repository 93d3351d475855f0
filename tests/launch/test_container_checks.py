"""A container job's checks (issue 49): the job folder is shared with every node (a token written at submit), the
image runs `python -m llmctl`, and the preflight runs in the container. Without SLURM: the rendered job script is
run with stub srun/scontrol/python3 (a stub srun that runs the command as node1, without the container; one that
fails as pyxis does for a bad image), and the preflight's batch-host half with its steps stubbed."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from launch_helpers import job_env, minimal_plan_yaml, write_stub

from llmctl.launch import jobs, slurm
from llmctl.launch.preflight import host, node
from llmctl.launch.preflight.options import PreflightOptions
from llmctl.netbench.quick_files import node_result_path

TOKEN = "0123456789abcdef"
NOT_LLMCTL = "Traceback (most recent call last):\n  File ...\nModuleNotFoundError: No module named 'llmctl'\n"


def run_bash(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", code], env=env, capture_output=True, text=True, timeout=30)


# --- the node-side scripts, alone -----------------------------------------------------------------------------------
def node_env(bindir: Path, job_dir: Path, **more: str) -> dict[str, str]:
    return {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "SLURMD_NODENAME": "node2",
        "LLMCTL_JOB_DIR": str(job_dir),
        "LLMCTL_SHARED_TOKEN": TOKEN,
        "LLMCTL_PYTHON": "python3",
        **more,
    }


def test_the_shared_check_reads_the_submit_token_on_the_node(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    env = node_env(tmp_path, job)
    run = run_bash(slurm.SHARED_CHECK_SCRIPT, env)  # no marker: the node has no such folder, or another one
    assert run.returncode == 1
    assert run.stdout == (
        f"llmctl-check: shared node2: cannot read {job}/.llmctl-shared there: No such file or directory\n"
    )
    (job / slurm.SHARED_MARKER).write_text("fedcba9876543210\n")  # a folder at the same path, not this one
    run = run_bash(slurm.SHARED_CHECK_SCRIPT, env)
    assert run.returncode == 1 and "holds another token than the one written at submit" in run.stdout
    (job / slurm.SHARED_MARKER).write_text(TOKEN + "\n")
    run = run_bash(slurm.SHARED_CHECK_SCRIPT, env)
    assert (run.returncode, run.stdout, run.stderr) == (0, "", "")


def test_the_image_check_gives_the_last_line_of_what_python_said(tmp_path: Path) -> None:
    write_stub(tmp_path, "python3", f"printf %s {shlex.quote(NOT_LLMCTL)}\n\nexit 1")
    run = run_bash(slurm.image_check_script("pyxis"), node_env(tmp_path, tmp_path))
    assert run.returncode == 1
    assert run.stdout == "llmctl-check: image node2: ModuleNotFoundError: No module named 'llmctl'\n"
    write_stub(tmp_path, "python3", '[ "$*" = "-m llmctl --version" ] && echo "llmctl 9.9"')
    run = run_bash(slurm.image_check_script("pyxis"), node_env(tmp_path, tmp_path))
    assert (run.returncode, run.stdout) == (0, "llmctl-check: ok node2: llmctl 9.9\n")
    # the --setup lines run first, in the container, as the step runs them (a conda activate, a PATH)
    (tmp_path / "img").mkdir()
    write_stub(tmp_path / "img", "python3", 'echo "llmctl 1.0"')
    env = node_env(tmp_path, tmp_path, LLMCTL_SETUP=f"export PATH={tmp_path / 'img'}:$PATH")
    assert run_bash(slurm.image_check_script("apptainer"), env).stdout == "llmctl-check: ok node2: llmctl 1.0\n"


# --- the job script, run with stubs ---------------------------------------------------------------------------------
PYXIS_FAILS = """for a in "$@"; do
  if [[ "$a" == --container-image=* ]]; then
    echo "pyxis: importing docker image: ${a#*=}" >&2
    echo "pyxis: failed to import docker image" >&2
    echo "pyxis:     [ERROR] URL https://registry/v2/x/manifests/24.05 returned error code: 404 Not Found" >&2
    echo "pyxis: couldn't start container" >&2
    echo "srun: error: node1: task 0: Exited with exit code 1" >&2
    exit 1
  fi
done
"""


def cluster(tmp_path: Path, srun_first: str = "") -> Path:
    """srun runs its command once as node1's task, without any container words (the image's python3 is a stub
    on PATH); scontrol knows node1; torchrun records that the step ran."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    write_stub(
        bindir,
        "scontrol",
        """case "$1 $2 $3" in
  "show hostnames"*) echo node1 ;;
  "-o show node"*) echo "NodeName=node1 Arch=x86_64 NodeAddr=10.0.0.9 NodeHostName=vm" ;;
  "show node"*) echo "NodeName=$3 Arch=x86_64 NodeAddr=10.0.0.1 NodeHostName=vm" ;;
esac""",
    )
    write_stub(
        bindir,
        "srun",
        srun_first
        + """while [[ "$1" == -* ]]; do shift; done
if [ "$1" = apptainer ]; then shift 2; while [[ "$1" == -* ]]; do shift; done; shift; fi
SLURMD_NODENAME=node1 exec "$@\"""",
    )
    write_stub(bindir, "apptainer", "exit 0")  # the batch host's `command -v apptainer`
    write_stub(bindir, "scancel", "exit 0")
    write_stub(bindir, "python3", 'echo "llmctl 9.9"')
    write_stub(bindir, "torchrun", f"touch {str(tmp_path / 'TRAINED')!r}")
    return bindir


def job(tmp_path: Path, token: str | None = TOKEN, **kw: object) -> tuple[str, Path]:
    """The script of a 1-node CPU job whose folder is tmp_path/w/j (with the marker written at submit unless token
    is None), and that folder."""
    job_dir = tmp_path / "w" / "j"
    job_dir.mkdir(parents=True)
    if token is not None:
        (job_dir / slurm.SHARED_MARKER).write_text(token + "\n")
    base: dict[str, object] = dict(
        job_name="t",
        nodes=1,
        nproc_per_node=1,
        workdir=str(tmp_path / "w"),
        job_dir=str(job_dir),
        plan_path=str(job_dir / "plan.yaml"),
        torchrun="torchrun",
        shared_token=TOKEN,
        preflight=PreflightOptions(enabled=False),
    )
    base.update(kw)
    return slurm.render(slurm.make_params(**base)), job_dir  # type: ignore[arg-type]


def run_job(script: str, bindir: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "41",
        "SLURM_JOB_NODELIST": "node1",
    }
    return run_bash(script, env)


def status_note(job_dir: Path) -> str:
    """What `llmctl status` shows in its preflight column for the job."""
    return jobs.preflight_note(SimpleNamespace(folder=str(job_dir)))  # type: ignore[arg-type]


@pytest.mark.parametrize("container", [None, "pyxis", "apptainer"])
def test_a_job_folder_the_node_does_not_share_ends_the_job_in_one_line(tmp_path: Path, container: str | None) -> None:
    image = {"pyxis": {"container_image": "img"}, "apptainer": {"apptainer": "/img.sif"}}.get(container or "", {})
    script, job_dir = job(tmp_path, token=None, **image)  # the node reads no marker: the folder is not there
    run = run_job(script, cluster(tmp_path), tmp_path)
    assert run.returncode == slurm.SHARED_CHECK_EXIT == 4, run.stdout + run.stderr
    line = (
        f"llmctl: the job folder {job_dir} is not shared with node node1 (cannot read {job_dir}/.llmctl-shared "
        "there: No such file or directory)"
    )
    assert line in run.stderr.splitlines()
    assert not (tmp_path / "TRAINED").exists()
    events = (job_dir / "events").read_text().splitlines()
    assert events[0].startswith("preflight failed ") and events[1].startswith("exit 4 ")
    assert status_note(job_dir) == "failed: " + line.removeprefix("llmctl: ")


def test_a_job_folder_every_node_shares_passes_and_the_job_trains(tmp_path: Path) -> None:
    script, job_dir = job(tmp_path)
    run = run_job(script, cluster(tmp_path), tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "TRAINED").exists() and "not shared" not in run.stderr
    # another job's marker at the same path: not this job's folder
    other, job_dir = job(tmp_path / "other", token="ffff")
    run = run_job(other, cluster(tmp_path / "other"), tmp_path / "other")
    assert run.returncode == 4 and "holds another token than the one written at submit" in run.stderr


def test_without_a_token_the_script_has_no_check(tmp_path: Path) -> None:
    """A script rendered for no job folder (the API's default) checks nothing; every submitted one has a token."""
    script, _ = job(tmp_path, shared_token="")
    assert slurm.SHARED_MARKER not in script and "check_out=" not in script


@pytest.mark.parametrize("container", ["pyxis", "apptainer"])
def test_an_image_without_llmctl_ends_the_job_in_one_line(tmp_path: Path, container: str) -> None:
    image = {"container_image": "nvcr.io#nvidia/pytorch:24.05-py3"} if container == "pyxis" else {"apptainer": "/i.sif"}
    name = next(iter(image.values()))
    script, job_dir = job(tmp_path, **image)
    bindir = cluster(tmp_path)
    write_stub(bindir, "python3", f"printf %s {shlex.quote(NOT_LLMCTL)}\nexit 1")
    run = run_job(script, bindir, tmp_path)
    assert run.returncode == slurm.IMAGE_CHECK_EXIT == 5, run.stdout + run.stderr
    line = f"llmctl: the container image {name} cannot run `python -m llmctl`: ModuleNotFoundError: No module named 'llmctl' (node node1)"
    assert line in run.stderr.splitlines()
    assert not (tmp_path / "TRAINED").exists()
    assert status_note(job_dir).startswith(f"failed: the container image {name} cannot run")
    assert (job_dir / "events").read_text().splitlines()[-1].startswith("exit 5 ")


def test_an_image_pyxis_cannot_start_gives_its_error_line(tmp_path: Path) -> None:
    """pyxis fails before any task runs: the line is the last one of its output that says error (not srun's own)."""
    script, job_dir = job(tmp_path, container_image="nvcr.io#x:24.05")
    run = run_job(script, cluster(tmp_path, srun_first=PYXIS_FAILS), tmp_path)
    assert run.returncode == 5, run.stdout + run.stderr
    assert run.stderr.splitlines()[-1] == (
        "llmctl: the container image nvcr.io#x:24.05 cannot run `python -m llmctl`: pyxis:     [ERROR] URL "
        "https://registry/v2/x/manifests/24.05 returned error code: 404 Not Found"
    )
    assert not (tmp_path / "TRAINED").exists()


def test_a_good_image_says_its_llmctl_and_trains(tmp_path: Path) -> None:
    script, _ = job(tmp_path, container_image="img")
    run = run_job(script, cluster(tmp_path), tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "llmctl: the container image runs llmctl 9.9 on every node" in run.stdout
    assert (tmp_path / "TRAINED").exists()


# --- the preflight of a container job -------------------------------------------------------------------------------
def host_python(bindir: Path, tmp_path: Path, importable: bool) -> Path:
    """The Python llmctl was launched with, on the batch host: records the agent command the job gives it."""
    record = tmp_path / "agent"
    body = f"""if [ "$1" = -c ]; then {"exit 0" if importable else 'echo "No module named llmctl" >&2; exit 1'}; fi
printf %s "$LLMCTL_PREFLIGHT_AGENT" > {str(record)!r}
echo node1"""
    return write_stub(bindir, "hostpython", body)


def test_a_container_jobs_preflight_runs_with_the_launch_python_and_agents_in_the_container(tmp_path: Path) -> None:
    bindir = cluster(tmp_path)
    python = host_python(bindir, tmp_path, importable=True)
    script, job_dir = job(tmp_path, container_image="img", python=str(python), preflight=PreflightOptions())
    run = run_job(script, bindir, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    words = shlex.split((tmp_path / "agent").read_text())
    assert words[:3] == [
        "--container-image=img",
        f"--container-mounts={tmp_path}/w:{tmp_path}/w",
        f"--container-workdir={tmp_path}/w",
    ]
    assert words[3:5] == ["bash", "-c"] and words[6:] == ["llmctl-preflight"]
    assert (tmp_path / "TRAINED").exists()


@pytest.mark.parametrize("spare", [0, 1])
def test_a_batch_host_without_llmctl_skips_the_preflight_or_stops_when_it_is_needed(tmp_path: Path, spare: int) -> None:
    bindir = cluster(tmp_path)
    python = host_python(bindir, tmp_path, importable=False)
    preflight = PreflightOptions(spare_nodes=spare)
    script, job_dir = job(tmp_path, container_image="img", python=str(python), preflight=preflight)
    run = run_job(script, bindir, tmp_path)
    why = f"the batch host's {python} cannot import llmctl: No module named llmctl"
    if spare:
        assert run.returncode == 1, run.stdout + run.stderr
        assert (
            f"llmctl: preflight failed: {why} (--spare-nodes and --preflight-strict need the preflight)" in run.stderr
        )
        assert not (tmp_path / "TRAINED").exists()
        assert status_note(job_dir) == f"failed: {why}"
    else:
        assert run.returncode == 0, run.stdout + run.stderr
        assert f"llmctl: preflight skipped: {why}; training on every node unchecked" in run.stderr
        assert (tmp_path / "TRAINED").exists()
        assert status_note(job_dir) == f"warning: skipped: {why}"
    assert not (tmp_path / "agent").exists()  # the preflight itself never ran


def test_the_batch_host_starts_its_agents_with_the_container_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "plan.yaml").write_text(minimal_plan_yaml(nodes=2, nproc=1))
    steps: list[list[str]] = []
    crosses: list[list[str]] = []

    def run_step(argv: list[str], timeout_s: float, env: dict[str, str]) -> int:
        steps.append(argv)
        for n in ("node1", "node2"):
            check = {"node": n, "ok": True, "device": "cpu", "ranks": 1, "seconds": 0.1}
            node_result_path(tmp_path / "preflight" / "42.0", n).write_text(json.dumps(check))
        return 0

    def cross(ctx, out, nodes, timeout_s, agent, worker_args, env):  # noqa: ANN001, ANN202
        crosses.append(agent)
        return None, None

    monkeypatch.setattr(jobs, "hostnames", lambda nodelist: ["node1", "node2"])
    monkeypatch.setattr(host, "_run_step", run_step)
    monkeypatch.setattr(host, "_cross", cross)
    agent = ["--container-image=img", "bash", "-c", 'exec python3 -m llmctl.launch.preflight agent "$@"', "x"]
    d = host.run(env=job_env(tmp_path, LLMCTL_PREFLIGHT_AGENT=shlex.join(agent)))
    assert d.ok
    [step] = steps
    assert step[6 : 6 + len(agent)] == agent and step[6 + len(agent)] == "node"
    assert crosses == [agent]
    # without a container: this Python's agent
    assert host.agent_command({}) == [sys.executable, "-m", "llmctl.launch.preflight", "agent"]


def test_the_cross_steps_agent_finds_its_address_without_scontrol(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs, "node_addr", lambda n: None)  # an image without scontrol
    env = {"SLURMD_NODENAME": "node1", "LLMCTL_NODE_ADDRS": "node10=10.0.0.10 node1=10.0.0.1 ", "LLMCTL_TORCHRUN": "t"}
    argv = ["--nnodes", "2", "--rdzv-node", "node1", "--rdzv-endpoint", "10.0.0.1:31542", "--join-timeout-s", "60"]
    command = node.cross_command(argv, env)
    assert "--local_addr=10.0.0.1" in command and "--rdzv_conf=is_host=1,join_timeout=60" in command
    assert node.own_addr("node2", env) is None


# --- submit writes the marker ---------------------------------------------------------------------------------------
def test_submit_writes_the_token_the_script_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from launch_helpers import TINY_PLAN
    from typer.testing import CliRunner

    from llmctl.cli.main import app

    bindir = tmp_path / "bin"
    bindir.mkdir()
    write_stub(bindir, "sbatch", 'echo "77;c"')
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LLMCTL_JOBS_DIR", raising=False)
    args = ["launch", str(TINY_PLAN), "--slurm", "--container-image", "img", "--jobs-dir", str(tmp_path / "jobs")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    [folder] = (tmp_path / "jobs").iterdir()
    token = (folder / slurm.SHARED_MARKER).read_text().strip()
    assert len(token) == 32 and f"export LLMCTL_SHARED_TOKEN={token}\n" in (folder / "job.sbatch").read_text()
    r2 = CliRunner().invoke(app, args)  # each job its own
    assert r2.exit_code == 0, r2.output
    tokens = {(f / slurm.SHARED_MARKER).read_text() for f in (tmp_path / "jobs").iterdir()}
    assert len(tokens) == 2
    dry = CliRunner().invoke(app, [*args, "--dry-run"])
    assert f"export LLMCTL_SHARED_TOKEN={slurm.DRY_RUN_TOKEN}\n" in dry.stdout


def test_a_local_launch_python_gets_a_note_when_the_preflight_needs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from launch_helpers import TINY_PLAN
    from typer.testing import CliRunner

    from llmctl.cli.main import app
    from llmctl.launch import sharedfs

    table = tmp_path / "mountinfo"
    table.write_text("22 1 0:21 / / rw - ext4 /dev/sda1 rw\n")
    monkeypatch.setattr(sharedfs, "MOUNTINFO", table)
    monkeypatch.setattr(slurm, "node_python_and_torchrun", lambda: ("/opt/v/bin/python", "/opt/v/bin/torchrun"))
    monkeypatch.chdir(tmp_path)
    args = ["launch", str(TINY_PLAN), "--slurm", "--dry-run", "--container-image", "img"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    [note] = [ln for ln in r.stderr.splitlines() if ln.startswith("llmctl: note:")]
    assert "/opt/v/bin/python" in note and "skips the preflight" in note
    assert "export LLMCTL_PREFLIGHT_PYTHON=/opt/v/bin/python" in r.stdout
    r = CliRunner().invoke(app, [*args, "--no-preflight"])
    assert r.exit_code == 0 and "note:" not in r.stderr and "LLMCTL_PREFLIGHT_PYTHON" not in r.stdout


@pytest.mark.parametrize("container", ["pyxis", "apptainer"])
def test_the_agent_command_runs_the_setup_lines_then_the_containers_python(tmp_path: Path, container: str) -> None:
    """LLMCTL_PREFLIGHT_AGENT as the script exports it, split as host.agent_command splits it, run as srun would
    run it once the container has started (the words before `bash` are the container's): the --setup lines, then
    `python -m llmctl.launch.preflight agent` with the step's own arguments, byte for byte."""
    image = {"container_image": "img"} if container == "pyxis" else {"apptainer": "/img.sif"}
    script, _ = job(tmp_path, preflight=PreflightOptions(), setup=["export PROBE=in-$LLMCTL_CONTAINER"], **image)
    [line] = [ln for ln in script.splitlines() if ln.startswith("export LLMCTL_PREFLIGHT_AGENT=")]
    value = run_bash(line + '\nprintf %s "$LLMCTL_PREFLIGHT_AGENT"', {"PATH": "/usr/bin:/bin"}).stdout
    words = host.agent_command({host.AGENT_ENV: value})
    inside = words[words.index("bash") :]
    record = tmp_path / "args"
    python = write_stub(tmp_path, "python3", f'printf "%s\\0" "$PROBE" "$@" > {str(record)!r}')
    step_args = ["node", "--", "--out", str(tmp_path / "a b'c"), "--expect-gpus", "0"]
    env = {
        "PATH": "/usr/bin:/bin",
        "LLMCTL_PYTHON": str(python),
        "LLMCTL_SETUP": "export PROBE=in-$LLMCTL_CONTAINER",
        "SLURMD_NODENAME": "node1",
    }
    run = subprocess.run([*inside, *step_args], env=env, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    got = record.read_text().split("\0")[:-1]
    assert got == [f"in-{container}", "-m", "llmctl.launch.preflight", "agent", *step_args]


def test_a_token_is_one_plain_word() -> None:
    from llmctl.errors import InputError

    with pytest.raises(InputError, match="shared_token"):
        job_params = dict(job_name="t", nodes=1, nproc_per_node=1, workdir="/w", job_dir="/w/j", plan_path="/w/p")
        slurm.make_params(torchrun="torchrun", shared_token="a'b $(x)", **job_params)  # type: ignore[arg-type]
