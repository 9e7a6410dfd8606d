"""Compiling for accelerators this machine does not have (``torsh_jax.targets``, ``inspect --target``).

Target names map to the cloud's topologies; bad names and a missing compiler are one line. With
``libtpu`` installed, steps compile for TPU v5e: a ZeRO-3 step fits with the compiler's memory
figures, a step whose temporaries exceed HBM is a result (``fits`` false, the compiler's figure,
exit code 0), a multi-slice target compiles, and what the compiler's cost analysis counts is
checked against a hand count. GPU targets compile where the CUDA plugin is importable (``.ci/run``
installs it beside the test environment); elsewhere those tests skip, saying what to install.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from torsh_jax.cli.main import main
from torsh_jax.errors import TargetError
from torsh_jax.runtime.inspect import headline
from torsh_jax.targets import (
    CHIPS,
    devices,
    missing_compiler,
    parse_out_of_memory,
    parse_target,
    target_devices,
)

#: The smallest demo model (its step compiles in seconds for 16 TPU chips).
SMALL = ["--layers", "1", "--d-model", "16"]


def _needs(target: str) -> None:
    missing = missing_compiler(target)
    if missing is not None:
        pytest.skip(missing)


def _inspect(capsys, *argv: str) -> tuple[int, dict]:
    """``inspect ... --json``'s exit code and its ``target`` report; the whole summary is the
    report's ``"summary"``."""
    code = main(["inspect", *argv, "--json"])
    out = capsys.readouterr().out
    if code != 0:
        return code, {}
    summary = json.loads(out)
    return code, {**summary["target"], "summary": summary}


@pytest.mark.parametrize(
    ("name", "chips", "topology", "accelerator"),
    [
        ("v5e-16", 16, "v5e:4x4", "v5litepod-16"),
        ("v5litepod-256", 256, "v5e:16x16", "v5litepod-256"),
        ("v4-8", 4, "v4:2x2x1", "v4-8"),
        ("v4-32", 16, "v4:2x2x4", "v4-32"),
        ("v4-64", 32, "v4:2x4x4", "v4-64"),
        ("v5p-128", 64, "v5p:4x4x4", "v5p-128"),
        ("v6e-64", 64, "v6e:8x8", "v6e-64"),
        ("h100-8", 8, "1x1x8", ""),
        ("h100-16", 16, "2x1x8", ""),
        ("a100-8", 8, "1x1x8", ""),
    ],
    ids=lambda v: str(v),
)
def test_target_names_map_to_the_clouds_topologies(name, chips, topology, accelerator):
    target = parse_target(name)
    assert (target.chips, target.topology, target.accelerator_type) == (chips, topology, accelerator)


def test_slices_multiply_a_tpu_target():
    assert parse_target("v5e-16", slices=4).devices == 64


@pytest.mark.parametrize(
    ("name", "slices", "says"),
    [
        ("v7x-8", 1, "unknown accelerator 'v7x'"),
        ("v5e", 1, "not a target name"),
        ("v5e-12", 1, "a power of two in 4..256"),
        ("v4-4", 1, "TensorCores (2 per chip)"),
        ("v5e-512", 1, "a power of two in 4..256"),
        ("h100-12", 1, "a multiple of 8 GPUs"),
        ("h100-0", 1, "no GPUs"),
        ("a100-000", 1, "no GPUs"),
        ("h100-8", 2, "GPU targets have no slices"),
    ],
    ids=lambda v: str(v),
)
def test_bad_target_is_one_line_with_a_fix(name, slices, says):
    with pytest.raises(TargetError, match="Fix:") as caught:
        parse_target(name, slices=slices)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_cli_bad_target_is_one_line(capsys):
    assert main(["inspect", "--target", "v7x-8", *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown accelerator 'v7x'" in err and "Fix:" in err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--target", "v5e-16", "--devices", "16"], "--devices: the target decides the devices"),
        (["--slices", "2"], "--slices: slices need a TPU target"),
        (["--target", "h100-8", "--slices", "2"], "slices: GPU targets have no slices"),
    ],
    ids=["devices-and-target", "slices-without-target", "gpu-slices"],
)
def test_cli_target_flags_that_do_not_go_together(capsys, argv, says):
    assert main(["inspect", *argv, *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "Fix:" in err


def test_cli_missing_compiler_says_which_extra(capsys, monkeypatch):
    monkeypatch.setitem(devices._COMPILERS, "tpu", ("torsh_jax_no_such_compiler", "tpu-aot"))
    assert main(["inspect", "--target", "v5e-16", *SMALL]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install "torsh-jax[tpu-aot]"' in err and "Traceback" not in err


def test_out_of_memory_messages_parse():
    temporaries = "RESOURCE_EXHAUSTED: ... HLO temporaries (16.94G) exceeds available HBM (15.75G)."
    assert parse_out_of_memory(temporaries) == {"peak": round(16.94 * 2**30), "limit": round(15.75 * 2**30)}
    used = "Ran out of memory in memory space hbm. Used 17.50G of 15.75G hbm. Exceeded hbm capacity by 1.75G."
    assert parse_out_of_memory(used) == {"peak": round(17.5 * 2**30), "limit": round(15.75 * 2**30)}
    assert parse_out_of_memory("INTERNAL: something else") is None


def test_zero3_fits_v5e_16_with_the_compilers_memory(capsys):
    _needs("v5e-16")
    code, target = _inspect(capsys, "--plan", "zero3", "--target", "v5e-16", *SMALL)
    memory = target["memory"]
    assert code == 0 and target["chips"] == 16 and target["fits"] is True
    assert memory["peak"] > 0 and memory["temp"] > 0  # the peak is libtpu's own (test below)
    # the summary's peak is that peak: the headline and the run report read it, not the sum of parts
    # (libtpu's peak is 34.3 MB here, the sum 2.2 MB)
    summary = target["summary"]
    assert summary["memory"]["peak_bytes"] == memory["peak"] == summary["memory"]["compiler_peak_bytes"]
    parts = memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]
    assert headline(summary)["memory_per_device_bytes"] == memory["peak"] != parts
    assert target["hbm_limit_bytes"] == CHIPS["v5e"].compiler_hbm_bytes
    assert target["margin_bytes"] == target["hbm_limit_bytes"] - memory["peak"]
    assert target["flops"] > 0 and target["roofline_step_s"] >= target["flops"] / CHIPS["v5e"].peak_bf16_flops
    assert target["compiler_message"] is None
    overlap = target["overlap"]  # from the TPU compiler's schedule
    assert overlap["scheduled"] is True and overlap["count"] > 0 and 0.0 <= overlap["fraction"] <= 1.0
    assert set(overlap["by_kind"]) >= {"all-gather"} and set(overlap["by_axes"]) == {"fsdp"}
    # one layer: no layer scan, every collective is the step's own
    assert {place: group["bytes"] for place, group in overlap["by_place"].items()} == {
        "outside_loops": overlap["bytes"]
    }


def test_demo_compiles_for_a_target_only(capsys):
    _needs("v5e-16")
    code = main(["demo", "--plan", "zero3", "--compile-only", "--target", "v5e-16", *SMALL, "--json"])
    target = json.loads(capsys.readouterr().out)["target"]
    assert code == 0 and (target["name"], target["fits"]) == ("v5e-16", True)
    assert main(["demo", "--plan", "zero3", "--target", "v5e-16"]) == 2
    assert "add --compile-only" in capsys.readouterr().err


def test_step_over_hbm_is_a_result_with_the_compilers_figures(capsys):
    """Logits of 4,096 tokens x 2**19 vocabulary entries per chip: temporaries over 15.75 GiB."""
    _needs("v5e-4")
    argv = ["--plan", "ddp", "--target", "v5e-4", "--layers", "1", "--d-model", "16"]
    code, target = _inspect(capsys, *argv, "--vocab", str(2**19), "--seq-len", "4096", "--micro-batch", "1")
    assert code == 0 and target["fits"] is False
    assert "exceeds available HBM" in target["compiler_message"]
    # the limit libtpu states is the catalog's figure for the chip
    assert target["hbm_limit_bytes"] == CHIPS["v5e"].compiler_hbm_bytes
    assert target["memory"]["peak"] > target["hbm_limit_bytes"]
    assert target["margin_bytes"] == target["hbm_limit_bytes"] - target["memory"]["peak"] < 0


def test_multi_slice_target_compiles(capsys):
    _needs("v5e-4")
    code, target = _inspect(capsys, "--plan", "hsdp", "--target", "v5e-4", "--slices", "2", *SMALL)
    assert code == 0 and (target["chips"], target["slices"]) == (8, 2) and target["fits"] is True
    assert target["memory"]["peak"] > 0


@pytest.mark.parametrize("name", ["v4-8", "v5e-4", "v5p-8", "v6e-4"])
def test_catalog_usable_hbm_is_what_libtpu_says(name):
    """A program needing 256 GiB of temporaries: libtpu's refusal states the HBM it may use."""
    mesh = _tpu_mesh(name)
    replicated = NamedSharding(mesh, P())
    program = jax.jit(
        lambda a: jnp.sin(a) + jnp.cos(a) * a, in_shardings=replicated, out_shardings=replicated
    )
    with pytest.raises(jax.errors.JaxRuntimeError) as refused:
        program.lower(jax.ShapeDtypeStruct((2**35,), jnp.float32)).compile()
    target = parse_target(name)
    assert parse_out_of_memory(str(refused.value))["limit"] == target.chip.compiler_hbm_bytes
    assert len(mesh.devices.flat) == target.chips  # one device per chip (v4 and v5p as megacore)


def test_a_tpu_programs_peak_is_libtpus_own_and_its_refusal_counts_the_arguments():
    """libtpu's peak (``peak_memory_in_bytes``) holds the arguments, and so does the figure its
    out-of-memory check states: 8 GiB of arguments compile at a peak of 8 GiB; 20 GiB, with no
    temporaries, are refused at 20 GiB. The report's ``peak`` is libtpu's."""
    from torsh_jax.targets.report import _memory

    _needs("v5e-4")
    target = parse_target("v5e-4")
    one_chip = jax.sharding.SingleDeviceSharding(target_devices(target)[0])

    def head(gib: int):
        x = jax.ShapeDtypeStruct((gib * 2**28,), jnp.float32, sharding=one_chip)
        return jax.jit(lambda a: a[:1024] * 2).lower(x)

    compiled = head(8).compile()
    stats = compiled.memory_analysis()
    assert stats.peak_memory_in_bytes == 8 * 2**30 + stats.output_size_in_bytes
    assert _memory(compiled, target)["peak"] == stats.peak_memory_in_bytes
    with pytest.raises(jax.errors.JaxRuntimeError) as refused:
        head(20).compile()
    assert parse_out_of_memory(str(refused.value)) == {
        "peak": 20 * 2**30,
        "limit": target.chip.compiler_hbm_bytes,
    }


def _tpu_mesh(name: str) -> Mesh:
    _needs(name)
    return Mesh(np.array(target_devices(name)), ("d",))


def test_tpu_cost_analysis_counts_one_device_after_partitioning():
    """A [8192, 4096] @ [4096, 8192] matmul split 16 ways: 2*512*4096*8192 FLOPs per chip."""
    mesh = _tpu_mesh("v5e-16")
    rows = NamedSharding(mesh, P("d", None))
    matmul = jax.jit(lambda a, b: a @ b, in_shardings=(rows, NamedSharding(mesh, P())), out_shardings=rows)
    a, b = jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16)
    assert matmul.lower(a, b).compile().cost_analysis()["flops"] == 2 * 512 * 4096 * 8192


def test_tpu_cost_analysis_counts_a_loop_body_once():
    """Why ``mfu_bound`` is ``None`` for programs with while loops (the layer scan)."""
    mesh = _tpu_mesh("v5e-4")
    x = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

    def flops(trips: int) -> float:
        scan = lambda w: jax.lax.scan(lambda c, _: (c @ w, None), w, length=trips)[0]
        return jax.jit(scan).lower(x).compile().cost_analysis()["flops"]

    assert flops(4) == flops(2)


def _needs_gpu(target: str) -> None:
    _needs(target)
    try:
        target_devices(target)
    except TargetError as err:
        pytest.skip(str(err))


@pytest.mark.parametrize("name", ["h100-8", "a100-8"])
def test_gpu_target_compiles_and_fits(capsys, default_gpu_memory, name):
    """Held to the share of each GPU's memory a JAX process's allocator takes (75 % unset)."""
    _needs_gpu(name)
    code, target = _inspect(capsys, "--plan", "zero3", "--target", name, *SMALL)
    assert code == 0 and target["platform"] == "gpu" and target["chips"] == 8 and target["fits"] is True
    assert target["hbm_limit_bytes"] == int(0.75 * CHIPS[name.split("-")[0]].compiler_hbm_bytes)
    assert "75 % of each GPU's" in target["hbm_limit_source"]


def _on_h100(model: str, label: str) -> tuple[Callable[[], dict], int]:
    """``(compile, seq_len * vocab)``: ``compile()`` compiles candidate ``label`` of ``model`` (8
    devices, global batch 64) for h100-8 and returns its ``verify`` figures."""
    from torsh_jax.planner.cost import predict
    from torsh_jax.planner.machine import Machine
    from torsh_jax.planner.rank import verify
    from torsh_jax.planner.shape import parse_model
    from torsh_jax.planner.space import candidates

    _needs_gpu("h100-8")
    shape, machine = parse_model(model), Machine.from_target("h100-8")
    [plan] = [c for c in candidates(shape, devices=8, global_batch=64) if c.label == label]
    devices, target = target_devices("h100-8"), parse_target("h100-8")
    return lambda: verify(
        predict(plan, shape, machine), shape, devices, target=target
    ), shape.seq_len * shape.vocab


def test_a_recomputing_step_on_a_gpu_target_frees_the_logits_gradient_before_the_layers_backward(monkeypatch):
    """The model's loss ties the head's and the hidden state's cotangents (``head_first``), so the
    head's weight gradient is made before the layers' backward: XLA:GPU's peak of a step
    recomputing its layers is lower by about the logits' float32 gradient than without the tie,
    which it held through the layers' backward."""
    from torsh_jax.runtime import layered

    compiled, logits_per_sequence = _on_h100("demo:d_model=1024,layers=2", "zero1 fsdp=8 remat acc=1")
    ordered = compiled()["peak"]
    monkeypatch.setattr(layered, "head_first", lambda head, hidden: (head, hidden))
    logits_gradient = 8 * logits_per_sequence * 4  # 8 sequences a device, float32
    assert compiled()["peak"] - ordered >= 0.9 * logits_gradient


@pytest.mark.parametrize("label", ["zero3 fsdp=8 acc=1", "zero1 fsdp=8 remat acc=1"])
def test_a_recomputing_steps_memory_on_a_gpu_target_is_predicted_from_its_phases(label):
    """A step recomputing its layers finishes the head's backward before theirs, so the formulas
    count the logits beyond one recomputed layer's working set: XLA:GPU's peaks are over that by
    10 % here (the formulas' working set is the CPU's); counting the logits beside it, the ZeRO-3
    step was 61 % over."""
    compiled, _ = _on_h100("demo:d_model=256,layers=2,vocab=8192,seq_len=512", label)
    figures = compiled()
    assert 0 < figures["memory_error"] < 0.15, figures


@pytest.mark.parametrize("name", ["h100-8", "a100-8"])
def test_a_gpus_memory_is_what_its_xla_target_config_states(name):
    """The device memory the GPU compiler is given, not the datasheet's round 80 GiB (an H100
    states 79.10 GiB)."""
    target = parse_target(name)
    config = devices._gpu_config(target.gpu_config)
    [stated] = re.findall(r"device_memory_size: (\d+)", config)
    assert target.chip.compiler_hbm_bytes == int(stated) <= target.chip.hbm_bytes


def test_a_gpu_targets_limit_is_the_share_of_its_memory_jax_allocates(monkeypatch, default_gpu_memory):
    """As jaxlib reads its environment: 75 % unset, the fraction set under either name, the whole
    memory with the on-demand allocator; both names, or a value that is not a fraction, is one
    line naming the variable. A TPU's limit is its compiler's, whatever is set."""
    h100, v5e = parse_target("h100-8"), parse_target("v5e-8")
    device = h100.chip.compiler_hbm_bytes
    assert h100.memory_limit_bytes == int(0.75 * device) and "75 %" in h100.memory_limit_source
    for variable, value, share in (
        ("XLA_CLIENT_MEM_FRACTION", "0.9", 0.9),
        ("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5", 0.5),
        ("XLA_PYTHON_CLIENT_ALLOCATOR", "platform", 1.0),
    ):
        with monkeypatch.context() as env:
            env.setenv(variable, value)
            assert h100.memory_limit_bytes == int(share * device), variable
            assert v5e.memory_limit_bytes == v5e.chip.compiler_hbm_bytes
            # the message names what sets the limit: the fraction, or the allocator with none
            assert ("FRACTION" in h100.memory_limit_source) == (share < 1), h100.memory_limit_source
    for values, says in (({"XLA_CLIENT_MEM_FRACTION": "1.5"}, "not a fraction"),
                         ({"XLA_CLIENT_MEM_FRACTION": "0.9", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"},
                          "set together")):  # fmt: skip
        with monkeypatch.context() as env:
            for variable, value in values.items():
                env.setenv(variable, value)
            with pytest.raises(TargetError, match=says) as refused:
                _ = h100.memory_limit_bytes
            assert "XLA_CLIENT_MEM_FRACTION" in str(refused.value) and "\n" not in str(refused.value)


def test_plan_on_two_gpu_nodes_compiles_its_pick_with_data_across_the_nodes(capsys):
    _needs_gpu("h100-16")
    model = "demo:d_model=64,layers=2,vocab=256,seq_len=32"
    code = main(
        ["plan", "--model", model, "--target", "h100-16", "--global-batch", "32", "--json", "--top", "1"]
    )
    report = json.loads(capsys.readouterr().out)
    pick = next(p for p in report["plans"] if p["label"] == report["pick"])
    assert code == 0 and report["verify"] == 3 and report["unverified"] is None
    assert pick["compiled"]["fits"] and abs(pick["compiled"]["memory_error"]) < 1  # compiled, over 2 nodes
    assert pick["dcn"] and math.prod(pick["dcn"].values()) == 2


def test_a_target_program_compiled_again_with_a_compilation_cache_warns_nothing():
    """With JAX's persistent compilation cache on (the suite's, as ``JAX_COMPILATION_CACHE_DIR``
    sets it), a program for compile-only devices is written there, and compiling it again reads an
    executable their client cannot load: JAX warns and compiles it again. Target compiles say
    nothing of it, and each compile still gives the program's memory."""
    import warnings

    _needs("v5e-4")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one_chip = jax.sharding.SingleDeviceSharding(target_devices("v5e-4")[0])
        x = jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=one_chip)
        peaks = [jax.jit(lambda a: jnp.tanh(a @ a)).lower(x).compile().memory_analysis() for _ in range(2)]
    assert jax.config.jax_compilation_cache_dir  # the cache this is about is on
    assert [str(w.message) for w in caught if "compilation cache" in str(w.message)] == []
    assert all(p.peak_memory_in_bytes >= 512 * 512 * 4 for p in peaks)
