"""``launch --slurm`` and ``--dry-run`` for every backend, Slurm's and Kubernetes' variables (no cluster).

The batch script is run by bash with stand-ins for ``scontrol`` and ``srun``
on ``PATH`` (this machine has no Slurm), which record each step's variables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torsh_jax.cli.main import main
from torsh_jax.distributed.env import detect_environment
from torsh_jax.distributed.launcher import child_environment
from torsh_jax.distributed.slurm import SlurmJob, sbatch_script, submit_sbatch
from torsh_jax.distributed.stale import stale_coordinator_warnings
from torsh_jax.errors import DistributedError

SCRIPT = str(Path(__file__).parent / "scripts" / "train_multiprocess.py")
STALE = (
    "JAX_COORDINATOR_PORT JAX_COORDINATOR_ADDRESS COORDINATOR_ADDRESS MASTER_ADDR MASTER_PORT "
    "JAX_NUM_PROCESSES JAX_PROCESS_ID RANK WORLD_SIZE LOCAL_RANK TORSH_JAX_COORDINATOR "
    "TORSH_JAX_NUM_PROCESSES TORSH_JAX_PROCESS_ID TORSH_JAX_DEVICES_PER_PROCESS TORSH_JAX_RESTART"
)


def test_sbatch_script_for_2_nodes_of_8_gpus_line_by_line():
    job = SlurmJob(nodes=2, tasks_per_node=8, gpus_per_node=8, time="04:00:00", partition="gpu", account="lm")
    text = sbatch_script(["train.py", "--plan", "zero3", "--name", "a b"], job=job, python="/venv/bin/python")
    assert text.splitlines() == [
        "#!/bin/bash",
        "#SBATCH --job-name=torsh-jax",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=8",  # one task per GPU: 16 processes
        "#SBATCH --gpus-per-task=1",  # each task sees its own GPU only
        "#SBATCH --time=04:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=lm",
        "#SBATCH --output=torsh-jax-%j.out",
        "",
        "set -euo pipefail",
        "",
        "# Left over from the submitting shell (sbatch exports it), these would win over Slurm's variables.",
        f"unset {STALE}",
        "# Coordinator: the allocation's first host, where srun starts task 0 (sed reads all lines:",
        "# `head` would close the pipe early and pipefail would end the script).",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"',
        "BASE_PORT=$(( SLURM_JOB_ID % 4096 + 61440 ))",
        "",
        'export MASTER_ADDR MASTER_PORT="$BASE_PORT"',
        "srun --kill-on-bad-exit=1 /venv/bin/python train.py --plan zero3 --name 'a b'",
    ]


def test_one_task_per_node_gets_all_its_gpus():
    text = sbatch_script(["t.py"], job=SlurmJob(nodes=4, gpus_per_node=8), python="python")
    assert "#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=8\n" in text
    assert "--gpus-per-task" not in text


FAKE_SCONTROL = """#!/bin/bash
[ "$1 $2 $3" = "show hostnames gpu[01-04,07]" ] || exit 9
printf 'gpu01\\ngpu02\\ngpu03\\ngpu04\\ngpu07\\n'
"""
#: Records the step's coordinator variables; the first step fails, as a lost rank would.
FAKE_SRUN = """#!/bin/bash
echo "$MASTER_ADDR $MASTER_PORT ${TORSH_JAX_RESTART:-none} ${RANK:-unset}" \\
    "${JAX_COORDINATOR_PORT:-unset} $*" >> "$STEPS_LOG"
[ "${TORSH_JAX_RESTART:-0}" != 0 ]
"""


def run_batch_script(tmp_path: Path, text: str, **extra: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "job.sbatch").write_text(text)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STEPS_LOG": str(tmp_path / "steps.log")}
    env |= {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-04,07]", **extra}
    return subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True)


def test_batch_script_runs_the_step_again_on_the_next_port_after_a_failure(tmp_path):
    job = SlurmJob(nodes=5, max_restarts=2)
    # a stale RANK and JAX_COORDINATOR_PORT from the submitting shell must not reach the steps
    done = run_batch_script(
        tmp_path, sbatch_script(["t.py"], job=job, python="py"), RANK="3", JAX_COORDINATOR_PORT="1"
    )
    assert done.returncode == 0, done.stderr
    steps = (tmp_path / "steps.log").read_text().splitlines()
    # 4242 % 4096 + 61440 = 61586, the port JAX's own Slurm detection derives
    assert steps == [
        "gpu01 61586 0 unset unset --kill-on-bad-exit=1 py t.py",
        "gpu01 61587 1 unset unset --kill-on-bad-exit=1 py t.py",
    ]
    assert "[launch] step failed with code 1 (attempt 0 of 2)" in done.stderr


def test_batch_script_without_restarts_returns_the_step_failure(tmp_path):
    done = run_batch_script(tmp_path, sbatch_script(["t.py"], job=SlurmJob(port=5000), python="py"))
    assert done.returncode == 1
    assert (tmp_path / "steps.log").read_text().split()[:3] == ["gpu01", "5000", "none"]


def test_derived_restart_port_wraps_inside_61440_to_65535(tmp_path):
    job = SlurmJob(max_restarts=2)
    done = run_batch_script(tmp_path, sbatch_script(["t.py"], job=job, python="py"), SLURM_JOB_ID="4095")
    assert done.returncode == 0, done.stderr
    # 4095 % 4096 + 61440 = 65535 for attempt 0; attempt 1 wraps to 61440, not 65536
    assert [line.split()[1] for line in (tmp_path / "steps.log").read_text().splitlines()] == [
        "65535",
        "61440",
    ]


def test_port_plus_restarts_beyond_65535_is_refused_in_dry_run(capsys):
    code, out, err = dry_run(capsys, ["--slurm", "--port", "65535", "--max-restarts", "2", SCRIPT])
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--port: 65535 + 2 restarts reaches port 65537 > 65535. Fix: pass --port 65533" in err


def test_script_arguments_with_spaces_and_quotes_reach_the_step_unchanged(tmp_path):
    args = ["my train.py", "--note", 'it\'s a "test"', "$HOME"]
    text = sbatch_script(args, job=SlurmJob(), python="py")
    done = run_batch_script(tmp_path, text.replace("srun --kill-on-bad-exit=1", "printf '<%s>' "))
    assert done.returncode == 0, done.stderr
    assert done.stdout == '<py><my train.py><--note><it\'s a "test"><$HOME>'


def test_job_name_comes_from_the_script_name_made_slurm_safe_or_from_job_name(capsys):
    _, out, _ = dry_run(capsys, ["--slurm", "--json", "runs/my train (v2).py"])
    assert json.loads(out)["extra"]["sbatch"].splitlines()[1] == "#SBATCH --job-name=my_train__v2_"
    _, out, _ = dry_run(capsys, ["--slurm", "--json", "--job-name", "lm-7b", "t.py"])
    assert json.loads(out)["extra"]["sbatch"].splitlines()[1] == "#SBATCH --job-name=lm-7b"
    code, _, err = dry_run(capsys, ["--slurm", "--job-name", "a b", "t.py"])
    assert code == 2 and "--job-name: 'a b' is not a Slurm name. Fix: pass --job-name with" in err


def test_unwritable_directory_and_silent_sbatch_are_one_line_errors(tmp_path, monkeypatch):
    fake = tmp_path / "sbatch"
    fake.write_text("#!/bin/bash\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    with pytest.raises(DistributedError, match="cannot write the batch script") as caught:
        submit_sbatch("#!/bin/bash\n", directory=tmp_path / "missing")
    assert caught.value.key == str(tmp_path / "missing" / "torsh-jax.sbatch")

    def hangs(argv, **kwargs):
        assert kwargs["timeout"] == 60
        raise subprocess.TimeoutExpired(argv, kwargs["timeout"])

    with pytest.raises(DistributedError, match="sbatch did not answer within 60 s") as caught:
        submit_sbatch("#!/bin/bash\n", directory=tmp_path, run=hangs)
    assert caught.value.key == "--slurm"


#: What srun sets in each task of `srun -N 2 --ntasks-per-node 2 --relative 3` inside a 5-node
#: allocation gpu[01-04,07] of 2 tasks per node (https://slurm.schedmd.com/srun.html, OUTPUT
#: ENVIRONMENT VARIABLES; sbatch's for the job-wide ones): the step runs on gpu04 and gpu07.
#: SLURM_NTASKS and SLURM_NNODES are described as the job's, so they are set to the job's here;
#: the step's own counts must win.
SRUN_STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[01-04,07]",
    "SLURM_NODELIST": "gpu[01-04,07]",
    "SLURM_JOB_NUM_NODES": "5",
    "SLURM_NNODES": "5",
    "SLURM_NTASKS": "10",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2(x5)",
    "SLURM_STEP_NODELIST": "gpu[04,07]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}


@pytest.mark.parametrize("procid", [0, 1, 2, 3], ids=lambda p: f"procid{p}")
def test_srun_step_of_2_nodes_by_2_tasks_resolves_as_slurm_documents(procid):
    node, local = divmod(procid, 2)
    host = ("gpu04", "gpu07")[node]
    task = {
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(local),
        "SLURM_NODEID": str(node),
        "SLURMD_NODENAME": host,
    }
    env = detect_environment({**SRUN_STEP, **task})
    assert env.kind == "slurm"
    assert (env.num_processes, env.process_id) == (4, procid)
    assert (env.local_rank, env.local_world_size) == (local, 2)
    assert (env.node_rank, env.num_nodes) == (node, 2)
    assert env.coordinator_address == "gpu04:61586"  # the step's first node, not the job's (gpu01)


def test_kubernetes_indexed_job_pod_index_is_the_process_id():
    pod = {
        "JOB_COMPLETION_INDEX": "3",
        "JAX_NUM_PROCESSES": "4",
        "JAX_COORDINATOR_ADDRESS": "train-0.train:1234",
    }
    env = detect_environment(pod)
    assert (env.kind, env.process_id, env.num_processes) == ("jax", 3, 4)
    assert env.coordinator_address == "train-0.train:1234"
    assert detect_environment({**pod, "JAX_PROCESS_ID": "1"}).process_id == 1  # explicit wins
    with pytest.raises(DistributedError, match="JOB_COMPLETION_INDEX: process id 4 is outside"):
        detect_environment({**pod, "JOB_COMPLETION_INDEX": "4"})


def test_submit_needs_sbatch_on_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(DistributedError) as caught:
        submit_sbatch("#!/bin/bash\n", directory=tmp_path)
    assert caught.value.key == "--slurm" and "--dry-run" in caught.value.fix


def test_submit_writes_the_script_and_returns_the_job_id(tmp_path, monkeypatch):
    fake = tmp_path / "sbatch"
    fake.write_text('#!/bin/bash\n[ "$1" = --parsable ] && cp "$2" "$2.seen" && echo "777;cluster"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    text = sbatch_script(["t.py"], job=SlurmJob(job_name="lm"), python="py")
    assert submit_sbatch(text, directory=tmp_path) == "777"
    assert (tmp_path / "lm.sbatch.seen").read_text() == text


def dry_run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(["launch", "--dry-run", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_local_dry_run_json_shows_each_rank_and_the_plan_for_its_devices(capsys, monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "29999")  # left by an earlier job
    argv = ["-n", "2", "--devices-per-process", "2", "--port", "4000", "--plan", "hsdp", "--json", SCRIPT]
    code, out, err = dry_run(capsys, [*argv, "--steps", "3"])
    assert code == 0 and err == ""
    preview = json.loads(out)
    assert preview["backend"] == "local" and preview["coordinator"] == "127.0.0.1:4000"
    assert preview["command"] == [sys.executable, SCRIPT, "--steps", "3"]
    assert [r["env"]["TORSH_JAX_PROCESS_ID"] for r in preview["ranks"]] == ["0", "1"]
    assert {r["env"]["TORSH_JAX_DEVICES_PER_PROCESS"] for r in preview["ranks"]} == {"2"}
    assert preview["plan"] == {
        "name": "hsdp",
        "devices": 4,
        "mesh": {"data": 2, "stage": 1, "fsdp": 2, "tensor": 1},
        "global_batch": 32,
    }
    assert preview["warnings"] == [
        "JAX_COORDINATOR_PORT=29999 is set: it replaces the coordinator port of every process. "
        "Fix: unset JAX_COORDINATOR_PORT"
    ]


def test_dry_run_text_warns_on_stderr_and_starts_nothing(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MASTER_ADDR", "old-head")
    marker = tmp_path / "ran"
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    code, out, err = dry_run(capsys, ["-n", "3", str(script)])
    assert code == 0 and not marker.exists()
    first = "backend local: 3 process(es), 3 device(s), coordinator 127.0.0.1:<free port>"
    assert out.splitlines()[0] == first
    assert "rank 2 (node 0): TORSH_JAX_COORDINATOR=127.0.0.1:<free port> TORSH_JAX_NUM_PROCESSES=3" in out
    assert err.startswith("warning: MASTER_ADDR=old-head is set:") and "Fix: unset MASTER_ADDR" in err


def test_slurm_dry_run_prints_the_batch_script_and_the_task_layout(capsys, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    argv = ["--slurm", "--nodes", "2", "--gpus-per-node", "8", "--tasks-per-node", "8", "--plan", "zero3"]
    code, out, _ = dry_run(capsys, [*argv, "--json", SCRIPT])
    preview = json.loads(out)
    assert code == 0 and preview["backend"] == "slurm" and len(preview["ranks"]) == 16
    assert preview["ranks"][9]["env"] | {"MASTER_ADDR": "-"} == {
        "SLURM_PROCID": "9",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS": "16",
        "MASTER_ADDR": "-",
        "MASTER_PORT": "$(( SLURM_JOB_ID % 4096 + 61440 ))",
    }
    assert preview["plan"]["mesh"]["fsdp"] == 16 and preview["plan"]["devices"] == 16
    assert preview["extra"]["sbatch"].startswith("#!/bin/bash\n#SBATCH --job-name=train_multiprocess\n")


def test_ray_dry_run_needs_no_cluster(capsys):
    code, out, _ = dry_run(capsys, ["--ray", "10.0.0.1:6379", "-n", "2", "--gpus-per-process", "4", SCRIPT])
    assert code == 0
    assert "backend ray: 2 process(es), 8 device(s), coordinator <node IP of rank 0>:<free port>" in out
    assert "10.0.0.1:6379; placement group of 2 bundle(s) {'CPU': 1, 'GPU': 4}, strategy SPREAD" in out


def test_dry_run_plan_that_does_not_fit_is_a_one_line_error(capsys):
    code, out, err = dry_run(capsys, ["-n", "3", "--plan", "fsdp_tp", SCRIPT])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Fix:" in err


BAD_FLAGS = {
    "slurm-with-n": (["--slurm", "-n", "2"], "-n/--num-processes"),
    "no-n": ([], "-n/--num-processes"),
    "nodes-without-slurm": (["-n", "2", "--nodes", "2"], "--nodes"),
    "min-processes-under-slurm": (["--slurm", "--min-processes", "1"], "--min-processes"),
    "gpus-per-process-local": (["-n", "2", "--gpus-per-process", "1"], "--gpus-per-process"),
    "devices-and-gpus": (
        ["--ray", "auto", "-n", "2", "--devices-per-process", "2", "--gpus-per-process", "1"],
        "--gpus-per-process",
    ),
    "json-without-dry-run": (["-n", "2", "--json"], "--json"),
    "uneven-gpus": (
        ["--slurm", "--gpus-per-node", "8", "--tasks-per-node", "3", "--dry-run"],
        "--tasks-per-node",
    ),
    "bad-time": (["--slurm", "--time", "2 hours", "--dry-run"], "--time"),
}


@pytest.mark.parametrize(("flags", "key"), BAD_FLAGS.values(), ids=BAD_FLAGS)
def test_bad_backend_flags_are_one_line_errors_naming_the_flag(capsys, flags, key):
    assert main(["launch", *flags, SCRIPT]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"torsh-jax launch: error: {key}: ") and err.count("\n") == 1 and "Fix:" in err


def test_ray_missing_is_a_typed_error_telling_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    assert main(["launch", "--ray", "auto", "-n", "2", SCRIPT]) == 2
    assert capsys.readouterr().err == (
        "torsh-jax launch: error: --ray: Ray is not installed. Fix: pip install 'torsh-jax[ray]'\n"
    )


def test_importing_torsh_jax_and_its_launch_command_imports_no_ray():
    code = (
        "import sys, torsh_jax, torsh_jax.distributed, torsh_jax.cli.main as m; m.build_parser();"
        "from torsh_jax.distributed import ray_launch, preview, slurm; print('ray' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == "False"


STEP_VARS = {
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_JOB_ID": "7",
    "SLURM_JOB_NODELIST": "gpu[1-2]",
}


@pytest.mark.parametrize(
    ("hostname", "stale"),
    [("gpu2", False), ("gpu2.cluster.local", False), ("laptop", True)],
    ids=["in-allocation", "fqdn-in-allocation", "elsewhere"],
)
def test_slurm_step_variables_are_stale_only_outside_their_allocation(hostname, stale):
    warnings = stale_coordinator_warnings(STEP_VARS, hostname=hostname)
    assert len(warnings) == stale
    if stale:
        assert warnings[0].startswith("SLURM_PROCID, SLURM_NTASKS set but this host (laptop) is not in")
        assert warnings[0].endswith("Fix: unset SLURM_PROCID SLURM_NTASKS")


def test_script_read_as_the_ray_address_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["launch", "-n", "2", "--ray", "train.py"])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.count("\n") == 1
    assert "'train.py' is the script, read as the Ray address. Fix: write --ray auto train.py" in err


DRY_RUN_REFUSALS = {
    "missing-script-local": (["-n", "2", "missing.py"], "missing.py: script not found"),
    "missing-script-ray": (["--ray", "auto", "-n", "2", "missing.py"], "missing.py: script not found"),
    "missing-module": (["-n", "2", "-m", "no_such_module", "x"], "no_such_module: module not found"),
    "port-under-ray": (["--ray", "auto", "-n", "2", "--port", "4000", SCRIPT], "--port: is read only by"),
    "negative-grace-period": (["-n", "2", "--grace-period", "-1", SCRIPT], "--grace-period: must be >= 0"),
    "nan-exit-grace": (["-n", "2", "--exit-grace", "nan", SCRIPT], "--exit-grace: must be > 0"),
    "nan-timeout": (["-n", "2", "--timeout", "nan", SCRIPT], "--timeout: must be > 0"),
}


@pytest.mark.parametrize(("argv", "error"), DRY_RUN_REFUSALS.values(), ids=DRY_RUN_REFUSALS)
def test_dry_run_refuses_what_the_real_run_refuses(capsys, argv, error):
    code, out, err = dry_run(capsys, argv)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"torsh-jax launch: error: {error}") and "Fix:" in err


def test_a_module_runs_as_python_m_on_every_backend(capsys):
    """``-m torsh_jax calibrate``: each process runs ``python -m torsh_jax calibrate`` (Ray's actors
    too: a module is not a path to make absolute)."""
    from torsh_jax.distributed.ray_launch import _argv

    code, out, _ = dry_run(capsys, ["-n", "2", "--json", "-m", "torsh_jax", "calibrate", "-o", "m.json"])
    assert code == 0 and json.loads(out)["command"][1:] == ["-m", "torsh_jax", "calibrate", "-o", "m.json"]
    assert _argv(["-m", "torsh_jax", "calibrate"]) == ["-m", "torsh_jax", "calibrate"]
    assert _argv([SCRIPT, "--steps", "2"])[0] == os.path.abspath(SCRIPT)


def test_child_environment_brackets_an_ipv6_coordinator():
    env = child_environment({}, rank=0, count=2, port=8476, devices=None, host="fd00::1")
    assert env["TORSH_JAX_COORDINATOR"] == "[fd00::1]:8476"
    assert detect_environment(env).coordinator_address == "[fd00::1]:8476"


def test_restart_variable_is_a_stale_variable():
    [line] = stale_coordinator_warnings({"TORSH_JAX_RESTART": "2"}, hostname="h")
    assert line.endswith("Fix: unset TORSH_JAX_RESTART")
