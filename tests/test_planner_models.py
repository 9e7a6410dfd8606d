"""The planner on flax models as their authors write them (tests/flax_blocks.py): a tied embedding
and layers under their own key (the GPT-2-style model), parameter names the plan's rules do not know
(all), an nnx model's scanned stack. What a plan splits over ``tensor`` is read from the model's own
parameters, as the runtime lays them out, not assumed."""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from pathlib import Path

import flax.linen as nn
import jax
import pytest
from conftest import require_devices
from flax import nnx
from flax_blocks import GPT2, Llama, NnxLlama, next_token_loss

from torsh_jax import from_linen, from_nnx
from torsh_jax.demo.model import LMConfig, synthetic_tokens
from torsh_jax.planner import model_step_builder
from torsh_jax.planner.cost import predict
from torsh_jax.planner.per_device import local_params, tensor_shares
from torsh_jax.planner.shape import ModelShape, parse_model
from torsh_jax.planner.space import candidates

VOCAB, D_MODEL, SEQ_LEN = 256, 64, 32
CFG = LMConfig(vocab=VOCAB, seq_len=SEQ_LEN)
GPT2_TIED = GPT2(vocab=VOCAB, d_model=D_MODEL, heads=4, layers=2, max_len=SEQ_LEN)
LLAMA_GQA = Llama(vocab=VOCAB, d_model=D_MODEL, heads=4, kv_heads=2, layers=2, hidden=96)
NNX_LLAMA = functools.partial(NnxLlama, VOCAB, D_MODEL, 4, 2, 2, 96)  # made when converted
#: model, the name of its blocks, its MLP width
MODELS = {
    "gpt2-tied": (GPT2_TIED, "blocks", 4 * D_MODEL),
    "llama-gqa": (LLAMA_GQA, "layers", 96),
    "nnx-llama-scanned": (NNX_LLAMA, "layers", 96),
}
TENSOR_PLAN = "ddp data=4 tensor=2 acc=1"
#: the demo model (written with tensor blocks, its names known to the default rules)
DEMO = parse_model("demo:d_model=256,layers=4,vocab=256,seq_len=32")


@functools.cache
def _planned(name: str):
    """The model converted (``from_linen``, ``from_nnx``), its own parameters, its shape and its
    candidates on 8 devices."""
    module, blocks, mlp = MODELS[name]
    example = synthetic_tokens(CFG, batch_size=2, seed=0)
    if isinstance(module, nn.Module):
        params = module.init(jax.random.key(0), example["inputs"])["params"]
        layered = from_linen(module, params, example, loss=next_token_loss, blocks=blocks)
    else:
        model = module(rngs=nnx.Rngs(0))
        params = nnx.state(model, nnx.Param)
        layered = from_nnx(model, example, loss=next_token_loss, blocks=blocks)
    widths = {"d_model": D_MODEL, "seq_len": SEQ_LEN, "vocab": VOCAB, "heads": 4, "mlp": mlp}
    shape = ModelShape.from_model(layered.model, layered.params, **widths)
    found = {c.label: c for c in candidates(shape, devices=8, global_batch=32)}
    return layered, example, params, shape, found


@pytest.mark.parametrize("name", MODELS)
def test_a_flax_models_shape_has_its_layers_key_and_counts_a_tied_embedding_once(name):
    layered, _, params, shape, _ = _planned(name)
    assert shape.layers_key == layered.layers_key and shape.layers == 2
    assert shape.param_count == sum(x.size for x in jax.tree.leaves(params))  # the wte read twice, once
    assert all(path.split("/")[0] in layered.params for path, _ in shape.leaves)


@pytest.mark.parametrize("name", MODELS)
def test_tensor_candidates_split_a_models_layers_whose_names_the_rules_do_not_know(name):
    """Under the default rules (names) the models' blocks stay whole over ``tensor``, so their
    tensor candidates split by shape (``tensor.rules = "auto"``, label ``auto``): every weight of a
    layer but its ``[d]`` vectors (norms, row-parallel biases). The demo model's names are known:
    its candidates keep the names."""
    _, _, _, shape, found = _planned(name)
    tensor = [c for c in found.values() if c.sizes["tensor"] > 1]
    assert tensor and all(c.plan.tensor.rules == "auto" and " auto" in c.label for c in tensor)
    per_layer = [dims[1:] for path, dims in shape.leaves if path.startswith(shape.layers_key + "/")]
    vectors = sum(math.prod(d) for d in per_layer if d == (D_MODEL,))
    layer, _, vocab = tensor_shares(found[TENSOR_PLAN.replace(" acc", " auto acc")], shape)
    assert layer == pytest.approx(1 - vectors / shape.layer_params) and vocab == 1.0
    demo = [c for c in candidates(DEMO, devices=8, global_batch=32) if c.sizes["tensor"] > 1]
    assert demo and all(c.plan.tensor.rules == "names" for c in demo)


def test_a_model_the_compiler_partitions_gets_no_sequence_parallel_candidate_and_the_runtime_refuses_one():
    """Its activations between blocks stay whole: the planner proposes no ``sp`` plan for it, and a
    plan asking for one is one error naming the key, not a step that runs without it."""
    from torsh_jax.errors import NotSupportedYetError

    layered, example, _, shape, found = _planned("llama-gqa")
    assert not shape.tensor_blocks and not any(c.plan.tensor.sequence_parallel for c in found.values())
    assert any(c.plan.tensor.sequence_parallel for c in candidates(DEMO, devices=8, global_batch=32))
    auto = found[TENSOR_PLAN.replace(" acc", " auto acc")]
    asked = auto.plan.replace(tensor=replace(auto.plan.tensor, sequence_parallel=True))
    build = model_step_builder(layered.model, layered.params, example)
    with pytest.raises(NotSupportedYetError, match="sequence parallelism") as refused:
        build(asked, require_devices(8), remat=False)
    assert refused.value.key == "tensor.sequence_parallel"


@pytest.mark.parametrize("name", MODELS)
def test_a_plan_that_keeps_weights_whole_over_tensor_is_costed_whole(name):
    """The same candidate under the names alone: each device holds the parameters the runtime's
    layout gives it (its state bytes, to the byte), and repeats the work of what is kept whole."""
    layered, example, _, shape, found = _planned(name)
    auto = found[TENSOR_PLAN.replace(" acc", " auto acc")]
    named = replace(auto, plan=auto.plan.replace(tensor=replace(auto.plan.tensor, rules="names")))
    build = model_step_builder(layered.model, layered.params, example)
    for c in (auto, named):
        train, _ = build(c.plan, require_devices(8), remat=False)
        held = train.layout.bytes_per_device()["params"]
        assert sum(local_params(c, shape)) * 4 == pytest.approx(held, abs=8)
    layer_auto, layer_named = tensor_shares(auto, shape)[0], tensor_shares(named, shape)[0]
    assert layer_named < 0.5 < layer_auto
    assert predict(named, shape, _machine()).compute_s > 1.3 * predict(auto, shape, _machine()).compute_s


def _machine():
    from torsh_jax.planner.machine import Link, Machine

    return Machine("cpu-8", 8, 1, 1e9, 2**30, {"ici": Link(20e-6, 1e9)}, overlaps=False, platform="cpu")


@pytest.mark.parametrize("model", ["demo", "llama-gqa"])
def test_every_plan_preset_is_a_base_the_candidates_are_made_from(model):
    """A base's own pipeline (interleaved's virtual stages) does not decide which weights its rules
    split: every preset gives candidates, for the demo model and for one the compiler partitions."""
    from torsh_jax.plan import load_plan
    from torsh_jax.plan.presets import names

    shape = DEMO if model == "demo" else _planned(model)[3]
    for name in names("meshes"):
        found = candidates(shape, devices=16, global_batch=64, base=load_plan(name))
        assert any(c.sizes["tensor"] > 1 for c in found), name


#: plans whose peak the compiled gradients decide: ZeRO-3 gathering on use and remat (each layer
#: recomputed), ZeRO-3 over ``tensor``
RECOMPUTING_PLANS = ("zero3 fsdp=8 acc=1", "zero1 fsdp=8 remat acc=1", "zero3 fsdp=4 tensor=2 auto acc=1")


def test_a_models_own_compiled_gradients_predict_its_recomputing_plans_within_5_percent():
    """``compiled_memory(..., gradients=ModelGradients(model, params, example))`` reads the model's
    own activations and recomputing working set (its stack compiled at several depths), not
    the demo model's of the same widths: on the nnx Llama-style model (its scanned stack) the demo
    model's put ZeRO-3 and remat 7-14 % under at these sizes. The GPT-2-style linen model:
    benchmarks/bench_planner_models.py (tests/test_benchmarks_smoke.py)."""
    from torsh_jax.planner import ModelGradients, compiled_memory
    from torsh_jax.planner.cost import optimizer_state_factor
    from torsh_jax.planner.rank import verify

    layered, example, _, shape, found = _planned("nnx-llama-scanned")
    gradients = ModelGradients(layered.model, layered.params, example)
    held = jax.tree.leaves((gradients.params, gradients.example))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in held)  # cached: it must not keep the arrays
    own = compiled_memory(shape, jax.devices()[0], gradients=gradients)
    machine = replace(_machine(), memory_bytes=2**34, **own)
    build = model_step_builder(layered.model, layered.params, example)
    for label in RECOMPUTING_PLANS:
        c = found[label]
        predicted = predict(c, shape, machine, opt_factor=optimizer_state_factor(c.plan))
        compiled = verify(predicted, shape, require_devices(8), build=build)
        assert abs(compiled["memory_error"]) < 0.05, (label, compiled["memory_error"])


@pytest.mark.parametrize("seq_len", [2 * SEQ_LEN, 1])
def test_a_models_gradients_must_be_compiled_at_the_shapes_length(seq_len):
    """Its bytes are read per token at ``shape.seq_len``: an example of another length is one error
    naming the key; a token batch is not a model without a sequence dim (``seq_len`` 1)."""
    from torsh_jax.errors import PlanError
    from torsh_jax.planner import ModelGradients, compiled_memory

    layered, example, _, shape, _ = _planned("llama-gqa")
    with pytest.raises(
        PlanError, match=f"hold \\[{SEQ_LEN}\\] positions, the shape {seq_len} tokens"
    ) as wrong:
        compiled_memory(
            replace(shape, seq_len=seq_len),
            jax.devices()[0],
            gradients=ModelGradients(layered.model, layered.params, example),
        )
    assert wrong.value.key == "seq_len"


def test_a_compiler_partitioned_models_collectives_over_tensor_are_read_from_its_compiled_step():
    """The Llama-style model (grouped key/value heads: 2 over ``tensor = 4``, so some sums run over
    pairs; query, key and value projected apart; each layer recomputed) over ``tensor``: Megatron's
    count, which the tensor blocks place, is 0.69 of what its compiled step sends. Read from the
    model's own step compiled over ``tensor`` alone (2 and 3 layers, 2 batch sizes), the bytes per
    token are the compiled step's; left out are the bytes that do not grow with the tokens (the
    weights XLA gathers where ``tensor`` does not divide the heads: 0.5 % here). A layer's or
    token's collective miscounted moves the ratio by 4 % or more."""
    from torsh_jax.analysis.overlap import collectives_once
    from torsh_jax.planner import PlannedModel
    from torsh_jax.planner.cost import theories

    layered, example, _, shape, found = _planned("llama-gqa")
    planned = PlannedModel(layered.model, layered.params, example, shape)
    c = found["zero1 fsdp=2 tensor=4 auto remat acc=2"]
    counted = planned.with_tensor_counts([c], require_devices(8)).shape
    train, batch = planned.step_builder()(c.plan, require_devices(8), remat=c.remat)
    compiled = collectives_once(train.lower(train.abstract_state(), batch).compile(), train.mesh)
    sent = sum(x.wire_bytes_per_step for x in compiled if x.axes == ("tensor",))
    charged = lambda s: sum(
        x.wire_bytes for t in theories(c, s) for x in t.collectives if x.axes == ("tensor",)
    )
    assert charged(counted) == pytest.approx(sent, rel=0.01)
    assert charged(shape) < 0.75 * sent


def test_reading_an_nnx_models_compiled_gradients_keeps_none_of_its_arrays():
    """``from_nnx``'s loss closes over the model's arrays, and a source's compiled readings are kept
    while it lives: once the model and the source are gone, so are the arrays (before, a cache keyed
    on the source held them, 13 MB on a small Llama). Two sources of the same model compile the
    same programs: the second reads what the first compiled."""
    import gc
    import weakref

    from torsh_jax.planner import ModelGradients, gradients

    example = synthetic_tokens(CFG, batch_size=2, seed=0)
    model = NNX_LLAMA(rngs=nnx.Rngs(0))
    kept = weakref.ref(jax.tree.leaves(nnx.state(model, nnx.Param))[0])
    layered = from_nnx(model, example, loss=next_token_loss, blocks="layers")
    source = ModelGradients(layered.model, layered.params, example)
    temp = gradients.gradient_temp_bytes(source, 1, False, 2, jax.devices()[0])
    again = ModelGradients(layered.model, layered.params, example)
    assert again == source and gradients._READ[again] == {(1, False, 2, jax.devices()[0]): temp}
    del model, layered, source, again
    gc.collect()
    assert kept() is None


def test_a_model_without_a_sequence_dim_compiles_its_gradients_at_one_token_per_example():
    """An MLP's batch (``x [B, 16]``, ``y [B]``) has no sequence dim: at ``seq_len`` 1 its own
    gradients are compiled (before, every ``seq_len`` was refused, so a machine file of the host's
    kind of device could not plan it); at 2 it is still one error."""
    import jax.numpy as jnp

    from torsh_jax.errors import PlanError
    from torsh_jax.planner import ModelGradients, compiled_memory
    from torsh_jax.runtime.layered import LayeredModel

    mlp = LayeredModel(
        lambda p, b: b["x"] @ p["w_in"],
        lambda w, h: h + jnp.tanh(h @ w["w"]),
        lambda p, h, b: jnp.mean(((h @ p["w_out"])[:, 0] - b["y"]) ** 2),
        embed_keys=("w_in",), head_keys=("w_out",), layers_key="layers",
    )  # fmt: skip
    params = {
        "w_in": jnp.zeros((16, 32)),
        "layers": {"w": jnp.zeros((4, 32, 32))},
        "w_out": jnp.zeros((32, 1)),
    }
    gradients = ModelGradients(mlp, params, {"x": jnp.zeros((2, 16)), "y": jnp.zeros((2,))})
    shape = ModelShape.from_model(mlp, params, d_model=32, seq_len=1, vocab=1, heads=1, mlp=32)
    own = compiled_memory(shape, jax.devices()[0], gradients=gradients)
    assert own["compiled_for"] == shape.signature and own["activation_scale"] > 0
    with pytest.raises(PlanError, match="2 tokens"):
        compiled_memory(replace(shape, seq_len=2), jax.devices()[0], gradients=gradients)


def test_a_plain_loss_has_no_stack_to_compile_a_few_layers_of():
    """A plain loss (no stacked layers) cannot give the per-layer programs: one error saying so."""
    import jax.numpy as jnp

    from torsh_jax.errors import PlanError
    from torsh_jax.planner import ModelGradients
    from torsh_jax.runtime.layered import as_model

    plain = ModelGradients(
        as_model(lambda p, b: jnp.sum(p["w"] * b["x"])), {"w": jnp.ones(3)}, {"x": jnp.ones((1, 3))}
    )
    with pytest.raises(PlanError, match="no stacked layers") as refused:
        plain.program(2, remat=False, rows=2)
    assert refused.value.key == "model.layers_key"


#: A module of the user's: the GPT-2-style model as a PlannedModel, for ``plan --model MODULE:NAME``.
PLANNED_MODULE = """
import jax
from flax_blocks import GPT2, next_token_loss
from torsh_jax import from_linen
from torsh_jax.demo.model import LMConfig, synthetic_tokens
from torsh_jax.planner import PlannedModel

def planned():
    module = GPT2(vocab=256, d_model=64, heads=4, layers=2, max_len=32)
    example = synthetic_tokens(LMConfig(vocab=256, seq_len=32), batch_size=2, seed=0)
    params = module.init(jax.random.key(0), example["inputs"])["params"]
    layered = from_linen(module, params, example, loss=next_token_loss, blocks="blocks")
    return PlannedModel.of(layered.model, layered.params, example, name="gpt2-tiny",
                           d_model=64, seq_len=32, vocab=256, heads=4, mlp=256)

not_planned = 3
"""


def test_plan_cli_plans_a_users_model_named_module_colon_name_and_compiles_it_as_itself(
    tmp_path, monkeypatch
):
    """``--model MODULE:NAME`` from the working directory, in a process of its own (the module starts
    JAX: the CLI asks for the machine's simulated devices before importing it): the ranking is of
    that model, the machine's compiled memory is read from its own gradient, its collectives over
    ``tensor`` from its own step, and ``--verify`` compiles its own step (the pick's compiled peak
    is the one its step builder gives)."""
    import json
    import subprocess
    import sys

    from test_multiprocess_train import child_environ

    from torsh_jax.planner.cost import optimizer_state_factor
    from torsh_jax.planner.own_model import load_planned_model
    from torsh_jax.planner.rank import verify

    (tmp_path / "users_gpt2.py").write_text(PLANNED_MODULE)
    machine = _machine()
    (tmp_path / "machine.json").write_text(replace(machine, compiled_for="another model").to_json())
    monkeypatch.chdir(tmp_path)
    args = ["plan", "--model", "users_gpt2:planned", "--machine", "machine.json", "--global-batch", "32"]
    args += ["--devices", "2"]  # tensor = 2 alone: its collectives read from 8 small compiles
    cli = [sys.executable, "-m", "torsh_jax.cli.main", *args, "--verify", "1", "--json", "--top", "1"]
    env = child_environ(tmp_path / "xla") | {"PYTHONPATH": str(Path(__file__).parent)}  # flax_blocks
    done = subprocess.run(cli, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    planned = load_planned_model("users_gpt2:planned")
    assert report["model"]["name"] == "gpt2-tiny" and report["model"]["params"] == planned.shape.param_count
    assert report["machine"]["compiled_gradients"]  # of this model now
    assert report["model"]["tensor_collectives"] == "compiled: the model's step over tensor=2"
    [pick] = [p for p in report["plans"] if p["label"] == report["pick"]]
    found = {c.label: c for c in candidates(planned.shape, devices=2, global_batch=32)}
    c = found[pick["label"]]
    own = predict(c, planned.shape, machine, opt_factor=optimizer_state_factor(c.plan))
    peak = verify(own, planned.shape, require_devices(8)[:2], build=planned.step_builder())["peak"]
    assert pick["compiled"]["peak"] == peak


@pytest.mark.parametrize(
    "spec, says",
    [("no_such_module:planned", "cannot import 'no_such_module'"),
     ("users_gpt2:not_planned", "not a PlannedModel"),
     ("users_gpt2:missing", "has no missing"),
     (":planned", "cannot import ''"),
     ("./users_gpt2.py:planned", "name a module, not a file")],
)  # fmt: skip
def test_plan_cli_says_in_one_line_what_is_wrong_with_a_users_model(
    tmp_path, monkeypatch, capsys, spec, says
):
    from torsh_jax.cli.main import main

    (tmp_path / "users_gpt2.py").write_text(PLANNED_MODULE)
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", spec, "--target", "v5e-8", "--global-batch", "32"]) != 0
    err = capsys.readouterr().err.strip()
    assert says in err and "--model" in err and len(err.splitlines()) == 1, err
