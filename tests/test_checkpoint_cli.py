"""``torsh-jax demo --checkpoint-dir/--save-every/--resume`` and ``torsh-jax checkpoint list|show``."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from test_cli import ENV, SMALL, _error_line, _strict_json

from torsh_jax.checkpoint import list_checkpoints, restore
from torsh_jax.cli.main import main

DEMO = ["demo", "--plan", "zero3", "--devices", "4", "--json", *SMALL]


def _steps(capsys, argv: list[str]) -> tuple[list[dict], dict]:
    assert main(argv) == 0
    out, _ = capsys.readouterr()
    records = [_strict_json(line) for line in out.strip().splitlines()]
    return records[:-1], records[-1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple:
    """``DEMO --steps 2 --save-every 1`` once for the module: its checkpoint directory (tests that
    write copy it), its per-step records and its summary."""
    directory = tmp_path_factory.mktemp("saved")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*DEMO, "--steps", "2", "--save-every", "1", "--checkpoint-dir", str(directory)]) == 0
    records = [_strict_json(line) for line in out.getvalue().strip().splitlines()]
    return directory, records[:-1], records[-1]


def test_demo_resumes_on_the_batches_it_would_have_seen_also_on_fewer_devices(capsys, tmp_path, saved):
    straight, straight_summary = _steps(capsys, [*DEMO, "--steps", "4"])
    directory, first, summary = saved
    assert summary["checkpoint_steps"] == [1, 2]
    for copy in ("same", "fewer"):
        shutil.copytree(directory, tmp_path / copy)
    resume = ["--resume", "--checkpoint-dir", str(tmp_path / "same")]
    resumed, summary = _steps(capsys, [*DEMO, "--steps", "4", *resume])
    assert summary["resumed_from_step"] == 2
    assert [r["step"] for r in resumed] == [3, 4], "per-step records carry the global step"
    assert [r["loss"] for r in first + resumed] == [r["loss"] for r in straight]
    # on 2 devices: ZeRO-3 over fsdp=2 with 2 accumulation steps keeps the global batch of 4 x 8
    copy = ["--resume", "--checkpoint-dir", str(tmp_path / "fewer")]
    fewer, summary = _steps(capsys, [*DEMO[:4], "2", *DEMO[5:], "--steps", "4", *copy])
    assert summary["devices"] == 2 and summary["global_batch_size"] == straight_summary["global_batch_size"]
    np.testing.assert_allclose([r["loss"] for r in fewer], [r["loss"] for r in straight[2:]], rtol=1e-5)


def test_a_resumed_runs_log_keeps_the_steps_before_its_checkpoint(capsys, tmp_path):
    """A run that logged steps 1 to 3 and stopped (its checkpoint at step 2), resumed to step 4 in
    the same run directory: the log holds steps 1 to 4 once each, 1 and 2 from the first run."""
    from torsh_jax.runlog import read_run

    run, checkpoints = str(tmp_path / "run"), ["--checkpoint-dir", str(tmp_path / "ckpt")]
    _steps(capsys, [*DEMO, "--steps", "2", *checkpoints])
    stopped, _ = _steps(capsys, [*DEMO, "--steps", "3", "--log-dir", run])  # past the checkpoint
    resumed, _ = _steps(capsys, [*DEMO, "--steps", "4", "--resume", *checkpoints, "--log-dir", run])
    logged = read_run(run)
    assert [s["step"] for s in logged.steps] == [1, 2, 3, 4] and logged.header["resumed_from_step"] == 2
    assert [s["loss"] for s in logged.steps] == [r["loss"] for r in [*stopped[:2], *resumed]]


def test_checkpoint_list_and_show(capsys, saved):
    directory = saved[0]
    assert main(["checkpoint", "list", str(directory), "--json"]) == 0
    listed = [json.loads(line) for line in capsys.readouterr()[0].splitlines()]
    assert [(c["step"], c["complete"]) for c in listed] == [(1, True), (2, True)]
    assert main(["checkpoint", "show", str(directory), "--step", "1", "--json"]) == 0
    shown = json.loads(capsys.readouterr()[0])
    assert shown["step"] == 1 and shown["mesh"]["fsdp"] == 4 and 'name = "zero3"' in shown["plan"]
    assert shown["data_position"] == {"next_step": 1, "seed": 0}
    assert any("fsdp" in (p["partition_spec"] or []) for p in shown["params"].values())
    # the step, every parameter and the optimizer's moments carry a checksum
    assert shown["checksummed_arrays"] > 2 * len(shown["params"])
    assert main(["checkpoint", "show", str(directory)]) == 0
    text = capsys.readouterr()[0]
    assert text.startswith("step 2") and "params/embed/embedding" in text
    assert f"checksums: {shown['checksummed_arrays']} arrays" in text


def test_checkpoint_json_is_one_strict_object_per_line(capsys, saved):
    """As docs/cli.md promises for every --json: list, one object per step directory; show, one."""
    directory = saved[0]
    assert main(["checkpoint", "list", str(directory), "--json"]) == 0
    lines = capsys.readouterr()[0].splitlines()
    assert [_strict_json(line)["step"] for line in lines] == [1, 2]
    keys = {"step", "status", "complete", "reason", "path", "bytes_on_disk"}
    assert all(set(_strict_json(line)) == keys for line in lines)
    assert main(["checkpoint", "show", str(directory), "--json"]) == 0
    lines = capsys.readouterr()[0].splitlines()
    assert len(lines) == 1 and _strict_json(lines[0])["step"] == 2


@pytest.mark.parametrize("action", ["list", "show"])
def test_a_file_given_as_checkpoint_directory_is_one_line_saying_so(capsys, tmp_path, action):
    afile = tmp_path / "afile"
    afile.write_text("")
    line = _error_line(capsys, ["checkpoint", action, str(afile)])
    assert f"{afile}: is a file, not a checkpoint directory. Fix:" in line


@pytest.mark.parametrize(
    "argv, says",
    [
        (["demo", "--resume"], "--resume: needs a checkpoint directory"),
        (["demo", "--save-every", "2"], "--save-every: needs a checkpoint directory"),
        (["checkpoint", "show", "/no/such/dir"], "no such checkpoint directory"),
        (["checkpoint", "list", "/no/such/dir"], "no such checkpoint directory"),
    ],
)
def test_bad_checkpoint_arguments_are_one_line_with_a_fix(capsys, argv, says):
    assert says in _error_line(capsys, argv)


def test_a_missing_step_lists_the_complete_ones(capsys, saved):
    argv = ["checkpoint", "show", str(saved[0]), "--step", "9"]
    assert "complete steps: [1, 2]" in _error_line(capsys, argv)


@pytest.mark.parametrize("where", ["a file", "under a file", "under /proc"])
def test_a_checkpoint_dir_that_cannot_be_written_is_one_line_before_compiling(capsys, tmp_path, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    directories = {"a file": blocker, "under a file": blocker / "ckpt", "under /proc": "/proc/torsh-ckpt"}
    directory = directories[where]
    argv = [*DEMO, "--steps", "1", "--checkpoint-dir", str(directory)]
    line = _error_line(capsys, argv)
    assert f"{directory}:" in line and ("is a file" in line or "cannot be written" in line)


def _in_private_mount(setup: str, command: str) -> subprocess.CompletedProcess:
    """``setup`` (mount commands) then ``command`` in a private mount namespace (needs the right to
    mount, e.g. root); skips where that is not possible."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True)
    if probe.returncode:
        pytest.skip(
            "needs unshare -m and mount (root or CAP_SYS_ADMIN) for a real read-only or full file system"
        )
    script = f"set -e; {setup}; set +e; {command}"
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=ENV, timeout=300
    )


TORSH = f"{sys.executable} -m torsh_jax"


def test_a_read_only_checkpoint_dir_or_parent_is_one_line_before_compiling(tmp_path):
    """Root writes through permission bits, so the directory is a read-only bind mount."""
    ro = tmp_path / "ro"
    ro.mkdir()
    mount = f"mount --bind {ro} {ro}; mount -o remount,bind,ro {ro}"
    demo = f"{TORSH} {' '.join(DEMO)} --steps 1 --checkpoint-dir"
    done = _in_private_mount(mount, f"{demo} {ro}/ckpt; echo exit=$?; {demo} {ro}; echo exit=$?")
    fix = "Fix: pass a directory this process can create and write to"
    assert done.stdout.splitlines() == ["exit=2", "exit=2"], done
    assert done.stderr.splitlines() == [
        f"torsh-jax demo: error: {where}: cannot be written: Read-only file system. {fix}"
        for where in (f"{ro}/ckpt", ro)
    ]


def test_a_full_disk_ends_the_run_in_one_line_keeping_the_last_complete_step(tmp_path):
    """A 400 KiB file system holds one checkpoint of the smallest demo, not two: the second save
    fails in the background. The run exits (orbax's waiting threads used to keep it alive),
    non-zero, with one line; step 1 stays complete and the interrupted save is listed as such
    (orbax 0.12.8 names it ``2.orbax-checkpoint-tmp``)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    demo = ["demo", "--plan", "ddp", "--devices", "1", "--json", *SMALL]
    command = (
        f"{TORSH} {' '.join(demo)} --steps 3 --save-every 1 --checkpoint-dir {disk}/ckpt 2>&1 >/dev/null; "
        f"echo exit=$?; cp -a {disk}/ckpt {tmp_path}/kept"
    )
    done = _in_private_mount(f"mount -t tmpfs -o size=400k tmpfs {disk}", command)
    assert done.stdout.splitlines()[1:] == ["exit=2"], done
    error = done.stdout.splitlines()[0]
    assert error.startswith(f"torsh-jax demo: error: {disk}/ckpt: saving step 2 failed (")
    assert "No space left on device" in error and "the newest complete step is 1, left as it was" in error
    listed = [(c["step"], c["status"]) for c in list_checkpoints(tmp_path / "kept")]
    assert listed == [(1, "complete"), (2, "incomplete")]
    assert restore(tmp_path / "kept", _ddp_step()).step == 1


def _ddp_step():
    """The train step of ``demo --plan ddp --devices 1 --layers 1 --d-model 16``."""
    from torsh_jax.demo.model import init_params, layered_model
    from torsh_jax.demo.run import DemoConfig, model_config
    from torsh_jax.optim import build_optimizer
    from torsh_jax.plan.io import load_plan
    from torsh_jax.runtime.mesh import build_mesh
    from torsh_jax.runtime.step import make_train_step

    plan = load_plan("ddp")
    cfg = model_config(DemoConfig(plan=plan, devices=1, layers=1, d_model=16))
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    return make_train_step(
        layered_model(cfg), build_optimizer(plan.optimizer), plan, build_mesh(plan, jax.devices()[:1]), shapes
    )
