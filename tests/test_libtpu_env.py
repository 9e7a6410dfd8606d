"""libtpu's environment on a host without TPUs (``torsh_jax.targets.libtpu_env``): the commands that
start JAX give libtpu what it looks up, so that it starts without warnings; a TPU host, a
variable already set and a target's own accelerator type are left as they are."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import imports_jax

from torsh_jax.cli.main import build_parser
from torsh_jax.targets.libtpu_env import (
    NO_TPU_ACCELERATOR,
    TPU_OVERLAP_FLAGS,
    quiet_for_target,
    quiet_without_tpus,
    tpu_chips,
)

#: What libtpu prints when it starts on a host without TPUs and without these variables.
LIBTPU_START_UP = ("could not determine TPU", "TPU_WORKER_HOSTNAMES")


def test_a_host_without_tpus_names_itself_a_placeholder_type_and_the_overlap_flags():
    """The flags too: libtpu reads them when JAX's backend starts, before any target compiles."""
    env: dict[str, str] = {}
    quiet_without_tpus(env, chips=0, installed=True)
    assert env["LIBTPU_INIT_ARGS"].split() == list(TPU_OVERLAP_FLAGS)
    assert (env["TPU_WORKER_HOSTNAMES"], env["TPU_ACCELERATOR_TYPE"], env["ALLOW_MULTIPLE_LIBTPU_LOAD"]) == (
        "localhost",
        NO_TPU_ACCELERATOR,
        "1",
    )


@pytest.mark.parametrize("chips, installed", [(4, True), (0, False)])
def test_a_tpu_host_or_one_without_libtpu_is_left_as_it_is(chips, installed):
    env: dict[str, str] = {}
    quiet_without_tpus(env, chips=chips, installed=installed)
    assert env == {}


def test_a_host_whose_chips_cannot_be_counted_is_left_as_it_is(monkeypatch):
    monkeypatch.setattr("jax._src.hardware_utils.num_available_tpu_chips_and_device_id", _unreadable)
    env: dict[str, str] = {}
    assert tpu_chips() is None
    quiet_without_tpus(env, installed=True)
    assert env == {}


def _unreadable():
    raise PermissionError("/sys/bus/pci/devices/0000:00:04.0/vendor")


def test_a_target_compiled_on_a_tpu_vm_gets_the_flags_alone():
    env = {"TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"}
    quiet_for_target("v5litepod-16", env, chips=4)
    assert set(env) == {"TPU_WORKER_HOSTNAMES", "LIBTPU_INIT_ARGS"}


def test_variables_already_set_keep_their_values():
    """A user's type stays, even one equal to the placeholder; a host list stays."""
    for given in ("v5p-16", NO_TPU_ACCELERATOR):
        env = {"TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3", "TPU_ACCELERATOR_TYPE": given}
        quiet_without_tpus(env, chips=0, installed=True)
        quiet_for_target("v4-32", env, chips=0)
        assert env["TPU_WORKER_HOSTNAMES"] == "10.0.0.2,10.0.0.3" and env["TPU_ACCELERATOR_TYPE"] == given


def test_a_target_replaces_the_placeholder_and_keeps_a_flag_already_set():
    env: dict[str, str] = {"LIBTPU_INIT_ARGS": "--xla_enable_async_all_gather=false"}
    quiet_without_tpus(env, chips=0, installed=True)
    quiet_for_target("v4-32", env, chips=0)
    assert env["TPU_ACCELERATOR_TYPE"] == "v4-32"
    flags = env["LIBTPU_INIT_ARGS"].split()
    assert flags[0] == "--xla_enable_async_all_gather=false" and len(flags) == len(TPU_OVERLAP_FLAGS)


def test_the_catalog_and_libtpus_environment_load_without_jax():
    assert not imports_jax(
        "from torsh_jax.targets import parse_target, tpu_init_args; import torsh_jax.targets.libtpu_env; "
        "assert parse_target('v5e-16').devices == 16 and tpu_init_args()"
    )


def test_the_commands_that_start_jax_say_so_and_translate_does_not():
    """``launch`` starts none itself, and its processes may start on other hosts (``--slurm``),
    which may have TPUs: it passes the environment on as it is."""
    parser = build_parser()
    commands = (["demo"], ["inspect"], ["plan", "--model", "demo:150m", "--global-batch", "8"],
                ["calibrate"], ["launch", "-n", "2", "x.py"], ["checkpoint", "list", "d"],
                ["translate", "ds.json"], ["report", "r.jsonl"], ["dashboard", "run"])  # fmt: skip
    starts = {argv[0]: getattr(parser.parse_args(argv), "starts_jax", False) for argv in commands}
    assert starts == {
        "demo": True, "inspect": True, "plan": True, "calibrate": True, "launch": False,
        "checkpoint": True, "translate": False, "report": False, "dashboard": False,
    }  # fmt: skip


@pytest.mark.parametrize("quiet", [True, False])
def test_jax_starts_without_libtpus_start_up_warnings_once_quieted(quiet):
    """JAX's backend started as a command starts it (no ``JAX_PLATFORMS``): libtpu's warnings
    are printed without the variables (what the command prevents) and not with them."""
    pytest.importorskip("libtpu", reason="libtpu (the tpu-aot extra) is not installed")
    if tpu_chips():
        pytest.skip("this host has TPUs: libtpu starts as on a TPU VM")
    quieting = "from torsh_jax.targets.libtpu_env import quiet_without_tpus; quiet_without_tpus(); "
    code = f"{quieting if quiet else ''}import jax; print(jax.devices()[0].platform)"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS" and not k.startswith("TPU_")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() != "tpu", run.stderr
    assert any(text in run.stderr for text in LIBTPU_START_UP) is not quiet, run.stderr
