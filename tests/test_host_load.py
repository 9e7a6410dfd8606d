"""How busy the host was while ``calibrate`` measured it (``torsh_jax.planner.host_load``): other
processes' and the hypervisor's share of its cores, kept in the machine file, with a warning (one
line from the CLI) where it comes to ``BUSY_LIMIT`` or more."""

from __future__ import annotations

import subprocess
import sys
import time
import warnings
from dataclasses import replace

import pytest
from conftest import require_devices

from torsh_jax.cli.main import main
from torsh_jax.errors import BusyHostWarning
from torsh_jax.planner import calibrate as calibrate_module
from torsh_jax.planner.host_load import BUSY_LIMIT, CpuSample, HostLoad, HostMeter, host_load, sample
from torsh_jax.planner.machine import Link, Machine

MICRO = "demo:d_model=64,layers=2,vocab=64,seq_len=16"
CPU8 = Machine("cpu-8", 8, 1, 1e9, 2**30, {"ici": Link(20e-6, 1e9)}, overlaps=False, platform="cpu")


def test_other_work_is_the_hosts_busy_time_less_this_processs_over_its_cores():
    before = CpuSample(busy_s=100.0, steal_s=5.0, own_s=10.0, wall_s=0.0)
    after = CpuSample(busy_s=108.0, steal_s=6.0, own_s=16.0, wall_s=4.0)  # 8 s busy, 6 of them ours
    load = host_load(before, after, cores=2)
    assert load == HostLoad(others=2 / 8, steal=1 / 8) and load.busy == pytest.approx(3 / 8)
    # all of it ours: nothing else (the counters' 10 ms ticks cannot make it negative)
    assert host_load(before, replace(after, own_s=18.1), cores=2).others == 0.0
    assert "used 25% of the host's cores and the hypervisor took 12%" in load.describe()


def test_the_meter_sees_another_process_keep_a_core_busy():
    if sample() is None:
        pytest.skip("the host's CPU counters cannot be read here")
    import psutil

    spin = "import time\nend = time.time() + 3\nwhile time.time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.5)  # the child started
        with HostMeter() as meter:
            time.sleep(1.0)
    finally:
        child.kill()
        child.wait()
    # the child holds one core (at least half of one beside other work)
    assert meter.load.others >= 0.5 / psutil.cpu_count()


def _calibrate_with(monkeypatch, load: HostLoad) -> Machine:
    class Meter:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.load = load

    monkeypatch.setattr(calibrate_module, "HostMeter", Meter)
    monkeypatch.setattr(calibrate_module, "_measured", lambda *args: CPU8)
    return calibrate_module.calibrate(require_devices(8), None)


def test_calibrate_keeps_the_hosts_load_and_warns_where_other_work_took_a_share(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error", BusyHostWarning)  # quiet: no warning
        quiet = _calibrate_with(monkeypatch, HostLoad(others=0.001, steal=0.0))
    assert quiet.host_load == {"others": 0.001, "steal": 0.0}
    with pytest.warns(BusyHostWarning, match="other processes used 30%"):
        busy = _calibrate_with(monkeypatch, HostLoad(others=0.3, steal=0.02))
    assert busy.host_load == {"others": 0.3, "steal": 0.02} and 0.32 >= BUSY_LIMIT
    # a machine file keeps it; one written before it has none
    assert Machine.from_json(busy.to_json()) == busy and Machine.from_json(CPU8.to_json()).host_load == {}


def test_the_cli_says_a_busy_host_in_one_line(tmp_path, capsys, monkeypatch):
    require_devices(8)
    load = HostLoad(others=0.3, steal=0.0)

    def calibrate(devices, shape, /, *, repeats, **largest):
        warnings.warn(f"while calibrate measured, {load.describe()}", BusyHostWarning, stacklevel=2)
        return replace(CPU8, recompute_cost=0.9, host_load={"others": 0.3, "steal": 0.0})

    monkeypatch.setattr(calibrate_module, "calibrate", calibrate)
    path = tmp_path / "machine.json"
    assert main(["calibrate", "--model", MICRO, "--repeats", "1", "-o", str(path)]) == 0
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert err == [f"torsh-jax calibrate: warning: while calibrate measured, {load.describe()}"], err
    assert "host 30% busy with other work" in captured.out
    assert Machine.load(path).host_load == {"others": 0.3, "steal": 0.0}


def test_plan_says_when_its_machine_file_was_calibrated_on_a_busy_host(tmp_path, capsys):
    require_devices(8)
    tiny = ["--model", "demo:d_model=256,layers=4,vocab=256,seq_len=32", "--global-batch", "64", "--json"]
    quiet, busy = tmp_path / "quiet.json", tmp_path / "busy.json"
    quiet.write_text(replace(CPU8, host_load={"others": 0.01, "steal": 0.0}).to_json())
    busy.write_text(replace(CPU8, host_load={"others": 0.25, "steal": 0.05}).to_json())
    assert main(["plan", "--machine", str(quiet), *tiny]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and '"others": 0.01' in captured.out  # the JSON's machine.host_load
    assert main(["plan", "--machine", str(busy), *tiny]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    load = HostLoad(others=0.25, steal=0.05)
    assert err == [
        f"torsh-jax plan: warning: {busy} was calibrated while {load.describe()}: its times may be slow; "
        "calibrate again on a quiet host"
    ], err
