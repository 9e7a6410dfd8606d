"""The ``torsh-jax`` command line as a user meets it: bad input gets one line with a ``Fix:``,
results on stdout, progress on stderr, strict JSON, quiet closed pipes, ``--version``."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torsh_jax.cli.main import main
from torsh_jax.demo import host

REPO = Path(__file__).resolve().parents[1]
#: A user's minimal environment, with the suite's compile flags (conftest.py: LLVM's costly passes off)
ENV = {
    "PYTHONPATH": str(REPO),
    "PATH": "/usr/bin:/bin",
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
}
SMALL = ["--layers", "1", "--d-model", "16"]


def _run(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torsh_jax", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
        input=stdin,
    )


def _strict_json(text: str) -> dict:
    def refuse(constant: str):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def _error_line(capsys, argv: list[str]) -> str:
    """Run ``argv`` in process; it must fail with one error line that has a Fix."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse rejects the value
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == ""
    lines = err.splitlines()
    assert err.endswith("\n") and [n for n, text in enumerate(lines) if "error:" in text] == [
        len(lines) - 1
    ], err
    assert not any(text.startswith(("usage:", " ")) for text in lines), f"no usage block: {err!r}"
    assert all(text.startswith("training (") for text in lines[:-1]), f"only progress before it: {err!r}"
    line = lines[-1]
    assert "Fix:" in line, err
    return line


def test_version_and_python_dash_m(tmp_path):
    from torsh_jax import __version__

    proc = _run("--version", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"torsh-jax {__version__}"


@pytest.mark.parametrize(
    "argv, where",
    [
        (["demo", "--steps", "-1"], "--steps"),
        (["demo", "--steps", "99999999999999999999999"], "--steps"),
        (["demo", "--devices", "99999999999999999999"], "--devices"),
        (["demo", "--devices", "0"], "--devices"),
        (["demo", "--plan", "no_such_plan"], "--plan"),
        (["inspect", "--devices", "-3"], "--devices"),
        (["launch", "-n", "banana", "x.py"], "--num-processes"),
        (["launch", "-n", "0", "x.py"], "--num-processes"),
        (["translate", "x.json", "--world-size", "0"], "--world-size"),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["demo", "--seed", "1", "--stepz", "3"], "did you mean --steps?"),
        (["checkpoint", "show", "d", "--stpe", "3"], "did you mean --step?"),
        (["demx"], "did you mean 'demo'?"),
        ([], "name one of demo, checkpoint"),
        (["checkpoint"], "name one of list, show"),
        (["translate"], "FILE"),
        (["translate", "x.json", "--format", "xml"], "--format"),
        (["inspect", "--plan"], "--plan: expected one argument"),
        (["launch", "-n", "2", "--grace-period", "soon", "x.py"], "--grace-period"),
        (["demo", "--slices", "2"], "--slices: slices need a TPU target"),
        (["demo", "--compile-only", "--target", "v5e-16", "--devices", "4"], "--devices: the target decides"),
        (["demo", "--compile-only", "--steps", "5"], "--steps: --compile-only trains nothing"),
        (["demo", "--profile", "3:500", "--log-dir", "unmade", "--steps", "10"], "--profile: steps 3 to 500"),
        (["calibrate", "--global-batch", "3"], "--global-batch: 3 examples are fewer than one per device"),
        (["inspect", "--target", "h100-0"], "target 'h100-0': no GPUs"),
        (["inspect", "--layers", "3", "--plan", "pp_1f1b"], "--layers: 3 layers do not split"),
        (["launch"], "script: no script to run"),
        (["launch", "-n", "2", "--timeout", "-5", "tests/helpers.py"], "--timeout: must be > 0 seconds"),
        (["launch", "-n", "2", "--min-processes", "5", "tests/helpers.py"], "--min-processes: must be in"),
        (["launch", "-n", "2", "--dry-run", "--plan", "nope", "tests/helpers.py"], "--plan: no meshes"),
    ],
)  # fmt: skip
def test_bad_arguments_are_one_line_with_a_fix(capsys, argv, where):
    assert where in _error_line(capsys, argv)


def _write(tmp_path: Path, name: str, content: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


@pytest.mark.parametrize(
    "name, content, extra, says",
    [
        ("empty.json", "", [], "empty"),
        ("blank.toml", "\n  \n", ["--as-plan"], "empty"),
        ("latin1.json", b'{"train_batch_size": 8, "x": "\xff"}', [], "UTF-8"),
        ("bad.toml", "mesh = [\n", ["--as-plan"], "not valid TOML"),
        ("huge.json", '{"train_batch_size": 1e32}', ["--world-size", "8"], "at most"),
        ("half.json", '{"train_batch_size": 16.5}', ["--world-size", "8"], "whole number"),
        ("garbage.sh", "hvd. horovodrun mpirun -x -x -x -np -np\n", [], "no Horovod launch line"),
        ("np.sh", "horovodrun -np 999999999999999999999999 python t.py\n", [], "at most"),
        ("np2.sh", "horovodrun -np banana python t.py\n", [], "-np"),
    ],
)  # fmt: skip
def test_bad_files_are_one_line_with_a_fix(capsys, tmp_path, name, content, extra, says):
    path = _write(tmp_path, name, content)
    if extra[:1] == ["--as-plan"]:
        argv = ["inspect", "--plan", path]
    else:
        argv = ["translate", path, *extra]
    line = _error_line(capsys, argv)
    assert says in line
    assert line.count(name) <= 1, "the file is never named twice"


def test_output_into_a_missing_directory_is_an_error(capsys, tmp_path):
    config = _write(tmp_path, "ds.json", '{"train_batch_size": 16}')
    line = _error_line(
        capsys, ["translate", config, "--world-size", "8", "-o", str(tmp_path / "no/dir/p.toml")]
    )
    assert "--output" in line and "does not exist" in line


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--model", "demo:tiny", "--target", "v5e-8", "--global-batch", "8"],
        ["calibrate", "--model", "demo:tiny"],
        ["report", "RUN"],
        ["translate", "CONFIG", "--world-size", "8"],
    ],
    ids=lambda argv: argv[0],
)
@pytest.mark.parametrize(
    "output, says",
    [
        ("no/dir/out.toml", "does not exist. Fix: create it (mkdir -p"),
        (".", "is a directory. Fix: name a file in it"),
    ],
    ids=["missing-directory", "a-directory"],
)
def test_every_output_file_is_checked_before_the_command_works(capsys, tmp_path, argv, output, says):
    """``-o`` of plan, calibrate, report and translate: a path the command could not write at the
    end is one line when it starts (argparse rejects it: nothing has run)."""
    config = _write(tmp_path, "ds.json", '{"train_batch_size": 16}')
    argv = [{"RUN": str(tmp_path), "CONFIG": config}.get(a, a) for a in argv]
    line = _error_line(capsys, [*argv, "-o", str(tmp_path / output)])
    assert "--output" in line and says in line, line


@pytest.mark.parametrize("output", ["-", "/dev/null"])
def test_an_output_that_is_not_a_file_is_not_given_a_suffix(capsys, tmp_path, output):
    config = _write(tmp_path, "ds.json", '{"train_batch_size": 16}')
    line = _error_line(capsys, ["translate", config, "--world-size", "8", "-o", output])
    assert f"'{output}' must end in .toml or .json. Fix: write to a .toml or .json file" in line


def test_an_output_file_the_disk_cannot_take_is_one_line():
    """Written at the end (the path was fine when the command started): a full disk is one line."""
    from torsh_jax.cli.output import write_output
    from torsh_jax.errors import OutputError

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    with pytest.raises(OutputError, match=r"--output: cannot write '/dev/full': No space left on device"):
        write_output(Path("/dev/full"), "x" * 100_000)


def test_a_result_whose_file_cannot_be_written_is_shown_not_lost(capsys):
    """A search or a measurement that ends on a full disk: its results are printed, the file's text
    follows on stderr, and the error is the last line."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    argv = ["plan", "--model", "demo:150m", "--target", "v5e-8", "--global-batch", "64", "--verify", "0"]
    assert main([*argv, "-o", "/dev/full"]) == 2
    out, err = capsys.readouterr()
    assert "pick: " in out and "wrote" not in out
    *kept, last = err.splitlines()
    assert last.startswith("torsh-jax plan: error: --output: cannot write '/dev/full'"), err
    assert kept[0] == "the file --output names could not be written; its text follows:"
    assert "[batch]" in kept and any(line.startswith("[mesh") for line in kept), err


def test_a_machine_file_that_is_not_one_is_refused_before_the_run_directory_is_made(capsys, tmp_path):
    plan_like = _write(tmp_path, "plan.json", '{"mesh": {"data": 8}}')
    line = _error_line(capsys, ["demo", "--machine", plan_like, "--log-dir", str(tmp_path / "run")])
    assert "--machine: cannot read machine file" in line and "it has no 'links' field" in line
    assert not (tmp_path / "run").exists()


def test_calibrate_refuses_a_model_whose_copy_per_device_cannot_fit(capsys, monkeypatch):
    monkeypatch.setenv("TORSH_JAX_DEVICE_MEMORY", "1GiB")
    line = _error_line(capsys, ["calibrate", "--model", "demo:350m", "--devices", "1"])
    assert "demo:350m needs at least" in line and "but a device has 1.00 GiB" in line, line
    assert "demo:d_model=1024,layers=2" in line


def test_batch_size_written_as_an_exact_float_is_accepted(capsys, tmp_path):
    config = _write(tmp_path, "ds.json", '{"train_batch_size": 16.0}')
    assert main(["translate", config, "--world-size", "8", "--format", "toml"]) == 0
    assert "micro_batch_size = 2" in capsys.readouterr().out


def test_set_takes_plan_fields_after_deepspeed_keys(capsys, tmp_path):
    config = _write(tmp_path, "ds.json", '{"train_batch_size": 16, "zero_optimization": {"stage": 1}}')
    sets = [
        "zero.stage=3",
        "plan.optimizer.gradient_clipping=0.5",
        "optimizer.type=AdamW",
        "optimizer.params.lr=0.01",
    ]
    argv = ["translate", config, "--world-size", "8", "--format", "json", "--set", *sets]
    assert main(argv) == 0
    data = _strict_json(capsys.readouterr().out)
    assert data["plan"]["zero"]["stage"] == 3
    assert data["plan"]["optimizer"]["gradient_clipping"] == 0.5
    assert data["plan"]["optimizer"]["learning_rate"] == 0.01
    notes = {n["key"]: n for n in data["notes"]}
    assert notes["zero.stage"]["status"] == "mapped"


def test_a_closed_pipe_ends_quietly(tmp_path):
    config = _write(tmp_path, "ds.json", '{"train_batch_size": 16}')
    proc = subprocess.run(
        f"{sys.executable} -m torsh_jax translate {config} --world-size 8 --format json | head -n 1",
        shell=True, cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert proc.stdout.strip() == "{"
    assert proc.stderr == ""


def test_simulated_devices_are_bounded_by_host_memory(monkeypatch, capsys):
    monkeypatch.setattr(host, "available_memory_bytes", lambda: 4 * 2**30)
    limit = host.simulated_device_limit()
    assert 100 < limit < 1000
    line = _error_line(capsys, ["demo", "--devices", str(limit + 1), "--steps", "1"])
    assert f"at most {limit:,}" in line and "GiB" in line


def test_demo_zero_steps_compiles_reports_and_trains_nothing(capsys):
    assert main(["demo", "--plan", "zero2", "--devices", "2", "--steps", "0", "--json", *SMALL]) == 0
    out, err = capsys.readouterr()
    summary = _strict_json(out.strip().splitlines()[-1])
    assert summary["steps"] == 0 and summary["final_loss"] is None
    assert summary["memory_per_device_bytes"] > 0 and summary["wire_bytes_per_step"] > 0
    assert err == "", "--json keeps stderr quiet"


def test_demo_progress_goes_to_stderr_as_whole_plain_lines(capsys):
    assert main(["demo", "--plan", "ddp", "--devices", "2", "--steps", "2", "--verify", *SMALL]) == 0
    out, err = capsys.readouterr()
    phases = ["initialising the parameters", "compiling the train step", "compiling the single-device twin"]
    at = [err.find(phase) for phase in phases]
    assert -1 not in at and at == sorted(at) and at[-1] < err.find("step 1/2"), err
    assert " s so far)" in err, "a phase line says how long the run has taken"
    steps = [line for line in err.splitlines() if "step 2/2" in line]
    assert len(steps) == 1 and steps[0].endswith("/device"), err
    assert "\x1b" not in err, "no terminal control codes when stderr is not a terminal"
    assert "compiling" not in out and "final loss" in out and "KiB" in out
    assert re.search(r"within round-off of float64\s+│\s+yes \(loss \S+ <= \S+\)", out), out


def test_plan_errors_come_before_any_progress(capsys):
    assert main(["demo", "--plan", "no_such_plan"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("torsh-jax demo: error: --plan:"), err


def test_inspect_text_uses_binary_units(capsys):
    assert main(["inspect", "--plan", "zero1", "--devices", "2", *SMALL]) == 0
    out, err = capsys.readouterr()
    assert "KiB" in out and " kB" not in out and " MB" not in out
    assert "compiling" in err and "compiling" not in out


def _live_progress(total: int):
    from rich.console import Console

    from torsh_jax.cli.output import Progress

    console = Console(file=io.StringIO(), force_terminal=True, width=120, color_system=None)
    return Progress("training (ddp)", total, live=True, console=console), console.file


def test_live_progress_shows_phases_with_elapsed_time_and_starts_the_bar_at_the_first_step():
    progress, screen = _live_progress(4)
    with progress:
        progress.phase("starting 2 devices")
        progress.phase("compiling the train step")
        before = screen.getvalue()
        progress.step(1, "loss 5.0")
        progress.step(2, "loss 4.0")
    assert "compiling the train step" in before and "0:00:00" in before, before
    assert "%" not in before and "-:--:--" not in before, "no bar at 0% while compiling"
    after = screen.getvalue()[len(before) :]
    assert "50%" in after and "loss 4.0" in after
