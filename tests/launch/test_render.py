"""The sbatch renderer: golden file, bash -n, shellcheck, and hostile values that must not inject commands."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from launch_helpers import HOSTILE, pwned, write_stub

import llmctl
from llmctl.errors import InputError
from llmctl.launch import slurm
from llmctl.launch.preflight.options import PreflightOptions

GOLDEN = Path(__file__).parent / "golden"


def golden_params(**kw: object) -> slurm.SbatchParams:
    values: dict[str, object] = dict(
        job_name="llama2-7b-fsdp",
        nodes=2,
        nproc_per_node=4,
        workdir="/home/alice/runs",
        job_dir="/home/alice/runs/llmctl-jobs/20260101-000000-llama2-7b-fsdp-abcd",
        plan_path="/home/alice/runs/llmctl-jobs/20260101-000000-llama2-7b-fsdp-abcd/plan.yaml",
        torchrun="/opt/venv/bin/torchrun",
        python="/opt/venv/bin/python",
        gpus_per_node=4,
        time="2-00:00:00",
        partition="gpu",
        account="ml-team",
        qos="high",
        constraint="a100&80gb",
        exclude="gpu[03,07]",
        gpu="A100-80GB",
        exclusive=True,  # 4 of an 8-GPU node, taken whole
        extra_sbatch_args=["--mail-type=END"],
        env={"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "ib0"},
        signal_lead_s=300,
        preflight=PreflightOptions(spare_nodes=1, strict=True),
        shared_token="0123456789abcdef0123456789abcdef",
    )
    values.update(kw)
    return slurm.make_params(**values)  # type: ignore[arg-type]


def no_preflight_params() -> slurm.SbatchParams:
    return slurm.make_params(
        job_name="tiny-cpu",
        nodes=2,
        nproc_per_node=1,
        workdir="/w",
        job_dir="/w/j",
        plan_path="/w/j/plan.yaml",
        torchrun="torchrun",
        preflight=PreflightOptions(enabled=False),
    )


def check_golden(name: str, text: str) -> None:
    # The version line would change the golden file on every release; pin it.
    text = text.replace(f"llmctl {llmctl.__version__} ", "llmctl VERSION ", 1)
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; UPDATE_GOLDEN=1 rewrites it after review"


def test_render_matches_golden() -> None:
    check_golden("slurm-2x4-a100.sbatch", slurm.render(golden_params()))


def test_render_minimal_matches_golden() -> None:
    params = slurm.make_params(
        job_name="tiny-cpu",
        nodes=2,
        nproc_per_node=1,
        workdir="/w",
        job_dir="/w/j",
        plan_path="/w/j/plan.yaml",
        torchrun="torchrun",
    )
    check_golden("slurm-minimal.sbatch", slurm.render(params))


def test_render_without_preflight_matches_golden() -> None:
    check_golden("slurm-no-preflight.sbatch", slurm.render(no_preflight_params()))


def pyxis_70b_params() -> slurm.SbatchParams:
    """The user's 70B job (8 nodes x 8 H100) in a pyxis container, with --setup lines and a token by name."""
    return slurm.make_params(
        job_name="llama-3.1-70b-8x8-h100",
        nodes=8,
        nproc_per_node=8,
        workdir="/lustre/alice/runs",
        job_dir="/lustre/alice/runs/llmctl-jobs/20260101-000000-llama-3.1-70b-8x8-h100-abcd",
        plan_path="/lustre/alice/runs/llmctl-jobs/20260101-000000-llama-3.1-70b-8x8-h100-abcd/plan.yaml",
        torchrun="/home/alice/.venv/bin/torchrun",
        python="/home/alice/.venv/bin/python",
        gpus_per_node=8,
        gpu="H100-SXM",
        time="24:00:00",
        partition="gpu",
        account="myproj",
        env={"NCCL_DEBUG": "WARN"},
        env_names=["HF_TOKEN"],
        setup=["export HF_HOME=/lustre/alice/hf", '[ -n "${LLMCTL_CONTAINER:-}" ] || module load cuda/12.4'],
        container_image="nvcr.io#nvidia/pytorch:24.05-py3",
        container_mounts=["/lustre:/lustre"],
        shared_token="0123456789abcdef0123456789abcdef",
    )


def test_render_70b_pyxis_matches_golden() -> None:
    check_golden("slurm-8x8-h100-pyxis.sbatch", slurm.render(pyxis_70b_params()))


def test_sbatch_args_of_the_resource_options_render_as_the_options() -> None:
    """Scripts written before --exclusive/--mem/--cpus-per-task existed passed them as --sbatch-arg: the same
    job, each line once."""
    old = golden_params(exclusive=None, extra_sbatch_args=["--mem=0", "--exclusive", "--mail-type=END"])
    assert slurm.render(old) == slurm.render(golden_params(mem="0"))
    partial = golden_params(exclusive=None, extra_sbatch_args=["-c 20", "--mem=100G"])
    lines = [ln for ln in slurm.render(partial).splitlines() if ln.startswith("#SBATCH")]
    assert "#SBATCH --cpus-per-task=20" in lines and "#SBATCH --mem=100G" in lines and "#SBATCH -c 20" not in lines


def test_render_is_pure() -> None:
    assert slurm.render(golden_params()) == slurm.render(golden_params())


def test_strict_undefined() -> None:
    import jinja2

    with pytest.raises(jinja2.UndefinedError):
        slurm.render(golden_params(), template="{{ not_a_param }}")


def hostile_script(tmp_path: Path) -> tuple[str, Path]:
    workdir = tmp_path / HOSTILE
    workdir.mkdir()
    job_dir = workdir / ("job " + HOSTILE)
    job_dir.mkdir()
    params = slurm.make_params(
        job_name=HOSTILE,
        nodes=1,
        nproc_per_node=1,
        workdir=str(workdir),
        job_dir=str(job_dir),
        plan_path=str(job_dir / ("plan " + HOSTILE + ".yaml")),
        torchrun=str(tmp_path / "bin" / "torchrun"),
        python=str(tmp_path / "bin" / "python"),
        env={"LLMCTL_X": HOSTILE},
    )
    return slurm.render(params), workdir


def script_text(tmp_path: Path, which: str) -> str:
    if which == "golden":
        return slurm.render(golden_params())
    if which == "no-preflight":
        return slurm.render(no_preflight_params())
    return hostile_script(tmp_path)[0]


@pytest.mark.parametrize("which", ["golden", "no-preflight", "hostile"])
def test_bash_syntax(tmp_path: Path, which: str) -> None:
    text = script_text(tmp_path, which)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("which", ["golden", "no-preflight", "hostile"])
def test_shellcheck(tmp_path: Path, which: str) -> None:
    if not shutil.which("shellcheck"):
        if os.environ.get("CI") == "true":
            pytest.fail("shellcheck missing in CI (scripts/system-deps.sh installs it)")
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    text = script_text(tmp_path, which)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    # SC2016 ("$ in single quotes does not expand") is exactly what the hostile values must get.
    ignore = ["-e", "SC2016"] if which == "hostile" else []
    out = subprocess.run(["shellcheck", "-s", "bash", *ignore, str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_hostile_values_do_not_execute(tmp_path: Path) -> None:
    """Run the rendered script for real, with stub srun/scontrol/torchrun: the hostile workdir, plan path and
    env value arrive byte for byte and nothing named PWNED* is ever created."""
    text, workdir = hostile_script(tmp_path)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "torchrun-args"
    write_stub(
        bindir,
        "scontrol",
        """case "$1 $2" in
  "show hostnames") echo node1 ;;
  "show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=vm" ;;
esac""",
    )
    # srun: run the command once, as node 0 of 1.
    write_stub(bindir, "srun", 'while [[ "$1" == --* ]]; do shift; done\nSLURM_NODEID=0 SLURMD_NODENAME=node1 "$@"')
    write_stub(bindir, "scancel", "exit 0")
    write_stub(bindir, "torchrun", f'printf "%s\\0" "$PWD" "$@" "$LLMCTL_X" > {str(record)!r}\nexit 7')
    # the preflight (python -m llmctl.launch.preflight): records what it was given, says: train on node1
    preflight = tmp_path / "preflight-args"
    write_stub(
        bindir, "python", f'printf "%s\\0" "$@" "$LLMCTL_JOB_DIR" "$LLMCTL_PLAN" > {str(preflight)!r}\necho node1'
    )
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "SLURM_JOB_ID": "41",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_NNODES": "1",
        "HOME": str(tmp_path),
    }
    run = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 7, run.stdout + run.stderr  # the step's exit code is the job's
    assert not pwned(tmp_path), run.stdout + run.stderr
    args = record.read_text().split("\0")[:-1]
    assert args[0] == str(workdir)
    assert args[-2] == str(workdir / ("job " + HOSTILE) / ("plan " + HOSTILE + ".yaml"))
    assert args[-1] == HOSTILE
    assert "--rdzv_endpoint=127.0.0.1:29541" in args and "--rdzv_conf=is_host=1" in args
    assert "--local_addr=127.0.0.1" in args
    assert "--signals_to_handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in args
    events = (workdir / ("job " + HOSTILE) / "events").read_text()
    assert events.startswith("exit 7 ")
    assert preflight.read_text().split("\0")[:-1] == [
        "-m",
        "llmctl.launch.preflight",
        str(workdir / ("job " + HOSTILE)),
        str(workdir / ("job " + HOSTILE) / ("plan " + HOSTILE + ".yaml")),
    ]


def test_preflight_stop_ends_the_job_before_training(tmp_path: Path) -> None:
    """The preflight's exit code stops the job: no training step, an `exit N` event, the code is the job's."""
    text, workdir = hostile_script(tmp_path)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    write_stub(bindir, "python", 'echo "llmctl: preflight failed: node1 failed: boom" >&2\nexit 1')
    write_stub(bindir, "torchrun", "touch TRAINED")
    write_stub(bindir, "srun", 'while [[ "$1" == --* ]]; do shift; done\n"$@"')
    write_stub(bindir, "scontrol", "echo node1")
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "SLURM_JOB_ID": "41", "SLURM_JOB_NODELIST": "node1"}
    run = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "llmctl: preflight failed: node1 failed: boom" in run.stderr
    assert "llmctl: preflight ended with exit code 1" in run.stdout
    assert not list(tmp_path.rglob("TRAINED"))
    assert (workdir / ("job " + HOSTILE) / "events").read_text().startswith("exit 1 ")


def test_hostile_job_name_is_sanitized() -> None:
    params = slurm.make_params(
        job_name=HOSTILE,
        nodes=1,
        nproc_per_node=1,
        workdir="/w",
        job_dir="/w/j",
        plan_path="/w/j/p.yaml",
        torchrun="torchrun",
    )
    directive = [ln for ln in slurm.render(params).splitlines() if ln.startswith("#SBATCH --job-name=")]
    assert directive == [f"#SBATCH --job-name={params.job_name}"]
    assert set(params.job_name) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


@pytest.mark.parametrize(
    "option, value",
    [
        ("partition", "gpu\n#SBATCH --uid=0"),
        ("account", "a;b"),
        ("qos", "$(id)"),
        ("constraint", "a b"),
        ("exclude", "n1`x`"),
        ("time", "1:00:00\n"),
        ("time", "forever"),
    ],
)
def test_bad_directive_values_rejected(option: str, value: str) -> None:
    with pytest.raises(InputError, match=f"--{option}"):
        slurm.make_params(
            job_name="x",
            nodes=1,
            nproc_per_node=1,
            workdir="/w",
            job_dir="/w/j",
            plan_path="/w/j/p.yaml",
            torchrun="torchrun",
            **{option: value},
        )


@pytest.mark.parametrize("arg", ["--mem=1G\ntouch PWNED", "mem=1G", "--signal=USR2@60", "--output=/tmp/x"])
def test_bad_sbatch_args_rejected(arg: str) -> None:
    with pytest.raises(InputError, match="--sbatch-arg"):
        slurm.make_params(
            job_name="x",
            nodes=1,
            nproc_per_node=1,
            workdir="/w",
            job_dir="/w/j",
            plan_path="/w/j/p.yaml",
            torchrun="torchrun",
            extra_sbatch_args=[arg],
        )


def test_time_shorter_than_signal_lead_rejected() -> None:
    with pytest.raises(InputError, match="--time 4"):
        slurm.make_params(
            job_name="x",
            nodes=1,
            nproc_per_node=1,
            workdir="/w",
            job_dir="/w/j",
            plan_path="/w/j/p.yaml",
            torchrun="torchrun",
            time="4",
            signal_lead_s=300,
        )


def test_the_time_limit_must_leave_room_after_the_signal() -> None:
    """The check's boundary, on SlurmOptions itself: a --time equal to the signal lead would get the checkpoint
    signal as it starts; one second more is a job."""
    from llmctl.launch.slurm_options import SlurmOptions

    with pytest.raises(InputError, match="--time 5:00: the job would get its checkpoint signal"):
        SlurmOptions(time="5:00", signal_lead_s=300)
    assert SlurmOptions(time="5:01", signal_lead_s=300).time_s == 301


def test_submitits_time_is_whole_minutes_rounded_up() -> None:
    """submitit takes minutes: a limit of 1:00:30 asks for 61 (rounded down, the job would end 30 s before the
    limit the signal lead was checked against); none given asks for a day."""
    from llmctl.launch.slurm_options import SlurmOptions

    got = {t: SlurmOptions(time=t).submitit_parameters()["time"] for t in ("1:00:30", "1:00:00", "10")}
    assert got == {"1:00:30": 61, "1:00:00": 60, "10": 10}
    assert SlurmOptions().submitit_parameters()["time"] == 24 * 60


def test_a_resource_option_given_twice_must_say_the_same() -> None:
    """--mem and --sbatch-arg=--mem=... together: the same size in either case is one option (SLURM reads 200g as
    200G); two sizes are an error naming both."""
    from llmctl.launch.slurm_options import SlurmOptions

    options = SlurmOptions(mem="200G", extra_sbatch_args=("--mem=200g",))
    assert (options.mem, options.extra_sbatch_args) == ("200G", ())
    assert SlurmOptions(cpus_per_task=8, extra_sbatch_args=("-c 8",)).cpus_per_task == 8
    with pytest.raises(InputError, match="--sbatch-arg --mem=100G and --mem 200G: give one"):
        SlurmOptions(mem="200G", extra_sbatch_args=("--mem=100G",))


@pytest.mark.parametrize(
    "value, seconds",
    [("30", 1800), ("5:30", 330), ("1:00:00", 3600), ("2-0", 172800), ("1-2:03", 93780), ("1-02:03:04", 93784)],
)
def test_parse_time(value: str, seconds: int) -> None:
    assert slurm.parse_time_s(value) == seconds


def test_secret_env_rejected() -> None:
    with pytest.raises(InputError, match="HF_TOKEN"):
        slurm.make_params(
            job_name="x",
            nodes=1,
            nproc_per_node=1,
            workdir="/w",
            job_dir="/w/j",
            plan_path="/w/j/p.yaml",
            torchrun="torchrun",
            env={"HF_TOKEN": "hf_x"},
        )


def test_template_found() -> None:
    assert "#SBATCH --signal=B:USR1@" in slurm.template_text()
