"""The run log of a real demo run (one tiny ZeRO-3 run with a profiled window, shared by the tests):
its records against the figures they are computed from, the plan and inspect files, the trace,
compile counting and flushing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import require_devices

from torsh_jax.cli.main import main
from torsh_jax.plan.io import load_plan
from torsh_jax.runlog import RunLog, read_run
from torsh_jax.runlog.files import INSPECT_FILE, PLAN_TOML, RUN_FILE, STEPS_FILE
from torsh_jax.runlog.findings import communication_share

STEPS = 4


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[Path, dict]:
    """The run directory and the demo's summary."""
    from torsh_jax.demo.run import DemoConfig, run_demo

    require_devices(4)
    path = tmp_path_factory.mktemp("run")
    config = DemoConfig(plan="zero3", devices=4, steps=STEPS, layers=2, log_dir=str(path), profile="2:3")
    return path, run_demo(config, emit=lambda record: None)


@pytest.fixture(scope="module")
def run_dir(demo_run) -> Path:
    return demo_run[0]


def _steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / STEPS_FILE).read_text().splitlines()]


def test_step_records_are_computed_from_the_named_figures(demo_run):
    run_dir, summary = demo_run
    header = json.loads((run_dir / RUN_FILE).read_text())
    for key, value in header["inspect_headline"].items():  # the figures the demo prints
        assert summary[key] == value, key
    assert [r["loss"] for r in _steps(run_dir)][-1] == summary["final_loss"] == header["final_loss"]
    records = _steps(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert header["finished"] and header["devices"] == 4 and header["plan"] == "zero3"
    for r in records:
        assert r["tokens_per_s"] == pytest.approx(header["tokens_per_step"] / r["step_time_s"])
        want = r["flops_per_step"] / (r["step_time_s"] * r["peak_flops_per_device"] * header["devices"])
        assert r["mfu"] == pytest.approx(want) and 0 < r["mfu"]
        assert r["flops_source"] == header["flops_source"] and r["peak_flops_source"].startswith("measured")
        assert r["grad_norm"] > 0 and r["loss"] > 0
    # a scanned model: the compiled program has while loops, so the FLOPs are the model's formula
    assert header["while_loops"] > 0 and header["flops_source"].startswith("model")
    assert [r["profiled"] for r in records] == [False, True, True, False]


def test_plan_inspect_and_trace_files(run_dir):
    plan = load_plan(str(run_dir / PLAN_TOML))
    assert plan.zero.stage == 3
    inspected = json.loads((run_dir / INSPECT_FILE).read_text())
    assert inspected["roles"].startswith("ZeRO-3") and inspected["collectives"]
    assert inspected["totals"]["wire_bytes"] > 0 and inspected["memory"]["peak_estimate_bytes"] > 0
    traces = list((run_dir / "profile").rglob("perfetto_trace.json.gz"))
    assert traces and traces[0].stat().st_size > 0
    comm = communication_share(read_run(run_dir))  # the trace's collectives are the step's, by name
    assert comm["source"].startswith("measured") and 0 < comm["seconds_by_axis"]["fsdp"] < comm["step_s"]


def test_each_step_is_on_disk_when_it_ends_and_compiles_are_counted(tmp_path):
    log = RunLog(tmp_path, tokens_per_step=100)
    total = jax.jit(lambda x: (x * 2).sum())
    for step, size in ((1, 3), (2, 3), (3, 5)):  # step 3 has a new shape: a compile
        log.begin(step)
        loss = total(np.ones(size, np.float32))
        record = log.end(step, {"loss": loss, "grad_norm": np.float32(1.5)})
        assert _steps(tmp_path)[-1] == record  # readable before close
    log.close()
    assert [r["compiles"] for r in _steps(tmp_path)] == [1, 0, 1]
    assert all(r["mfu"] is None and r["flops_source"] == "unknown" for r in _steps(tmp_path))


def test_compiles_between_steps_are_not_charged_to_the_next_step(tmp_path):
    log = RunLog(tmp_path, tokens_per_step=100)
    log.begin(1)
    log.end(1, {}, step_time_s=0.1)
    jax.jit(lambda x: x + 1)(np.ones(7, np.float32)).block_until_ready()  # an eval between steps
    log.begin(2)
    assert log.end(2, {}, step_time_s=0.1)["compiles"] == 0
    log.close()


@pytest.mark.parametrize(
    "calls, says",
    [(("end",), "end(1) without begin(1)"), (("begin", "end"), "step_time_s=0.0")],
    ids=["end-without-begin", "zero-step-time"],
)
def test_a_step_without_begin_or_time_is_one_line(tmp_path, calls, says):
    from torsh_jax.errors import RunLogError

    log = RunLog(tmp_path, tokens_per_step=100)
    if "begin" in calls:
        log.begin(1)
    with pytest.raises(RunLogError, match=re.escape(says)):
        log.end(1, {}, step_time_s=0.0 if "begin" in calls else None)
    log.close()


def test_a_rerun_moves_the_earlier_profile_aside(tmp_path):
    old = tmp_path / "profile" / "perfetto_trace.json.gz"
    old.parent.mkdir()
    old.write_bytes(b"old")
    RunLog(tmp_path).close()
    assert not (tmp_path / "profile").exists() and read_run(tmp_path).traces == []
    assert (tmp_path / "profile.1" / "perfetto_trace.json.gz").read_bytes() == b"old"


def test_only_process_0_writes(tmp_path, monkeypatch):
    from torsh_jax.runlog import log as log_module

    monkeypatch.setattr(log_module, "_is_process_0", lambda: False)
    log = RunLog(tmp_path / "run", tokens_per_step=100, profile="1:1")
    log.begin(1)
    assert log.end(1, {"loss": 2.0}, step_time_s=0.5)["tokens_per_s"] == 200.0
    log.close()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--profile", "2:3"], "--profile: needs a run directory"),
        (["--log-dir", "LOG", "--profile", "5:2"], "--profile: steps 5 to 2"),
        (["--log-dir", "FILE"], "--log-dir: cannot write the run directory"),
        (["--log-dir", "LOG", "--machine", "FILE"], "--machine: cannot read machine file"),
    ],
    ids=["profile-without-dir", "window-backwards", "dir-is-a-file", "machine-not-json"],
)
def test_bad_log_options_are_one_line(capsys, tmp_path, argv, says):
    (tmp_path / "FILE").write_text("")
    argv = [str(tmp_path / a) if a in ("LOG", "FILE") else a for a in argv]
    assert main(["demo", "--devices", "1", "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "Fix:" in err


def test_demo_model_flops_are_the_planners_count():
    from torsh_jax.demo.model import LMConfig, init_params
    from torsh_jax.demo.runlog import model_flops_per_step
    from torsh_jax.planner.shape import ModelShape

    cfg = LMConfig(layers=3, d_model=32, heads=2, head_dim=16, mlp=128)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    widths = {"d_model": 32, "seq_len": cfg.seq_len, "vocab": cfg.vocab, "heads": 2, "mlp": 128}
    per_token = ModelShape.from_params(shapes, **widths).train_flops_per_token(recompute=False)
    assert model_flops_per_step(cfg, shapes, 1000) == pytest.approx(per_token * 1000)


# --- the report and the dashboard (the same run) -------------------------------------------------


def _loss_points(html: str) -> int:
    """Data points of the loss chart in a page or part."""
    return html.split('data-key="loss"', 1)[1].split("</svg>", 1)[0].count('class="pt"')


def _report(run_dir: Path, out: Path, *more: Path) -> str:
    assert main(["report", str(run_dir), *map(str, more), "-o", str(out)]) == 0
    return out.read_text()


def test_the_report_is_one_offline_file_with_a_point_per_step(run_dir, tmp_path, capsys):
    html = _report(run_dir, tmp_path / "report.html")
    assert "<script" not in html and "<link" not in html and " src=" not in html and "url(" not in html
    assert _loss_points(html) == STEPS
    traces = [line for line in html.split('href="')[1:] if "perfetto_trace.json.gz" in line.split('"')[0]]
    assert traces and (tmp_path / traces[0].split('"')[0]).resolve().is_file()  # relative to the page
    both = _report(run_dir, tmp_path / "compare.html", run_dir)
    assert _loss_points(both) == 2 * STEPS
    assert "B / A" in both


def test_report_of_a_directory_without_a_run_is_one_line(capsys, tmp_path):
    assert main(["report", str(tmp_path), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a run directory" in err and "Fix:" in err


def test_report_of_a_file_says_it_is_a_file(capsys, tmp_path):
    (tmp_path / RUN_FILE).write_text('{"devices": 1}')
    assert main(["report", str(tmp_path / RUN_FILE), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "it is a file, not a directory" in err and "Fix:" in err


@pytest.fixture
def dashboard(run_dir, tmp_path):
    """A dashboard on a copy of the run (its last step held back), on a free port of 127.0.0.1."""
    import shutil
    import threading

    from torsh_jax.runlog.dashboard import make_server

    live = tmp_path / "live"
    shutil.copytree(run_dir, live)
    lines = (live / STEPS_FILE).read_text().splitlines(keepends=True)
    (live / STEPS_FILE).write_text("".join(lines[:-1]))
    server = make_server(live, port=0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", live, lines[-1]
    server.shutdown()
    server.server_close()


def _status(url: str, method: str = "GET") -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.mark.parametrize(
    "path",
    [
        "/files/..%2f..%2fetc%2fpasswd",
        "/files/%2e%2e/%2e%2e/etc/passwd",
        "/files/%2fetc%2fpasswd",
        "/files/..%5c..%5crun.json",
        "/files/%252e%252e/run.json",
        "/files/profile",
        "/files/../run.json",
    ],
)
def test_dashboard_serves_only_files_of_the_run(dashboard, path):
    import http.client

    url, _, _ = dashboard
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.request("GET", path)  # sent as written: no client-side normalisation
    assert connection.getresponse().status == 404
    assert _status(url + "/files/run.json") == 200


def test_dashboard_is_read_only(dashboard):
    url, live, _ = dashboard
    before = {p: p.stat().st_mtime_ns for p in live.rglob("*")}
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        assert _status(url + "/api/parts", method) == 405
    assert _status(url + "/") == 200 and _status(url + "/api/steps?after=0") == 200
    assert {p: p.stat().st_mtime_ns for p in live.rglob("*")} == before


def _get(url: str, path: str, *, host: str | None = None) -> tuple[int, bytes]:
    import http.client

    address, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(address, int(port), timeout=10)
    connection.putrequest("GET", path, skip_host=host is not None)
    if host is not None:
        connection.putheader("Host", host)
    connection.endheaders()
    answer = connection.getresponse()
    return answer.status, answer.read()


@pytest.mark.parametrize(
    "host, status",
    [("evil.example:{port}", 403), ("127.0.0.1:1", 403), ("localhost:{port}", 200), ("[::1]:{port}", 200)],
    ids=["rebound-name", "other-port", "localhost", "ipv6-loopback"],
)
def test_dashboard_on_loopback_answers_only_its_own_host(dashboard, host, status):
    url, _, _ = dashboard
    port = url.rsplit(":", 1)[1]
    assert _get(url, "/api/steps", host=host.format(port=port))[0] == status


def test_a_malformed_after_is_a_bad_request(dashboard):
    url, _, _ = dashboard
    assert _get(url, "/api/parts?after=%C2%B2")[0] == 400  # "²": a digit to str.isdigit, not to int


def test_a_trace_linked_out_of_the_run_is_not_listed(dashboard, tmp_path):
    url, live, _ = dashboard
    outside = tmp_path / "elsewhere.trace.json.gz"
    outside.write_bytes(b"secret")
    (live / "profile" / "out.trace.json.gz").symlink_to(outside)
    status, body = _get(url, "/")
    assert status == 200 and b"out.trace.json.gz" not in body and b"perfetto_trace.json.gz" in body


def test_dashboard_binds_ipv6_and_a_bad_host_names_the_host(tmp_path):
    import socket

    from torsh_jax.errors import RunLogError
    from torsh_jax.runlog.dashboard import make_server

    with pytest.raises(RunLogError, match="--host.*Fix: pass --host 127.0.0.1"):
        make_server(tmp_path, host="256.0.0.1", port=0)
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        server = make_server(tmp_path, host="::1", port=0)
    except RunLogError as err:
        pytest.skip(f"no IPv6 loopback here: {err}")
    assert server.address_family == socket.AF_INET6 and server.server_address[0] == "::1"
    server.server_close()


# --- in headless Chromium (skipped without playwright or the system's chromium) --------------------

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    sync_api = pytest.importorskip("playwright.sync_api", reason='pip install "torsh-jax[report]"')
    if not Path(CHROMIUM).exists():
        pytest.skip("no /usr/bin/chromium (apt-get install chromium)")
    with sync_api.sync_playwright() as driver:
        profile = tmp_path_factory.mktemp("chromium-profile")
        context = driver.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS
        )
        yield context
        context.close()


class _Watched:
    """A page with every request and every console error it makes recorded."""

    def __init__(self, context):
        self.page, self.requests, self.errors = context.new_page(), [], []
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))

    def points(self, key: str = "loss") -> int:
        return self.page.locator(f'[data-key="{key}"] circle.pt').count()

    def distinct_colours(self, selector: str) -> int:
        """Distinct byte values of the element's screenshot, decoded (one value: a blank picture)."""
        import struct
        import zlib

        png = self.page.locator(selector).first.screenshot()
        chunks, at = [], 8
        while at < len(png):
            size, kind = struct.unpack(">I4s", png[at : at + 8])
            chunks += [png[at + 8 : at + 8 + size]] if kind == b"IDAT" else []
            at += size + 12
        return len(set(zlib.decompress(b"".join(chunks))))


def _only_local(urls: list[str]) -> bool:
    return all(u.startswith(("file:", "http://127.0.0.1:", "data:", "about:")) for u in urls)


def test_report_in_chromium(browser, run_dir, tmp_path):
    out = tmp_path / "report.html"
    _report(run_dir, out)
    watched = _Watched(browser)
    watched.page.goto(out.as_uri())
    watched.page.wait_for_load_state("load")
    assert watched.errors == [] and _only_local(watched.requests), (watched.errors, watched.requests)
    assert watched.points("loss") == STEPS and watched.points("step_time_s") == STEPS
    assert watched.distinct_colours('[data-key="loss"] svg') > 2
    assert watched.distinct_colours("#breakdown svg") > 2
    watched.page.close()


def test_dashboard_in_chromium_shows_a_new_step_within_2_s(browser, dashboard):
    import time

    url, live, last_line = dashboard
    watched = _Watched(browser)
    watched.page.goto(url + "/")
    assert watched.points() == STEPS - 1
    with (live / STEPS_FILE).open("a") as steps:
        steps.write(last_line)
    logged = time.perf_counter()
    watched.page.wait_for_function(
        f"document.querySelectorAll('[data-key=loss] circle.pt').length == {STEPS}", timeout=2000
    )
    assert time.perf_counter() - logged < 2.0
    assert watched.distinct_colours('[data-key="loss"] svg') > 2
    assert watched.errors == [] and _only_local(watched.requests), (watched.errors, watched.requests)
    assert any("/api/parts" in u for u in watched.requests)
    watched.page.close()


def test_run_log_of_a_user_loop_counts_the_compiled_programs_flops(tmp_path, fusion_emitters):
    """A step without a loop: its FLOPs are ``cost_analysis``'s (with XLA:CPU's default code; the
    legacy emitters run the embedding's gradient scatter as a loop, whose FLOPs it counts once)."""
    if fusion_emitters:  # passed in a process of its own
        return
    import optax

    from torsh_jax.demo.model import LMConfig, init_params, loss_fn, synthetic_tokens
    from torsh_jax.runtime.mesh import build_mesh
    from torsh_jax.runtime.step import make_train_step

    cfg, plan = LMConfig(layers=1, d_model=16, heads=1, head_dim=16, mlp=32), load_plan("ddp")
    mesh = build_mesh(plan, require_devices(2)[:2])
    params = init_params(cfg, jax.random.key(0))
    train = make_train_step(loss_fn(cfg), optax.sgd(0.1), plan, mesh, params)  # a plain loss: no loop
    state, batch = train.init(params), synthetic_tokens(cfg, batch_size=train.global_batch_size, seed=0)
    with RunLog.for_step(tmp_path, train, state, batch, tokens_per_step=64, peak_flops=1e9) as log:
        log.begin(1)
        state, metrics = train.step(state, batch)
        record = log.end(1, metrics)
    counted = train.lower(state, batch).compile().cost_analysis()["flops"]
    assert record["flops_source"] == "cost_analysis" and record["flops_per_step"] == counted * 2
    assert record["peak_flops_source"] == "given" and record["mfu"] == pytest.approx(
        counted * 2 / (record["step_time_s"] * 1e9 * 2)
    )
    assert json.loads((tmp_path / RUN_FILE).read_text())["finished"]


def test_tensorboard_scalars_are_written_or_skipped_with_a_reason(tmp_path):
    log = RunLog(tmp_path, tensorboard=True)
    log.begin(1)
    log.end(1, {"loss": 1.0}, step_time_s=0.1)
    log.close()
    state = json.loads((tmp_path / RUN_FILE).read_text())["tensorboard"]
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        assert state.startswith("skipped: tensorboardX is not installed")
    else:
        assert state == "written" and list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_a_step_being_written_is_left_out_until_its_line_ends(tmp_path):
    from torsh_jax.runlog.read import read_steps

    (tmp_path / STEPS_FILE).write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.')
    assert [r["step"] for r in read_steps(tmp_path)] == [1]
    with (tmp_path / STEPS_FILE).open("a") as steps:
        steps.write('5}\n{"step": 3, "loss": 1.2}\n')
    assert [r["step"] for r in read_steps(tmp_path, after=1)] == [2, 3]


@pytest.mark.parametrize(
    "header, steps, says",
    [
        ({"devices": 8}, '{"step": "3"}\n', "steps.jsonl line 1: step: must be a positive integer, got '3'"),
        ({"plan": "ddp"}, "", "run.json: devices: missing"),
        ({"devices": 8}, '{"step": 1, "loss": NaN}\n', "steps.jsonl line 1: cannot read"),
        ({"devices": 8}, '{"step": 1}\n{"step": 2, "loss": 1.\n{"step": 3}\n', "steps.jsonl line 2"),
        ({"devices": 8}, '{"step": 1, "step_time_s": "fast"}\n', "step_time_s: must be a number"),
    ],
    ids=["non-integer-step", "missing-header-key", "nan", "broken-middle-line", "text-figure"],
)
def test_a_malformed_run_file_is_one_line_naming_it(tmp_path, capsys, header, steps, says):
    (tmp_path / RUN_FILE).write_text(json.dumps(header))
    (tmp_path / STEPS_FILE).write_text(steps)
    assert main(["report", str(tmp_path), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "Fix:" in err


@pytest.mark.parametrize("name", [RUN_FILE, STEPS_FILE, INSPECT_FILE, PLAN_TOML])
def test_a_run_file_that_is_not_utf8_is_one_line_naming_it(tmp_path, capsys, name):
    (tmp_path / RUN_FILE).write_text('{"devices": 1}')
    (tmp_path / STEPS_FILE).write_text('{"step": 1}\n')
    (tmp_path / name).write_bytes(b'\xff\xfe{"devices": 1, "step": 1}\n')  # UTF-16's byte order mark
    assert main(["report", str(tmp_path), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Fix:" in err
    assert f"{tmp_path / name}" in err and "is not UTF-8 text (byte 0xff at offset 0)" in err


@pytest.mark.parametrize(
    "header, says",
    [(b'{"plan": "ddp"}', b"devices: missing"), (b'{"plan": "\xe9"}', b"run.json: is not UTF-8 text")],
    ids=["missing-key", "not-utf8"],
)
def test_dashboard_of_a_malformed_run_answers_its_one_line(tmp_path, header, says):
    import threading

    from torsh_jax.runlog.dashboard import make_server

    (tmp_path / RUN_FILE).write_bytes(header)
    server = make_server(tmp_path, port=0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for path in ("/", "/api/parts?after=0"):
            status, body = _get(url, path)
            assert status == 500 and says in body and b"Fix:" in body
    finally:
        server.shutdown()
        server.server_close()


def test_dashboard_opened_before_the_run_fills_in(run_dir, tmp_path):
    import shutil
    import threading
    import urllib.request

    from torsh_jax.runlog.dashboard import make_server

    server = make_server(tmp_path, port=0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    read = lambda path: urllib.request.urlopen(url + path, timeout=10).read().decode()
    try:
        assert 'id="curves"' in read("/") and json.loads(read("/api/parts?after=0"))["parts"] is None
        shutil.copytree(run_dir, tmp_path, dirs_exist_ok=True)  # the run starts writing
        parts = json.loads(read("/api/parts?after=0"))
        assert parts["steps"] == STEPS and _loss_points(parts["parts"]["curves"]) == STEPS
    finally:
        server.shutdown()
        server.server_close()


def test_a_datasheet_peak_only_for_a_device_kind_known_exactly():
    from types import SimpleNamespace

    from torsh_jax.runlog.flops import peak_flops
    from torsh_jax.targets.catalog import CHIPS

    device = lambda kind: SimpleNamespace(platform="gpu", device_kind=kind)
    sxm = peak_flops([device("NVIDIA H100 80GB HBM3")])
    assert sxm.peak_flops_per_device == CHIPS["h100"].peak_bf16_flops and "datasheet" in sxm.peak_flops_source
    pcie = peak_flops([device("NVIDIA H100 PCIe")])  # another chip: no figure rather than a wrong one
    assert pcie.peak_flops_per_device is None and pcie.peak_flops_source.startswith("unknown")
