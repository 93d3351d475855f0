"""A plan file, an --env or a container option cannot run commands on the batch host, and a job's text cannot rewrite
the terminal (issue 46): each item refused where it is read (one line, exit 2), and each rendered value harmless
where it is written (a comment stays one line). tests/launch/test_fuzz_scripts.py fuzzes every plan text field."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from launch_helpers import minimal_plan_yaml, pwned, write_stub
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.errors import InputError, SpecError
from llmctl.launch import jobs, shell, slurm, slurm_resources, submitit_backend
from llmctl.launch.backends import Job
from llmctl.launch.preflight.options import PreflightOptions
from llmctl.launch.slurm_options import SlurmOptions
from llmctl.spec import hardware
from llmctl.spec.planfile import plan_from_dict

INJECTED = "h100\ntouch PWNED #"
"""issue 46's reproduction: the newline ends the `# Per node: ...` comment that names the GPU kind."""


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def one_error_line(code: int, out: str, *needles: str) -> None:
    assert code == 2 and len(out.strip().splitlines()) == 1 and out.startswith("llmctl: error: "), out
    for needle in needles:
        assert needle in out, out


@pytest.fixture
def plan_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    p = tmp_path / "plan.yaml"
    p.write_text(minimal_plan_yaml(nodes=2))
    return p


def with_field(path: Path, section: str | None, key: str, value: object) -> Path:
    data = yaml.safe_load(path.read_text())
    (data.setdefault(section, {}) if section else data)[key] = value
    out = path.with_name("edited.yaml")
    out.write_text(yaml.safe_dump(data))
    return out


# --- the plan's text, at the schema -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("section", "key", "value", "needle"),
    [
        ("hardware", "gpu", INJECTED, "hardware.gpu: contains U+000A (a line break)"),
        (None, "name", "run\x1b]0;owned\x07", "name: contains U+001B (an escape"),
        ("checkpoint", "dir", "ckpt\rtouch PWNED", "checkpoint.dir: contains U+000D (a carriage return)"),
        ("logging", "dir", "logs\u2028x", "logging.dir: contains U+2028"),
        (None, "name", "abc\u202edcba", "name: contains U+202E"),  # a bidi override ("Trojan Source")
    ],
)
def test_control_characters_in_plan_text_are_refused(
    plan_path: Path, section: str | None, key: str, value: str, needle: str
) -> None:
    code, out = invoke("launch", str(with_field(plan_path, section, key, value)), "--slurm", "--dry-run")
    one_error_line(code, out, needle)
    assert "\x1b" not in out and "\u202e" not in out  # the line itself shows the character as an escape


def test_an_unknown_gpu_kind_is_refused_and_a_users_catalog_adds_one(
    plan_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out = invoke("launch", str(with_field(plan_path, "hardware", "gpu", "H100-SXMM")), "--slurm", "--dry-run")
    one_error_line(code, out, "hardware.gpu: unknown GPU kind 'H100-SXMM'", "$LLMCTL_GPU_CATALOG", "H100-SXM")
    shipped = yaml.safe_load((Path(hardware.__file__).parent / "presets" / "gpus.yaml").read_text())
    mine = {**next(e for e in shipped if e["name"] == "H100-SXM"), "name": "Z1-96GB", "aliases": ["z1"]}
    catalog = tmp_path / "gpus.yaml"
    catalog.write_text(yaml.safe_dump([mine]))
    monkeypatch.setenv(hardware.CATALOG_ENV, str(catalog))
    code, out = invoke("launch", str(with_field(plan_path, "hardware", "gpu", "z1")), "--slurm", "--dry-run")
    assert code == 0 and "GPU catalog: Z1-96GB" in out, out
    catalog.write_text(yaml.safe_dump([{**mine, "aliases": ["z1\ntouch PWNED #"]}]))
    with pytest.raises(SpecError, match="aliases.*U\\+000A"):
        hardware.parse_catalog(catalog.read_text(), str(catalog))


def test_every_shipped_plan_stays_valid() -> None:
    repo = Path(__file__).resolve().parents[2]
    plans = [p for p in repo.glob("examples/**/*.yaml") if "training" in (yaml.safe_load(p.read_text()) or {})]
    assert len(plans) >= 8
    for p in plans:
        plan_from_dict(yaml.safe_load(p.read_text()), str(p))


# --- where it is rendered: comments stay one line -------------------------------------------------------------------
STUBS = {
    "scontrol": 'case "$1 $2" in\n  "show hostnames") echo node1 ;;\n  *) echo "NodeName=node1 NodeAddr=127.0.0.1" ;;\nesac',
    "srun": 'echo "srun $1" >> "$STUB_LOG"\nwhile [[ "$1" == --* ]]; do shift; done\nSLURMD_NODENAME=node1 "$@"',
    "scancel": "exit 0",
    "torchrun": 'echo "torchrun $*" >> "$STUB_LOG"',
    "python": 'echo "python $*" >> "$STUB_LOG"; echo node1',
}


def run_with_stubs(tmp_path: Path, script: str) -> str:
    """bash -n, then the script itself with stub srun/scontrol/torchrun/python on PATH; returns what the stubs ran."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        write_stub(bindir, name, body)
    path = tmp_path / "script.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    log = tmp_path / "stubs.log"
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1", "STUB_LOG": str(log)}
    subprocess.run(["bash", str(path)], cwd=tmp_path, env=env, capture_output=True, timeout=60)
    return log.read_text() if log.is_file() else ""


def test_a_gpu_kind_that_got_past_the_schema_stays_in_its_comment(tmp_path: Path) -> None:
    """Defense in depth: make_params and make_tune_params are an API; a GPU kind (or any text) they are given that
    holds a line break is escaped in the comment that names it, in the launch and the tune script alike."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    common = dict(job_name="x", nodes=1, workdir=str(tmp_path), torchrun="torchrun", python="python")
    params = slurm.make_params(
        **common,
        nproc_per_node=2,
        job_dir=str(job_dir),
        plan_path=str(job_dir / "plan.yaml"),
        gpus_per_node=2,
        gpu=INJECTED,
        preflight=PreflightOptions(enabled=False),
    )
    text = slurm.render(params)
    assert "# Per node: 2 of 8 GPUs: 8 CPUs and 32 GiB per GPU (defaults; h100\\ntouch PWNED #: not in" in text
    assert "torchrun" in run_with_stubs(tmp_path, text)
    tune = slurm.render_tune(slurm.make_tune_params(**common, tune_dir=str(job_dir), gpus_per_node=2, gpu=INJECTED))
    assert "h100\\ntouch PWNED" in tune and "python -m llmctl.tune.job" in run_with_stubs(tmp_path, tune)
    assert not pwned(tmp_path)


def test_submitits_setup_comment_stays_one_line(tmp_path: Path) -> None:
    plan = plan_from_dict(yaml.safe_load(minimal_plan_yaml()) | {"hardware": {"gpu": "h100", "nproc_per_node": 2}})
    plan = plan.model_copy(update={"hardware": plan.hardware.model_copy(update={"gpu": INJECTED})})  # unvalidated
    job = Job(plan_path=tmp_path / "p.yaml", plan=plan, nodes=1, nproc_per_node=2, jobs_root=tmp_path, workdir=tmp_path)
    (comment,) = [ln for ln in submitit_backend.executor_parameters(job)["setup"] if "Per node" in ln]
    assert comment.startswith("# Per node:") and "\n" not in comment and "h100\\ntouch PWNED #" in comment


def test_resources_why_names_an_unknown_kind_as_given() -> None:
    # What the comment escapes: the kind reaches `why` as it was given (this is why the comment needs the filter).
    why = slurm_resources.derive(SlurmOptions(), nproc_per_node=2, gpus_per_node=2, gpu=INJECTED).why
    assert INJECTED in why


# --- --env, --apptainer, --container-image --------------------------------------------------------------------------
@pytest.mark.parametrize("given", ["FOO\n=1", "FOO\n", "1FOO=x", "FOO BAR=1", "FOO;touch=1", ""])
def test_env_names_match_whole(given: str) -> None:
    with pytest.raises(InputError, match="expected NAME=VALUE"):
        shell.check_env([given], environ={"FOO\n": "x", "FOO": "x"})


def test_env_name_with_a_line_break_is_exit_2(plan_path: Path) -> None:
    code, out = invoke("launch", str(plan_path), "--slurm", "--dry-run", "--env", "FOO\n=touch PWNED")
    one_error_line(code, out, "--env 'FOO\\n=touch PWNED'")


@pytest.mark.parametrize("flag", ["--apptainer", "--container-image"])
@pytest.mark.parametrize("value", ["--fakeroot", "-B/:/host"])
def test_container_images_cannot_be_options(plan_path: Path, flag: str, value: str) -> None:
    code, out = invoke("launch", str(plan_path), "--slurm", "--dry-run", "--no-preflight", f"{flag}={value}")
    one_error_line(code, out, f"{flag} '{value}': an image name or path cannot start with '-'")


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("HTTPS_PROXY=http://u:hf_s3cr3t_value_1@proxy:3128", "holds the value of $HF_TOKEN"),
        ("DATABASE_URL=postgres://u:pw@db.example:5432/runs", "holds a password in a URL"),
        ("REDIS_URL=redis://:pw@cache:6379/0", "holds a password in a URL"),
        ("EXTRA=hf_s3cr3t_value_1", "holds the value of $HF_TOKEN"),
        ("HF_TOKEN=abc", "its name says so"),
    ],
)
def test_a_secret_inside_a_value_is_never_written(
    plan_path: Path, monkeypatch: pytest.MonkeyPatch, given: str, why: str
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_s3cr3t_value_1")
    name = given.split("=")[0]
    code, out = invoke("launch", str(plan_path), "--slurm", "--dry-run", "--env", given)
    one_error_line(
        code, out, f"--env {name}=...: looks like a secret (", why, f"--env {name} (its value is never written)"
    )
    assert "s3cr3t" not in out and ":pw@" not in out


def test_values_without_secrets_still_go_into_the_script(plan_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_s3cr3t_value_1")
    given = ["HTTPS_PROXY=http://proxy.example:3128", "GIT_URL=ssh://git@host/repo", "HF_HOME=/shared/hf"]
    code, out = invoke("launch", str(plan_path), "--slurm", "--dry-run", *(a for g in given for a in ("--env", g)))
    assert code == 0, out
    assert "export HTTPS_PROXY=http://proxy.example:3128" in out and "export GIT_URL=ssh://git@host/repo" in out


def test_make_params_checks_env_as_the_cli_does(monkeypatch: pytest.MonkeyPatch) -> None:
    common = dict(job_name="x", nodes=1, nproc_per_node=1, workdir="/w", job_dir="/w/j", plan_path="/w/p", torchrun="t")
    with pytest.raises(InputError, match="password in a URL"):
        slurm.make_params(**common, env={"DATABASE_URL": "postgres://u:pw@db/x"})
    with pytest.raises(InputError, match="expected NAME=VALUE"):
        slurm.make_params(**common, env={"A\nB": "1"})
    with pytest.raises(InputError, match="expected NAME=VALUE"):
        slurm.make_params(**common, env_names=["A;touch PWNED"])


# --- what reaches the terminal ------------------------------------------------------------------------------------
def test_status_and_logs_escape_a_records_control_characters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record written by an older llmctl (before plan names were checked), or by hand: its plan name reaches the
    terminal escaped, and rich markup in it is shown as text."""
    monkeypatch.setenv("LLMCTL_JOBS_DIR", str(tmp_path / "jobs"))
    folder = tmp_path / "jobs" / "j1"
    folder.mkdir(parents=True)
    (folder / "console.log").write_text("hello\n")
    hostile = "run\x1b]0;owned\x07\x1b[2J[red]x[/]"
    record = jobs.JobRecord(
        job_id="local-1",
        backend="local",
        folder=str(folder),
        plan_name=hostile,
        nodes=1,
        nproc_per_node=1,
        submitted_at=jobs.now_utc(precise=True),
        logs=[str(folder / "console.log")],
        command=["torchrun"],
    )
    record.save()
    result = CliRunner().invoke(app, ["status", "--jobs-dir", str(tmp_path / "jobs")])
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output
    assert "run\\x1b]0;owned\\x07\\x1b[2J[red]x[/]" in result.output  # as text, markup included
    result = CliRunner().invoke(app, ["logs", "--jobs-dir", str(tmp_path / "jobs")])
    assert result.exit_code == 0 and "\x1b" not in result.stderr and result.stdout == "hello\n", result.output


def test_a_users_control_characters_in_paths_do_not_reach_the_terminal(plan_path: Path) -> None:
    # The --jobs-dir is the user's own; what launch prints about it still cannot move the cursor.
    stub = plan_path.parent / "bin"
    stub.mkdir()
    write_stub(stub, "sbatch", 'echo "42;c"')
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}"}
    runner = CliRunner(env=env)
    result = runner.invoke(
        app, ["launch", str(plan_path), "--slurm", "--jobs-dir", str(plan_path.parent / "j\x1b]0;owned\x07")]
    )
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "job folder: " in result.output
