"""`llmctl tune --slurm` without SLURM: the job file, the runner's step command and records (stub srun and scontrol
on PATH), what the submitting side makes of trials.json and of a job that ended early, the rendered script
(bash -n, shellcheck) and the refusals. The real allocation is tests/launch/test_tune_slurm.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmctl.errors import InputError
from llmctl.launch import slurm
from llmctl.tune import job as tune_job
from llmctl.tune import report as tune_report
from llmctl.tune import run as tune_trials

# A fake engine for the stub srun: writes the trial's metrics as the engine would (3 steps) and exits.
FAKE_ENGINE = """
import json, os, sys
plan = os.environ["LLMCTL_PLAN"]
logs = os.path.join(os.path.dirname(plan), "logs")
os.makedirs(logs, exist_ok=True)
with open(os.path.join(os.path.dirname(plan), "env"), "a") as f:
    f.write(" ".join(os.environ[k] for k in ("LLMCTL_NNODES", "LLMCTL_RDZV_NODE", "LLMCTL_RDZV_ADDR", "LLMCTL_RDZV_PORT")) + "\\n")
if "fail" in plan:
    sys.exit(5)
with open(os.path.join(logs, "metrics.jsonl"), "a") as f:
    for step in (1, 2, 3):
        f.write(json.dumps({"event": "step", "step": step, "tokens_per_s": 100.0 * step, "step_time_s": 1.0 / step})
                + "\\n")
"""


def write_stub(bindir: Path, name: str, body: str) -> None:
    path = bindir / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)


def spec_for(tmp_path: Path, numbers: tuple[int, ...] = (1, 2), fail: tuple[int, ...] = (), rounds: int = 1):
    trials = []
    for n in numbers:
        folder = tmp_path / f"trial-{n}"
        folder.mkdir()
        name = "fail.yaml" if n in fail else "plan.yaml"
        (folder / name).write_text("name: x\n")
        trials.append(tune_job.TrialSpec(n, f"setup {n}", str(folder / name), str(folder)))
    return tune_job.JobSpec(
        nodes=2, nproc_per_node=1, warmup=1, steps=2, rounds=rounds, timeout_s=30.0, trials=tuple(trials)
    )


@pytest.fixture
def stub_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """srun runs the step's command once per node it is given; scontrol answers hostnames and node addresses."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    write_stub(
        bindir,
        "scontrol",
        """case "$1 $2" in
  "show hostnames") echo "$3" | tr ',' '\\n' ;;
  "show node") echo "NodeName=$3 NodeAddr=10.0.0.${3#node} State=IDLE" ;;
esac""",
    )
    record = tmp_path / "srun-args"
    # Record the srun options; run the command (bash -c SCRIPT) with torchrun replaced by the fake engine.
    write_stub(
        bindir,
        "srun",
        f"""printf "%s\\n" "$@" | grep '^--' >> {str(record)!r}
while [[ "$1" == --* ]]; do shift; done
exec {sys.executable!s} -c {shlex_quote(FAKE_ENGINE)}""",
    )
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return record


def shlex_quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


def job_env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node1,node2,node3",
        "LLMCTL_RDZV_PORT": "30000",
        **extra,
    }


def test_job_file_round_trips_and_a_bad_one_is_one_line(tmp_path: Path) -> None:
    spec = spec_for(tmp_path)
    spec.save(tmp_path)
    assert tune_job.JobSpec.load(tmp_path) == spec
    (tmp_path / tune_job.JOB_FILE).write_text('{"nodes": 2}')
    with pytest.raises(InputError, match="not a tune job file"):
        tune_job.JobSpec.load(tmp_path)
    with pytest.raises(InputError, match="not a folder `llmctl tune --slurm` wrote"):
        tune_job.JobSpec.load(tmp_path / "elsewhere")


def test_runner_runs_each_trial_as_a_step_on_the_plans_nodes(tmp_path: Path, stub_slurm: Path) -> None:
    spec = spec_for(tmp_path, fail=(2,), rounds=2)
    spec.save(tmp_path)
    assert tune_job.run(tmp_path, job_env()) == 0
    results = tune_job.read_results(tmp_path)
    assert results["state"] == "done" and results["current"] is None
    one, two = results["trials"]["1"], results["trials"]["2"]
    assert one["status"] == "ok" and len(one["round_records"]) == 2
    assert two["status"] == "failed" and two["reason"].startswith("exit 5") and len(two["round_records"]) == 1
    # Each run: 2 of the 3 allocated nodes, the first hosting the rendezvous, a port of its own per run.
    srun = stub_slurm.read_text().split()
    assert srun.count("--nodes=2") == 3 and srun.count("--nodelist=node1,node2") == 3
    lines = (tmp_path / "trial-1" / "env").read_text().splitlines()
    assert lines == ["2 node1 10.0.0.1 30001", "2 node1 10.0.0.1 30003"]
    assert (tmp_path / "trial-2" / "env").read_text().split()[-1] == "30002"
    # A requeued job (the same folder again) runs nothing that trials.json already holds.
    (tmp_path / "trial-1" / "env").unlink()
    assert tune_job.run(tmp_path, job_env()) == 0
    assert not (tmp_path / "trial-1" / "env").exists()


def test_runner_refuses_outside_a_job_and_too_small_an_allocation(tmp_path: Path, stub_slurm: Path) -> None:
    spec_for(tmp_path).save(tmp_path)
    env = job_env()
    del env["SLURM_JOB_ID"]
    with pytest.raises(InputError, match=r"not inside an llmctl tune job \(SLURM_JOB_ID unset\)"):
        tune_job.run(tmp_path, env)
    with pytest.raises(Exception, match=r"the allocation has 1 node\(s\) \(node1\); the trials need 2"):
        tune_job.run(tmp_path, job_env(SLURM_JOB_NODELIST="node1"))
    # As a module: one line, exit 2.
    out = subprocess.run(
        [sys.executable, "-m", "llmctl.tune.job", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        env=job_env(),
    )
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "not a folder" in out.stderr


class Lines:
    """A stand-in for tune_show.Progress that records what it was told."""

    def __init__(self) -> None:
        self.said: list[str] = []

    def start(self, t: tune_report.Trial, rnd: int) -> None:
        self.said.append(f"start {t.number}.{rnd}")

    def step(self, n: int) -> None:
        pass

    def end(self, t: tune_report.Trial, rnd: int, m: tune_report.Measured | None) -> None:
        self.said.append(f"end {t.number}.{rnd} {t.status} {m.tokens_per_s if m else None}")


def test_follow_fills_the_trials_from_the_jobs_record(tmp_path: Path, stub_slurm: Path, monkeypatch) -> None:
    spec = spec_for(tmp_path, numbers=(1, 2, 3), fail=(2,))
    spec.save(tmp_path)
    tune_job.run(tmp_path, job_env())
    states = iter(["RUNNING", "COMPLETED"])
    monkeypatch.setattr("llmctl.launch.jobs.slurm_state", lambda job_id: next(states))
    trials = [tune_report.Trial(s.number, None, Path(s.folder)) for s in spec.trials]  # type: ignore[arg-type]
    lines = Lines()
    assert tune_job.follow("42", tmp_path, trials, 1, spec.warmup, lines, poll_s=0) == "COMPLETED"
    assert lines.said == ["start 1.1", "end 1.1 ok 250.0", "start 2.1", "end 2.1 failed None", "start 3.1",
                          "end 3.1 ok 250.0"]  # fmt: skip
    assert [t.status for t in trials] == ["ok", "failed", "ok"]
    assert trials[0].measured is not None and trials[0].measured.tokens_per_s == pytest.approx(250.0)


def test_a_state_slurm_does_not_answer_for_a_while_is_not_the_end(
    tmp_path: Path, stub_slurm: Path, monkeypatch
) -> None:
    spec = spec_for(tmp_path, numbers=(1,))
    spec.save(tmp_path)
    tune_job.run(tmp_path, job_env())
    answers = iter([None] * (tune_job.UNKNOWN_POLLS - 1) + ["COMPLETED"])
    monkeypatch.setattr("llmctl.launch.jobs.slurm_state", lambda job_id: next(answers))
    trials = [tune_report.Trial(1, None, Path(spec.trials[0].folder))]  # type: ignore[arg-type]
    assert tune_job.follow("42", tmp_path, trials, 1, spec.warmup, Lines(), poll_s=0) == "COMPLETED"
    assert trials[0].status == "ok"
    # No answer at all, for UNKNOWN_POLLS polls: the job is taken to have ended, its trials failed with the reason.
    monkeypatch.setattr("llmctl.launch.jobs.slurm_state", lambda job_id: None)
    trials = [tune_report.Trial(1, None, tmp_path / "never")]  # type: ignore[arg-type]
    assert tune_job.follow("43", tmp_path / "nothing", trials, 1, spec.warmup, Lines(), poll_s=0) == "UNKNOWN"
    assert trials[0].status == "failed" and "ended (UNKNOWN)" in (trials[0].reason or "")


def test_a_job_that_ends_early_fails_the_trials_it_never_ran(tmp_path: Path, monkeypatch) -> None:
    spec = spec_for(tmp_path)
    monkeypatch.setattr("llmctl.launch.jobs.slurm_state", lambda job_id: "TIMEOUT")
    trials = [tune_report.Trial(s.number, None, Path(s.folder)) for s in spec.trials]  # type: ignore[arg-type]
    assert tune_job.follow("7", tmp_path, trials, 1, 1, Lines(), poll_s=0) == "TIMEOUT"
    assert [t.status for t in trials] == ["failed", "failed"]
    assert trials[0].reason == (
        f"the tune job ended (TIMEOUT) before this trial ran to its end (see {tmp_path / 'slurm-7.out'})"
    )


def tune_script(tmp_path: Path) -> str:
    return slurm.render_tune(
        slurm.make_tune_params(
            job_name="tiny tune",
            nodes=2,
            workdir=str(tmp_path / "work dir"),
            tune_dir=str(tmp_path / "trials $HOME"),
            torchrun="/opt/venv/bin/torchrun",
            python="/opt/venv/bin/python",
            gpus_per_node=8,
            time="1:00:00",
            partition="gpu",
            extra_sbatch_args=["--exclusive"],
        )
    )


def test_tune_script_is_valid_bash_and_shellcheck_clean(tmp_path: Path) -> None:
    text = tune_script(tmp_path)
    for line in (
        "#SBATCH --job-name=tiny_tune",
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=1:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --exclusive",
        f"exec /opt/venv/bin/python -m llmctl.tune.job '{tmp_path}/trials $HOME'",
    ):
        assert line in text.splitlines(), line
    script = tmp_path / "tune.sbatch"
    script.write_text(text)
    subprocess.run(["bash", "-n", str(script)], check=True)
    if not shutil.which("shellcheck"):
        if os.environ.get("CI") == "true":
            pytest.fail("shellcheck missing in CI (scripts/system-deps.sh installs it)")
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    # SC2016 ("$ in single quotes does not expand") is exactly what the folder's `$HOME` must get.
    out = subprocess.run(["shellcheck", "-s", "bash", "-e", "SC2016", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_run_trial_takes_the_step_command_and_its_environment(tmp_path: Path) -> None:
    code = "import os, sys; sys.exit(int(os.environ['CODE']))"
    t = tune_report.Trial(1, None, tmp_path)  # type: ignore[arg-type]
    tune_trials.run_trial(t, tmp_path / "p.yaml", 1, 0, 1, 30, argv=[sys.executable, "-c", code], env={
        **os.environ, "CODE": "4"})  # fmt: skip
    assert t.status == "failed" and t.reason == f"exit 4 (see {tmp_path / 'output.log'})"
    assert (tmp_path / "command").read_text().startswith(sys.executable)
