"""Measure the machine the planner predicts for: compute rate, α-β of the links, per-step overhead.

On the present devices (simulated CPU devices, or one host's accelerators):

* **compute**: the demo model's forward and backward pass on every device at once, each on its
  own examples, with no collective (a data-parallel step without its gradient sum): per-device
  FLOP/s = the model's FLOPs per device (:meth:`ModelShape.train_flops_per_token`) / the time;
  the same pass with each layer recomputed (``jax.checkpoint``) over it is ``recompute_cost``, and
  with the layers recomputed in chunks of 2, 4, ... of them (a pipeline stage's backward pass)
  ``chunk_recompute_costs``;
* **links**: ``psum``, ``all_gather`` and ``psum_scatter`` over all devices at sizes from 4 KiB
  to 4 MiB; ``α`` and ``1/β`` are the least-squares fit of ``time = steps · α + wire bytes / β``
  (ring steps and bytes as the cost model counts them), clipped at zero, and each kind's own ``β``
  at that ``α`` (``bytes_per_s_by_kind``: on 8 simulated devices of a 2-core host a ``psum``
  moved a wire byte about 8 times faster than an ``all_gather``);
* **overhead**: a step that does nothing but cross a ``shard_map`` over the devices;
* **micro-step size**: the compute rate again at 1 and 2 examples per device, and at 8, 16, ... up
  to ``max_examples_per_device`` where the plans to be costed run larger micro-steps
  (``flops_per_s_by_tokens``; :func:`rate_rows`), and the recomputing passes' ratios at each size
  (``recompute_costs_by_tokens``: on XLA:CPU the ratio moves with the size, 0.62 to 0.95 for
  layers recomputed one at a time on the benchmark's smaller model);
* **codec**: int8 encode and decode of 1 Mi gradient values on every device at once; top-k's and
  PowerSGD's (their default settings) of 256 Ki values (``codec_s_per_element_by_method``);
* **update**: AdamW's update of 1 Mi parameters on every device at once (``update_bytes_per_s``);
* **activations**: the compiler's temporaries of the model's gradient at four layers minus two, per
  layer, over the cost model's per-layer formula (``activation_scale``), and the working set of one
  layer recomputed in the backward pass (``recompute_scale``, :func:`activation_scales`); and the
  temporaries of the gradient with 1, 2, 4, ... layers at two batch sizes, a pipeline stage's
  backward over its chunk (``chunk_gradient_bytes``, :func:`chunk_gradient_bytes`), and with every
  layer recomputed, ZeRO-3's program (``remat_gradient_bytes``).

Times are medians of ``repeats`` runs after a warm-up; the passes, and the collectives, are each
timed in the same rounds (one call of each in turn), so a drift of the host's speed does not fall
on one of them alone. Other work on the host does fall on them all: one process alone meters it
(``host_load``, :mod:`~torsh_jax.planner.host_load`) and warns where it was busy. On the 2-core
benchmark host, a calibration started as a compile in another process was being stopped put the
smaller model's rate at 4 examples per device 19 % under a quiet one's, and its DDP steps 23 % over
their measured times (benchmarks/README.md, run 14). Nothing here is a constant.

``calibrate(jax.devices(), parse_model("demo:150m"))`` runs all of them (50 small
programs to compile, 12 of them compile-only; tests/test_calibrate_processes.py runs it through
``torsh-jax launch -m torsh_jax calibrate``). The programs of one measurement compile on the host's
cores at once (:func:`~torsh_jax.planner.cores.in_parallel`), before any is timed.

Example:
    >>> [size // 1024 for size in LINK_SIZES]  # KiB per device of the timed collectives
    [4, 16, 64, 256, 1024, 4096]
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, replace
from functools import partial

import numpy as np

from torsh_jax.planner.cores import cpu_share, in_parallel
from torsh_jax.planner.gradients import (
    DemoGradients,
    GradientSource,
    check_tokens_per_example,
    gradient_temp_bytes,
)
from torsh_jax.planner.host_load import HostMeter, warn_if_busy
from torsh_jax.planner.machine import Link, Machine
from torsh_jax.planner.shape import ModelShape

__all__ = [
    "calibrate",
    "check_model_fits",
    "rate_rows",
    "cores_shared",
    "fit_alpha_beta",
    "seconds_in_rounds",
    "activation_scales",
    "chunk_gradient_bytes",
    "remat_gradient_bytes",
    "compiled_memory",
    "LINK_SIZES",
]

#: Bytes per device of the collectives timed for the link fit.
LINK_SIZES = tuple(4096 * 4**k for k in range(6))  # 4 KiB .. 4 MiB
#: Examples per device in the compute measurement.
_ROWS = 4
#: Examples per device of the two programs a line of compiled temporaries goes through (:func:`_temp_line`).
_LINE_ROWS = (_ROWS // 2, _ROWS)
#: Examples per device the compute rate is also measured at (micro-steps smaller than ``_ROWS``).
_RATE_ROWS = (1, 2)


def rate_rows(max_examples_per_device: int = _ROWS) -> tuple[int, ...]:
    """Examples per device the compute rate is measured at: 1, 2, 4, and the powers of two on up
    to the first that reaches ``max_examples_per_device`` (the largest micro-step of the plans to
    be costed: a global batch over the devices). The planner reads the measured size nearest a
    plan's micro-step; on XLA:CPU the rate at 16 examples of the benchmark's medium model was not
    the rate at 4 (benchmarks/README.md, run 12).

    Example:
        >>> rate_rows(), rate_rows(16), rate_rows(12)
        ((1, 2, 4), (1, 2, 4, 8, 16), (1, 2, 4, 8, 16))
    """
    rows = [*_RATE_ROWS, _ROWS]
    while rows[-1] < max_examples_per_device:
        rows.append(2 * rows[-1])
    return tuple(rows)


def _median_seconds(fn, *args, repeats: int) -> float:
    return seconds_in_rounds({None: (fn, args)}, repeats)[None]


def seconds_in_rounds(programs: dict, rounds: int, /) -> dict:
    """Median seconds of each program of ``programs`` (``{key: (fn, args)}``) after a warm-up call
    of each, timed one call of every program in turn per round: a drift of the machine's speed
    during the measurement falls on all of them alike, so the ratios of their times (a
    recomputing pass over a plain one, one size over another) hold.

    Example:
        >>> import jax.numpy as jnp
        >>> programs = {n: (jnp.sin, (jnp.ones(n),)) for n in (8, 8192)}
        >>> found = seconds_in_rounds(programs, 3)
        >>> sorted(found), all(s > 0 for s in found.values())
        ([8, 8192], True)
    """
    import jax

    compiled = in_parallel({key: partial(_compiled, fn, args) for key, (fn, args) in programs.items()})
    programs = {key: (compiled[key], args) for key, (_, args) in programs.items()}
    for fn, args in programs.values():
        jax.block_until_ready(fn(*args))  # warm up
    times: dict = {key: [] for key in programs}
    for _ in range(rounds):
        for key, (fn, args) in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(found) for key, found in times.items()}


def cores_shared(platform: str, devices: int, /, environ=None) -> bool:
    """Whether ``devices`` simulated CPU devices of this process share its cores
    (:func:`~torsh_jax.planner.cores.cpu_share`): more devices than cores, so a device idle in a
    pipeline bubble gives its
    core to the others (:attr:`Machine.shared_cores`). 2 devices on a 2-core host each have a core,
    and their pipelines' bubbles cost time (benchmarks/README.md, run 11).

    Example:
        >>> cores_shared("cpu", cpu_share() + 1), cores_shared("cpu", 1), cores_shared("tpu", 64)
        (True, False, False)
    """
    return platform == "cpu" and devices > cpu_share(environ)


def _compiled(fn, args: tuple):
    """``fn`` compiled for ``args`` (a jitted function), else ``fn`` itself."""
    lower = getattr(fn, "lower", None)
    return fn if lower is None else lower(*args).compile()


def _gradient_program(mesh, shape: ModelShape, *, recompute: str = "none", chunk: int = 1):
    """The demo model's loss and gradient on every device at once, each on its own examples
    (arguments: replicated parameters, a batch split over ``devices``). ``recompute``: ``none``;
    ``layer``, each layer's forward runs again in the backward pass from its saved input
    (``LayeredModel.remat``); ``chunk``, each ``chunk`` layers' forward runs again from their saved
    input, as a pipeline stage recomputes its chunk."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    loss = _loss_recomputing(shape.demo_config(), recompute, chunk)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("devices")), out_specs=P("devices"), check_vma=False)
    def grads_per_device(p, b):
        value, grads = jax.value_and_grad(loss)(p, b)  # the value keeps a checkpointed forward alive
        return (value + jnp.stack([jnp.sum(g) for g in jax.tree.leaves(grads)]))[None]

    return grads_per_device


def _gradient_args(mesh, shape: ModelShape, rows: tuple[int, ...]) -> dict[int, tuple]:
    """The demo model's parameters on every device (one copy, shared) with ``r`` examples per
    device, by ``r`` of ``rows``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from torsh_jax.demo.model import init_params, synthetic_tokens

    cfg = shape.demo_config()
    n = mesh.shape["devices"]
    params = jax.device_put(init_params(cfg, jax.random.key(0)), NamedSharding(mesh, P()))
    split = NamedSharding(mesh, P("devices"))
    batch = lambda r: jax.tree.map(jnp.asarray, synthetic_tokens(cfg, batch_size=r * n, seed=0))
    return {r: (params, jax.device_put(batch(r), split)) for r in rows}


def _loss_recomputing(cfg, recompute: str, chunk: int = 1):
    """The demo model's loss with its layers' forward recomputed per layer, per ``chunk`` layers,
    or not."""
    import jax

    from torsh_jax.demo.model import layered_model
    from torsh_jax.runtime.layered import layered_loss, scan_layers, split_params

    model = layered_model(cfg, remat=recompute == "layer")
    if recompute != "chunk":
        return layered_loss(model)
    one_chunk = jax.checkpoint(lambda stacked, hidden: scan_layers(model.layer, stacked, hidden))

    def loss(params, batch):
        embed, stacked, head = split_params(model, params)
        chunks = jax.tree.map(lambda x: x.reshape(-1, chunk, *x.shape[1:]), stacked)
        hidden = scan_layers(one_chunk, chunks, model.embed(embed, batch))
        return model.head(head, hidden, batch)

    return loss


def chunk_lengths(layers: int, /) -> list[int]:
    """The chunk lengths ``calibrate`` times: the powers of two from 2 that divide ``layers``.

    Example:
        >>> chunk_lengths(8), chunk_lengths(12), chunk_lengths(3)
        ([2, 4, 8], [2, 4], [])
    """
    return [k for k in (2**i for i in range(1, layers.bit_length())) if layers % k == 0]


def _ones(shape: tuple[int, ...], sharding):
    """Float32 ones laid out by ``sharding``; each process makes its own devices' shards (a mesh
    across processes too)."""
    import jax

    return jax.make_array_from_callback(shape, sharding, lambda index: np.ones(shape, np.float32)[index])


def _collective_times(mesh, repeats: int) -> list[tuple[str, int, float]]:
    """(kind, bytes per device, seconds) of ``psum``, ``all_gather`` and ``psum_scatter`` at
    :data:`LINK_SIZES`, timed in the same rounds."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.shape["devices"]
    ops = {
        "all-reduce": lambda x: jax.lax.psum(x, "devices"),
        "all-gather": lambda x: jax.lax.all_gather(x, "devices", tiled=True)[: x.shape[0]] * 2,
        "reduce-scatter": lambda x: jnp.tile(jax.lax.psum_scatter(x, "devices", tiled=True), n),
    }
    sharded = NamedSharding(mesh, P("devices"))
    inputs = {nbytes: _ones((n * nbytes // 4,), sharded) for nbytes in LINK_SIZES}
    programs = {}
    for kind, op in ops.items():
        fn = jax.jit(
            jax.shard_map(op, mesh=mesh, in_specs=P("devices"), out_specs=P("devices"), check_vma=False)
        )
        programs |= {(kind, nbytes): (fn, (x,)) for nbytes, x in inputs.items()}
    seconds = seconds_in_rounds(programs, repeats)
    return [(kind, nbytes, t) for (kind, nbytes), t in seconds.items()]


def fit_alpha_beta(
    samples: list[tuple[str, int, float]], devices: int, /, *, overhead_s: float = 0.0
) -> Link:
    """The least-squares ``Link`` of ``time - overhead = steps · α + wire / β`` over ``samples`` of
    (kind, bytes per device, seconds), ring steps and wire bytes as the cost model counts them; and
    each kind's own ``β`` at that ``α`` (``bytes_per_s_by_kind``).

    Example:
        >>> samples = [("all-reduce", b, 2 * 3 * 1e-5 + 2 * b * 3 / 4 / 1e9) for b in (1e3, 1e6)]
        >>> link = fit_alpha_beta(samples, 4)
        >>> round(link.alpha_s * 1e6, 3), round(link.bytes_per_s / 1e9, 3)
        (10.0, 1.0)
    """
    from torsh_jax.analysis.theory import ring_wire_bytes

    kinds, rows, times = [], [], []
    for kind, nbytes, seconds in samples:
        payload = nbytes * devices if kind == "all-gather" else nbytes  # a gather's output
        steps = 2 * (devices - 1) if kind == "all-reduce" else devices - 1
        kinds.append(kind)
        rows.append([steps, ring_wire_bytes(kind, payload, devices)])
        times.append(max(seconds - overhead_s, 0.0))
    rows, times = np.array(rows, float), np.array(times)
    (alpha, inverse_beta), *_ = np.linalg.lstsq(rows, times, rcond=None)
    alpha = max(float(alpha), 0.0)
    by_kind = {}
    for kind in dict.fromkeys(kinds):
        mine = np.array([k == kind for k in kinds])
        steps, wire = rows[mine].T
        by_kind[kind] = _inverse(float(wire @ (times[mine] - steps * alpha) / (wire @ wire)))
    return Link(alpha, _inverse(float(inverse_beta)), by_kind)


def _inverse(seconds_per_byte: float) -> float:
    """Bytes per second of a fitted seconds per byte (clipped above zero)."""
    return 1.0 / max(seconds_per_byte, 1e-15)


#: Methods whose codec time is measured besides int8 (the planner's compression candidates).
CODEC_METHODS = ("topk", "powersgd")


def _codec_seconds_per_element(mesh, repeats: int, elements: int = 1 << 20, method: str = "int8") -> float:
    """``method``'s encode and decode of ``elements`` gradient values on every device at once, per
    element."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from torsh_jax.compress.factory import make_compressor
    from torsh_jax.plan import CompressorSpec

    codec = make_compressor(CompressorSpec(method=method, error_feedback=False))

    def roundtrip(x):
        payload, _ = codec.compress(x, codec.init(x.shape[0]))
        return codec.decompress(payload)

    fn = jax.jit(jax.shard_map(roundtrip, mesh=mesh, in_specs=P("devices"), out_specs=P("devices")))
    x = jnp.linspace(-1.0, 1.0, mesh.shape["devices"] * elements, dtype=jnp.float32)
    x = jax.device_put(x, NamedSharding(mesh, P("devices")))
    return _median_seconds(fn, x, repeats=repeats) / elements


def _update_bytes_per_s(mesh, repeats: int, elements: int = 1 << 20) -> float:
    """AdamW's update of ``elements`` float32 parameters on every device at once, in the bytes the
    cost model counts for it (:func:`~torsh_jax.planner.cost.update_bytes`) per second."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from torsh_jax.optim.optimizers import build_optimizer
    from torsh_jax.planner.cost import update_bytes

    optimizer = build_optimizer(None)

    def update(params, grads, state):
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    x = jnp.linspace(-1.0, 1.0, mesh.shape["devices"] * elements, dtype=jnp.float32)
    x = jax.device_put(x, NamedSharding(mesh, P("devices")))
    local = jax.ShapeDtypeStruct((elements,), jnp.float32)
    specs = jax.tree.map(lambda a: P("devices") if a.ndim else P(), jax.eval_shape(optimizer.init, local))
    per_device = partial(jax.shard_map, mesh=mesh, check_vma=False)
    init = jax.jit(per_device(optimizer.init, in_specs=P("devices"), out_specs=specs))
    step = jax.jit(
        per_device(update, in_specs=(P("devices"), P("devices"), specs), out_specs=(P("devices"), specs))
    )
    seconds = _median_seconds(step, x, x, init(x), repeats=repeats)
    return update_bytes(elements, param_bytes=4, opt_factor=2) / seconds


def activation_scales(
    shape: ModelShape, device, /, *, gradients: GradientSource | None = None
) -> tuple[float, float]:
    """``(activation_scale, recompute_scale)``: the compiler's bytes per token over the cost model's
    per-layer formula (:func:`~torsh_jax.planner.memory.full_layer_bytes_per_token`) of a layer's
    activations, and of the working set while one layer is recomputed in the backward pass.

    From the temporaries of the model's gradient at two and four layers, plain and with each layer
    recomputed, compiled for ``device`` (one of a target's compile-only devices too: nothing runs):
    with ``plain(L) = C + L F`` and ``recomputed(L) = C + L S + W`` (``F``: a layer's activations,
    ``S``: its saved input, ``W``: the working set), ``W = recomputed(2) - plain(2) + 2 F - 2 S``."""
    from torsh_jax.planner.memory import full_layer_bytes_per_token

    source = _source(shape, gradients)
    plain = [gradient_temp_bytes(source, n, False, _ROWS, device) for n in (2, 4)]
    recomputed = [gradient_temp_bytes(source, n, True, _ROWS, device) for n in (2, 4)]
    full, saved = (plain[1] - plain[0]) / 2, (recomputed[1] - recomputed[0]) / 2
    working = recomputed[0] - plain[0] + 2 * full - 2 * saved
    bits32 = 2  # float32 activations: twice the formula's 16-bit bytes
    formula = full_layer_bytes_per_token(shape) * bits32 * _ROWS * shape.seq_len
    return max(full, 0) / formula, max(working, 0) / formula


def compiled_memory(
    shape: ModelShape,
    device,
    /,
    lengths: tuple[int, ...] | None = None,
    *,
    gradients: GradientSource | None = None,
) -> dict:
    """The :class:`Machine` fields the cost model's memory reads, from programs compiled for
    ``device`` only (nothing runs: a target's compile-only device too): ``activation_scale``,
    ``recompute_scale`` (:func:`activation_scales`), ``chunk_gradient_bytes``,
    ``remat_gradient_bytes`` and ``compiled_for`` (the model they are of); ``lengths``: the chunk
    lengths compiled (:func:`chunk_gradient_bytes`); ``gradients``: the model compiled, the demo
    model of ``shape`` unless given (:class:`~torsh_jax.planner.gradients.ModelGradients`: your
    own, of which ``shape`` is the shape).

    Example (a machine that predicts the memory of the model's plans as this device compiles them;
    about ten small programs, so skipped here: tests/test_planner.py runs it):
        >>> import dataclasses, jax
        >>> from torsh_jax.planner.shape import parse_model
        >>> shape = parse_model("demo:d_model=64,layers=2,vocab=64,seq_len=16")
        >>> found = compiled_memory(shape, jax.devices()[0])  # doctest: +SKIP
        >>> machine = dataclasses.replace(Machine.from_target("v5e-8"), **found)  # doctest: +SKIP
        >>> sorted(machine.chunk_gradient_bytes)  # doctest: +SKIP
        [1, 2]

    Raises:
        PlanError: ``gradients``' examples are not ``shape.seq_len`` tokens long, or its model has
            no stacked layers.
    """
    source = _source(shape, gradients)
    check_tokens_per_example(source, shape.seq_len)
    lengths = lengths or _stage_chunk_lengths(shape)
    programs = _memory_programs(shape, lengths)
    in_parallel({key: partial(gradient_temp_bytes, source, *key, device) for key in programs})
    activations, recomputed = activation_scales(shape, device, gradients=source)  # compiled: cached
    return {
        "activation_scale": activations,
        "recompute_scale": recomputed,
        "chunk_gradient_bytes": chunk_gradient_bytes(shape, device, lengths, gradients=source),
        "remat_gradient_bytes": remat_gradient_bytes(shape, device, gradients=source),
        "compiled_for": shape.signature,
    }


def _source(shape: ModelShape, gradients: GradientSource | None) -> GradientSource:
    """The gradient programs read: ``gradients``, else the demo model of ``shape``."""
    return gradients or DemoGradients(shape)


def _memory_programs(shape: ModelShape, lengths: tuple[int, ...]) -> set[tuple[int, bool, int]]:
    """``(layers, remat, rows)`` of every program :func:`compiled_memory` reads: those of
    :func:`activation_scales` and the lines of :func:`chunk_gradient_bytes` and
    :func:`remat_gradient_bytes` (:func:`_temp_line`)."""
    scales = {(n, remat, _ROWS) for n in (2, 4) for remat in (False, True)}
    lines = {(k, False) for k in lengths} | {(shape.layers, True)}
    return scales | {(layers, remat, rows) for layers, remat in lines for rows in _LINE_ROWS}


def chunk_gradient_bytes(
    shape: ModelShape,
    device,
    /,
    lengths: tuple[int, ...] | None = None,
    *,
    gradients: GradientSource | None = None,
) -> dict[int, tuple[float, float]]:
    """``{k: (fixed, per token)}``: the compiler's temporaries of the model's gradient with ``k``
    layers on ``device`` (``lengths``; by default 1 and :func:`chunk_lengths`), as a line through
    ``_ROWS / 2`` and ``_ROWS`` examples. A pipeline stage's backward is this program on one
    micro-batch: it recomputes its chunk of ``k`` layers from the stashed input, with the
    embedding and head."""
    source = _source(shape, gradients)
    return {k: _temp_line(shape, source, k, device) for k in lengths or _stage_chunk_lengths(shape)}


def _stage_chunk_lengths(shape: ModelShape) -> tuple[int, ...]:
    """Layers of a pipeline stage's chunk :func:`chunk_gradient_bytes` compiles unless told: 1 and
    :func:`chunk_lengths`."""
    return (1, *chunk_lengths(shape.layers))


def remat_gradient_bytes(
    shape: ModelShape, device, /, *, gradients: GradientSource | None = None
) -> tuple[float, float]:
    """``(fixed, per token)``: the compiler's temporaries of the model's gradient with every layer
    recomputed from its saved input, on ``device``: what ZeRO-3 gathering each layer on use runs."""
    return _temp_line(shape, _source(shape, gradients), shape.layers, device, remat=True)


def _temp_line(
    shape: ModelShape, source: GradientSource, layers: int, device, *, remat: bool = False
) -> tuple[float, float]:
    """``(fixed, per token)`` of the gradient's temporaries through ``_ROWS / 2`` and ``_ROWS``
    examples."""
    rows = _LINE_ROWS
    fewer, more = (gradient_temp_bytes(source, layers, remat, r, device) for r in rows)
    per_token = (more - fewer) / ((rows[1] - rows[0]) * shape.seq_len)
    return fewer - per_token * rows[0] * shape.seq_len, per_token


def _pass_seconds(
    mesh, shape: ModelShape, repeats: int, rows: tuple[int, ...]
) -> dict[int, dict[int, float]]:
    """Seconds of the model's loss and gradient on every device at once, by layers recomputed
    together (0: none; 1: each layer on its own, ``LayeredModel.remat``; ``k``: chunks of ``k``, as
    a pipeline stage recomputes its chunk, ``k`` in :func:`chunk_lengths`) and by examples per
    device (``rows``, :func:`rate_rows`), all timed in the same rounds."""
    recompute = {0: "none", 1: "layer"} | {k: "chunk" for k in chunk_lengths(shape.layers)}
    args = _gradient_args(mesh, shape, rows)
    programs = {}
    for k, how in recompute.items():
        fn = _gradient_program(mesh, shape, recompute=how, chunk=k)
        programs |= {(k, rows): (fn, args[rows]) for rows in args}
    seconds = seconds_in_rounds(programs, repeats)
    return {k: {rows: seconds[k, rows] for rows in args} for k in recompute}


def _rates_by_tokens(shape: ModelShape, plain: dict[int, float]) -> dict[int, float]:
    """Per-device FLOP/s of the plain pass by tokens per device, from its seconds by examples."""
    flops = shape.train_flops_per_token(recompute=False)
    return {rows * shape.seq_len: rows * shape.seq_len * flops / seconds for rows, seconds in plain.items()}


def _recompute_costs_by_tokens(shape: ModelShape, seconds: dict[int, dict[int, float]]) -> dict:
    """``{k: {tokens: recomputing pass / plain pass}}`` for every ``k`` > 0 of :func:`_pass_seconds`."""
    plain = seconds[0]
    return {
        k: {rows * shape.seq_len: by_rows[rows] / plain[rows] for rows in by_rows}
        for k, by_rows in seconds.items()
        if k
    }


def devices_per_process(devices, /) -> int:
    """The devices each process of ``devices`` has (the same for all: one slice each).

    Example:
        >>> from types import SimpleNamespace as D
        >>> devices_per_process([D(process_index=p) for p in (0, 0, 1, 1)])
        2

    Raises:
        MeshError: the processes have different counts.
    """
    from collections import Counter

    from torsh_jax.errors import MeshError

    counts = Counter(d.process_index for d in devices)
    if len(set(counts.values())) > 1:
        found = ", ".join(f"process {p}: {n}" for p, n in sorted(counts.items()))
        raise MeshError(
            f"the processes have different device counts ({found}); each is measured as one slice",
            key="devices",
            fix="give every process as many devices (launch --devices-per-process N)",
        )
    return next(iter(counts.values()))


def _process_link(devices, processes: int, repeats: int) -> Link:
    """The ``dcn`` link: the collectives of :func:`_collective_times` over the processes (each
    device with the devices of the same local position in the others), fitted as the ``ici``
    link is; every process runs them."""
    import jax
    from jax.sharding import AxisType

    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    mesh = jax.make_mesh(
        (processes, devices_per_process(devices)),
        ("devices", "local"),
        axis_types=(AxisType.Explicit,) * 2,
        devices=ordered,
    )
    return fit_alpha_beta(_collective_times(mesh, repeats), processes, overhead_s=_overhead(mesh, repeats))


def _overhead(mesh, repeats: int) -> float:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    fn = jax.jit(jax.shard_map(lambda x: x + 1, mesh=mesh, in_specs=P("devices"), out_specs=P("devices")))
    x = _ones((mesh.shape["devices"],), NamedSharding(mesh, P("devices")))
    return _median_seconds(fn, x, repeats=repeats)


def _medium(platform: str, *, across: bool) -> str:
    """What carries a measured link: among one process's devices, or across the job's processes
    (one host's: ``loopback``, as ``torsh-jax launch`` starts them; several hosts' network)."""
    if not across:
        return {"cpu": "shared memory", "gpu": "NVLink", "tpu": "ICI"}.get(platform, platform)
    from torsh_jax.distributed.env import detect_environment

    if detect_environment().num_nodes == 1:
        return "loopback"
    return {"gpu": "InfiniBand", "tpu": "DCN"}.get(platform, "network")


def calibrate(
    devices,
    shape: ModelShape,
    /,
    *,
    repeats: int = 5,
    name: str | None = None,
    max_examples_per_device: int = _ROWS,
) -> Machine:
    """Measure ``devices`` (see the module docstring) and return the :class:`Machine` they are;
    the compute rate up to micro-steps of ``max_examples_per_device`` examples (:func:`rate_rows`).

    ``devices`` of several processes (a job ``torsh-jax launch``, Slurm or Ray started, joined by
    :func:`torsh_jax.distributed.initialize`; every process calls this): each process measures its
    own devices as above, the ``ici`` link among them, and all together the ``dcn`` link across
    the processes (:func:`_process_link`); a process is a slice of the machine. Process 0 alone
    compiles the memory programs (compile-only, the same in every process; its machine is the
    job's): the others' machines have none (``compiled_for`` empty).

    One process alone meters the host while it measures (:attr:`Machine.host_load`) and warns
    (:class:`~torsh_jax.errors.BusyHostWarning`) where other work took a share of it that slows
    the figures (:data:`~torsh_jax.planner.host_load.BUSY_LIMIT`)."""
    import jax

    local = [d for d in devices if d.process_index == jax.process_index()]
    processes = len(devices) // devices_per_process(devices)  # refuses uneven processes first
    with HostMeter() as meter:
        machine = _measured(devices, local, processes, shape, repeats, max_examples_per_device, name)
    if processes > 1:  # the job's other processes share the host by design
        return machine
    warn_if_busy(meter.load, "while calibrate measured")
    return replace(machine, host_load=asdict(meter.load) if meter.load else {})


def check_model_fits(shape: ModelShape, limit, /) -> None:
    """Refuse, before anything is allocated, a model whose float32 parameters and gradients alone
    pass ``limit`` (a :class:`~torsh_jax.runtime.fit.MemoryLimit`, or ``None``: no check):
    calibrate holds a whole copy of both on every device.

    Example:
        >>> from torsh_jax.planner.shape import parse_model
        >>> from torsh_jax.runtime.fit import MemoryLimit
        >>> check_model_fits(parse_model("demo:150m"), MemoryLimit(2**40, "1 TiB"))  # fits: nothing

    Raises:
        DeviceMemoryError: it does not fit; the fix is a smaller model, which measures the same rate.
    """
    from torsh_jax.errors import DeviceMemoryError
    from torsh_jax.units import format_bytes

    need = 8 * shape.param_count
    if limit is None or need <= limit.bytes:
        return
    raise DeviceMemoryError(
        f"{shape.name} needs at least {format_bytes(need)} per device (its float32 parameters and "
        f"gradients, a copy on every device) but a device has {format_bytes(limit.bytes)} "
        f"({limit.source})",
        key="model",
        fix=f"calibrate on fewer layers of the same width (demo:d_model={shape.d_model},layers=2): a layer "
        "computes at the same rate",
    )


def _measured(
    devices, local: list, processes: int, shape: ModelShape, repeats: int, max_examples: int, name: str | None
) -> Machine:
    """What :func:`calibrate` measures, of ``local`` (this process's devices) and the link across
    ``processes``."""
    import jax
    from jax.sharding import AxisType

    from torsh_jax.runtime.fit import device_memory_limit

    # a ``tensor`` axis of 1: the demo model's tensor blocks read its size
    mesh = jax.make_mesh(
        (len(local), 1), ("devices", "tensor"), axis_types=(AxisType.Explicit,) * 2, devices=local
    )
    limit = device_memory_limit(mesh)
    check_model_fits(shape, limit)
    overhead = _overhead(mesh, repeats)
    seconds = _pass_seconds(mesh, shape, repeats, rate_rows(max_examples))
    costs = _recompute_costs_by_tokens(shape, seconds)
    at_rows = _ROWS * shape.seq_len
    rates = _rates_by_tokens(shape, seconds[0])
    platform = devices[0].platform
    inside = fit_alpha_beta(_collective_times(mesh, repeats), len(local), overhead_s=overhead)
    links = {"ici": replace(inside, medium=_medium(platform, across=False))}
    if processes > 1:
        links["dcn"] = replace(
            _process_link(devices, processes, repeats), medium=_medium(platform, across=True)
        )
    across = f" in {processes} processes" if processes > 1 else ""
    return Machine(
        name=name or f"{platform}-{len(devices)} (calibrated)",
        devices=len(devices),
        slices=processes,
        flops_per_s=rates[at_rows],
        flops_per_s_by_tokens=rates,
        recompute_cost=costs[1][at_rows],
        chunk_recompute_costs={k: by_tokens[at_rows] for k, by_tokens in costs.items() if k > 1},
        recompute_costs_by_tokens=costs,
        memory_bytes=limit.bytes if limit else 0,
        links=links,
        overlaps=platform != "cpu",
        shared_cores=cores_shared(platform, len(local)),
        step_overhead_s=overhead,
        codec_s_per_element=_codec_seconds_per_element(mesh, repeats),
        update_bytes_per_s=_update_bytes_per_s(mesh, repeats),
        codec_s_per_element_by_method={
            m: _codec_seconds_per_element(mesh, repeats, 1 << 18, method=m) for m in CODEC_METHODS
        },
        **(compiled_memory(shape, local[0]) if jax.process_index() == 0 else {}),
        platform=platform,
        source=f"torsh-jax calibrate on {len(devices)} {platform} devices{across} with {shape.name}",
    )
