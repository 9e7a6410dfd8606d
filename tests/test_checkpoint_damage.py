"""Checkpoints that cannot be written or read: one typed error or one line, nothing good lost.

Library level, in process: a directory that turns into a file under a running
saver, a damaged ``meta`` item, retention after a damaged step, pending reads of
a damaged step. The CLI and real file-system failures (read-only, full) are in
``tests/test_checkpoint_cli.py``.
"""

from __future__ import annotations

import gc
import json
import logging
import shutil
import sys
import threading
import time

import jax
import pytest
from test_checkpoint import TINY, _shared_step
from test_cli import _error_line

from torsh_jax.checkpoint import (
    Checkpointer,
    continue_plan,
    list_checkpoints,
    restore,
    restore_state,
    show_checkpoint,
)
from torsh_jax.cli.main import main
from torsh_jax.demo.model import init_params
from torsh_jax.errors import CheckpointError, CheckpointUnreadableError


def _state(step: int = 0):
    train = _shared_step("ddp", 1)
    state = train.init(init_params(TINY, jax.random.key(0)))
    return train, state._replace(step=state.step + step)


def _save(directory, steps: list[int], **options) -> None:
    train, state = _state()
    with Checkpointer(directory, **options) as saver:
        for step in steps:
            saver.save(state._replace(step=state.step + step), plan=train.plan)


def _truncate_arrays(step_dir) -> None:
    for data in (step_dir / "state" / "ocdbt.process_0" / "d").iterdir():
        data.write_bytes(data.read_bytes()[:100])


def _orbax_threads_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if type(t).__name__ == "_SignalingThread" and t.is_alive()]


def test_a_save_that_fails_in_the_background_raises_one_line_and_leaves_no_thread_behind(tmp_path, caplog):
    """The directory becomes a file under a running saver: the background save fails. Its error
    is one CheckpointError; no orbax thread is left waiting (they kept the process from exiting)."""
    train, state = _state()
    directory = tmp_path / "ckpt"
    saver = Checkpointer(directory, keep_last=3)
    saver.save(state, plan=train.plan)
    saver.wait()
    shutil.rmtree(directory)
    directory.write_text("in the way")
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as err, caplog.at_level(logging.WARNING):
        saver.save(state._replace(step=state.step + 1), plan=train.plan)
        saver.close()
    message = str(err.value)
    assert "saving step 1 failed" in message and "Not a directory" in message and "Fix:" in message
    assert "\n" not in message
    deadline = time.monotonic() + 5
    while _orbax_threads_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _orbax_threads_alive(), "orbax threads left waiting keep the interpreter from exiting"
    assert time.perf_counter() - start < 10
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "orbax's tracebacks reach the log"
    saver.close()  # closing again is a no-op


@pytest.mark.parametrize("in_the_way", ["file", "parent is a file"])
def test_a_checkpointer_refuses_a_directory_it_cannot_write(tmp_path, in_the_way):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    directory = blocker if in_the_way == "file" else blocker / "ckpt"
    with pytest.raises(CheckpointError, match="is a file|Not a directory") as err:
        Checkpointer(directory)
    assert str(directory) in str(err.value) and "Fix:" in str(err.value)


def test_a_corrupted_meta_in_the_newest_step_falls_back_everywhere(tmp_path, capsys):
    _save(tmp_path, [0, 1])
    (tmp_path / "1" / "meta" / "metadata").write_text('{"format": 1, "st')
    shown = show_checkpoint(tmp_path)
    assert shown["step"] == 0 and "step 1 skipped" in shown["skipped"][0]
    with pytest.raises(CheckpointUnreadableError, match="step 1: its meta item cannot be read"):
        show_checkpoint(tmp_path, step=1)
    train = _shared_step("ddp", 1)
    assert (
        continue_plan(tmp_path, train.plan, num_devices=1).batch == train.plan.batch
    )  # demo --resume's first read
    assert main(["checkpoint", "show", str(tmp_path)]) == 0
    out = capsys.readouterr()[0]
    assert out.startswith("step 1 skipped") and "\nstep 0 (" in out
    restored = restore(tmp_path, train, fallback=True)
    assert restored.step == 0 and restored.skipped == [1] and "JSONDecodeError" in restored.notes[0]


def _edit_meta(step_dir, **fields) -> None:
    path = step_dir / "meta" / "metadata"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _listed(capsys, directory) -> list[dict]:
    assert main(["checkpoint", "list", str(directory), "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr()[0].splitlines()]


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"items": 5}, "items must be a list of item names, got 5"),
        ({"checksums": 7}, "checksums must be an object of item names to objects of array paths"),
        ({"mesh": "x"}, "mesh must be an object of axis sizes (positive integers), got 'x'"),
        ({"plan": None}, "plan must be the plan as TOML text, got None"),
    ],
    ids=["items", "checksums", "mesh", "plan"],
)
def test_a_malformed_meta_field_is_one_line_naming_file_and_field(tmp_path, capsys, fields, says):
    _save(tmp_path, [0, 1])
    _edit_meta(tmp_path / "1", **fields)
    line = _error_line(capsys, ["checkpoint", "show", str(tmp_path), "--step", "1"])
    assert f"{tmp_path}/1/meta/metadata: step 1: its meta item is malformed ({says}" in line
    assert main(["checkpoint", "show", str(tmp_path)]) == 0  # the newest readable step
    out = capsys.readouterr()[0]
    assert out.startswith("step 1 skipped: ") and says in out and "\nstep 0 (" in out
    listed = _listed(capsys, tmp_path)
    assert [(c["step"], c["status"], c["complete"]) for c in listed] == [
        (0, "complete", True), (1, "unreadable", False)
    ]  # fmt: skip
    assert listed[0]["reason"] is None and says in listed[1]["reason"]
    restored = restore(tmp_path, _shared_step("ddp", 1), fallback=True)
    assert restored.step == 0 and says in restored.notes[0]


def test_a_missing_array_metadata_file_is_one_line_saying_so(tmp_path, capsys, caplog):
    _save(tmp_path, [0, 1])
    (tmp_path / "1" / "state" / "_METADATA").unlink()
    with caplog.at_level(logging.WARNING):
        line = _error_line(capsys, ["checkpoint", "show", str(tmp_path), "--step", "1"])
    assert line.endswith(
        f"error: {tmp_path}/1/state: step 1: state/_METADATA is missing, so the saved arrays' shapes "
        "and dtypes cannot be read. Fix: use an earlier complete step (restore with fallback, "
        "checkpoint show falls back to one), or delete the damaged step directory"
    )
    assert not [r.getMessage() for r in caplog.records if "could not be restored" in r.getMessage()]
    assert main(["checkpoint", "list", str(tmp_path)]) == 0
    assert (
        capsys.readouterr()[0]
        .splitlines()[1]
        .endswith(
            f"unreadable ({tmp_path}/1/state: step 1: state/_METADATA is missing, "
            "so the saved arrays' shapes and dtypes cannot be read)"
        )
    )
    assert show_checkpoint(tmp_path)["step"] == 0


def test_a_damaged_step_is_set_aside_and_retention_keeps_good_steps(tmp_path):
    """Steps 2, 4, 6 with step 6 damaged: the resume falls back to 4 and sets 6 aside; saving 6
    and 8 (keep 3) keeps 4, 6, 8, all readable, and deletes 2, the oldest good one."""
    _save(tmp_path, [2, 4, 6], keep_last=3)
    _truncate_arrays(tmp_path / "6")
    train = _shared_step("ddp", 1)
    restored = restore(tmp_path, train, fallback=True)
    assert restored.step == 4 and restored.skipped == [6]
    assert [(c["step"], c["status"]) for c in list_checkpoints(tmp_path)] == [
        (2, "complete"), (4, "complete"), (6, "damaged")
    ]  # fmt: skip
    _save(tmp_path, [6, 8], keep_last=3)
    listed = [(c["step"], c["status"]) for c in list_checkpoints(tmp_path)]
    assert listed == [(4, "complete"), (6, "complete"), (6, "damaged"), (8, "complete")]
    for step in (4, 6, 8):
        assert restore(tmp_path, train, step=step).step == step


def test_the_pending_reads_of_a_damaged_step_print_nothing(tmp_path, monkeypatch, caplog):
    """When one array cannot be read, orbax may leave the step's other reads pending (how many
    depends on timing); each printed "Exception ignored in: <coroutine object
    _read_array_index_and_device_put ...>" and a traceback when collected. Here every read of a
    step also leaves one such coroutine behind, so that it happens on every run. Now: one
    warning line per damaged step, nothing else."""
    _save(tmp_path, [0, 1, 2])
    _truncate_arrays(tmp_path / "1")
    _truncate_arrays(tmp_path / "2")
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    read = restore_state._read

    def read_leaving_a_pending_read(manager, step, args):
        pending = _pending_array_read()
        pending.send(None)  # suspended at its await, as orbax's reads are when another one fails
        return read(manager, step, args)

    monkeypatch.setattr(restore_state, "_read", read_leaving_a_pending_read)
    with caplog.at_level(logging.WARNING, logger="torsh_jax"):
        restored = restore(tmp_path, _shared_step("ddp", 1), fallback=True)
        gc.collect()
    assert restored.step == 0 and restored.skipped == [2, 1]
    assert not reported, [f"{r.object}: {r.exc_value}"[:200] for r in reported]
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("torsh_jax")]
    assert [w.split(";")[0] for w in warnings] == [
        "checkpoint step 2 skipped, set aside as 2.damaged",
        "checkpoint step 1 skipped, set aside as 1.damaged",
    ]
    assert all("\n" not in w for w in warnings)


async def _pending_array_read():
    """Like orbax's ``_read_array_index_and_device_put``: any error, closing included, becomes
    an ``Exception`` naming the read."""
    try:
        await _Suspended()
    except BaseException as err:
        raise Exception("Encountered error while reading array index") from err


class _Suspended:
    def __await__(self):
        yield  # suspends the coroutine here until it is resumed or closed
