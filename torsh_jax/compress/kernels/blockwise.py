"""Pallas kernels of the blockwise quantisers (int8, int4, sign): encode, decode, fused feedback.

``x [N, B] -> values, scales [N, 1]`` on a 1-D grid over row tiles of
``R`` blocks; the kernel bodies call the same tile maths as the reference
(:mod:`torsh_jax.compress.blockmath`), reading and writing column windows
of the refs. ``platform`` picks the lowering:

* ``"tpu"``: Mosaic (``pltpu.CompilerParams``);
* ``"gpu"``: Triton (``pallas.triton.CompilerParams``); tiles are powers of two;
* ``"interpret"``: the Pallas TPU interpreter (``pltpu.InterpretParams``) on any
  device, for CPU; unlike ``interpret=True`` it types the kernel's values as
  varying over the ``shard_map`` axes its inputs vary over, so it runs inside a
  train step's ``shard_map`` with its varying-axes checks on.

Stochastic rounding hashes ``(seed, element index)`` inside the kernel
(see :func:`~torsh_jax.compress.base.uniform_noise`), so no random array
is read from memory and every tiling gives the same numbers.

Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.linspace(-1.0, 1.0, 1024, dtype=jnp.float32)
    >>> payload = encode(x, method="int4", block_size=256, platform="interpret")
    >>> payload.values.shape, payload.values.dtype
    ((4, 128), dtype('uint8'))
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from torsh_jax.compress.base import QuantPayload, vary_like
from torsh_jax.compress.blockmath import column_parts, decode_tile, encode_tile
from torsh_jax.compress.quantize import noise_reader
from torsh_jax.errors import CompressionError

__all__ = ["PLATFORMS", "rows_per_tile", "encode", "decode", "encode_with_feedback"]

#: Values of ``platform``. Not Mosaic GPU: ``pallas_call`` is deprecated there (``plgpu.kernel``
#: replaces it), and in jaxlib 0.10.2 it rejected these kernels ("No support for axes yet").
PLATFORMS = ("tpu", "gpu", "interpret")
#: Largest row tile (blocks per grid step).
MAX_ROWS = 256
#: Mosaic's row tile is a multiple of this many rows, or all the rows.
MOSAIC_ROWS = 8


def rows_per_tile(num_blocks: int, *, platform: str) -> int:
    """Blocks per grid step: the largest power of two <= 256 dividing ``num_blocks`` (Triton's
    tiles are powers of two). Under Mosaic (``tpu`` and the interpreter), where that power is
    below 8, all ``num_blocks`` in one tile up to 256 of them, else tiles of 256 with a shorter
    last one (:func:`grid_steps`): a tile is held in the core's scoped VMEM (16 MiB on v5e).

    Example:
        >>> [rows_per_tile(n, platform="tpu") for n in (96, 6, 16514)], rows_per_tile(6, platform="gpu")
        ([32, 6, 256], 2)
    """
    rows = 1
    while rows * 2 <= MAX_ROWS and num_blocks % (rows * 2) == 0:
        rows *= 2
    if platform in ("tpu", "interpret") and rows < MOSAIC_ROWS:
        return min(num_blocks, MAX_ROWS)
    return rows


def grid_steps(num_blocks: int, rows: int) -> int:
    """Row tiles over ``num_blocks`` blocks; the last one shorter where ``rows`` does not divide
    them (its rows past the end are read undefined and not written: each block is encoded alone).

    Example:
        >>> grid_steps(16514, 256), grid_steps(96, 32)
        (65, 3)
    """
    return pl.cdiv(num_blocks, rows)


def _values_width(method: str, block_size: int) -> int:
    return {"int8": block_size, "int4": block_size // 2, "sign": block_size // 8}[method]


def _values_dtype(method: str):
    return jnp.int8 if method == "int8" else jnp.uint8


def _call_options(platform: str) -> dict:
    if platform in ("interpret", "tpu"):
        from jax.experimental.pallas import tpu as pltpu

        if platform == "interpret":
            return {"interpret": pltpu.InterpretParams()}
        return {"compiler_params": pltpu.CompilerParams(dimension_semantics=("parallel",))}
    if platform == "gpu":
        from jax.experimental.pallas import triton as pltriton

        return {"compiler_params": pltriton.CompilerParams(num_warps=4)}
    raise CompressionError(
        f"unknown kernel platform {platform!r}", key="platform", fix=f"use one of {list(PLATFORMS)}"
    )


def _check_shape(method: str, n: int, block_size: int) -> None:
    if method not in ("int8", "int4", "sign"):
        raise CompressionError(
            f"no blockwise kernel for {method!r}", key="method", fix="use method int8, int4 or sign"
        )
    parts = len(column_parts(method, block_size))
    if n % block_size or block_size % parts:
        raise CompressionError(
            f"length {n} / block_size {block_size} do not tile for {method}",
            key="block_size",
            fix=f"use a block_size divisible by {parts} and pad the buffer to a multiple of it",
        )


def _row_spec(rows: int, width: int) -> pl.BlockSpec:
    return pl.BlockSpec((rows, width), lambda i: (i, 0))


def _seed_spec() -> pl.BlockSpec:
    return pl.BlockSpec((1, 1), lambda i: (0, 0))


def _encode_body(method, block_size, rows, stochastic, read, seed_ref):
    noise = None
    if stochastic:
        noise = noise_reader(
            seed_ref[...], rows=rows, row_start=pl.program_id(0) * rows, block_size=block_size
        )
    return encode_tile(method, read, block_size=block_size, noise=noise)


def _encode_kernel(*refs, method, block_size, rows, stochastic):
    seed_ref, refs = (refs[0], refs[1:]) if stochastic else (None, refs)
    x_ref, values_ref, scales_ref = refs
    read = lambda start, width: x_ref[:, start : start + width]
    values, scales = _encode_body(method, block_size, rows, stochastic, read, seed_ref)
    values_ref[...] = values
    scales_ref[...] = scales


def _feedback_kernel(*refs, method, block_size, rows, stochastic):
    seed_ref, refs = (refs[0], refs[1:]) if stochastic else (None, refs)
    x_ref, residual_ref, values_ref, scales_ref, new_residual_ref = refs

    def read(start, width):
        return x_ref[:, start : start + width] + residual_ref[:, start : start + width]

    values, scales = _encode_body(method, block_size, rows, stochastic, read, seed_ref)
    values_ref[...] = values
    scales_ref[...] = scales
    for start, part in decode_tile(method, values, scales, block_size=block_size):
        width = part.shape[-1]
        new_residual_ref[:, start : start + width] = read(start, width) - part


def _decode_kernel(values_ref, scales_ref, out_ref, *, method, block_size):
    windows = decode_tile(method, values_ref[...], scales_ref[...], block_size=block_size)
    for start, part in windows:
        out_ref[:, start : start + part.shape[-1]] = part


def _out(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """An output shape that varies over the same manual (shard_map) axes as ``like``."""
    axes = getattr(jax.typeof(like), "manual_axis_type", None)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=axes)


def _payload_shapes(method: str, num_blocks: int, block_size: int, like: jax.Array):
    width = _values_width(method, block_size)
    return (
        _out((num_blocks, width), _values_dtype(method), like),
        _out((num_blocks, 1), jnp.float32, like),
    )


def _encode_call(kernel, inputs, seed, *, method, block_size, platform, extra_out):
    num_blocks = inputs[0].shape[0]
    rows = rows_per_tile(num_blocks, platform=platform)
    stochastic = seed is not None
    body = functools.partial(kernel, method=method, block_size=block_size, rows=rows, stochastic=stochastic)
    out_shape = _payload_shapes(method, num_blocks, block_size, inputs[0]) + extra_out
    out_specs = [_row_spec(rows, _values_width(method, block_size)), _row_spec(rows, 1)]
    out_specs += [_row_spec(rows, block_size) for _ in extra_out]
    in_specs = [_row_spec(rows, block_size) for _ in inputs]
    operands = list(inputs)
    if stochastic:
        in_specs, operands = [_seed_spec(), *in_specs], [vary_like(seed, inputs[0]), *operands]
    return pl.pallas_call(
        body,
        out_shape=out_shape,
        grid=(grid_steps(num_blocks, rows),),
        in_specs=in_specs,
        out_specs=out_specs,
        **_call_options(platform),
    )(*operands)


def encode(
    x: jax.Array,
    /,
    *,
    method: str,
    block_size: int,
    platform: str,
    seed: jax.Array | None = None,
) -> QuantPayload:
    """Kernel twin of :func:`torsh_jax.compress.quantize.encode`."""
    _check_shape(method, x.shape[0], block_size)
    values, scales = _encode_call(
        _encode_kernel,
        [x.reshape(-1, block_size)],
        seed,
        method=method,
        block_size=block_size,
        platform=platform,
        extra_out=(),
    )
    return QuantPayload(values, scales)


def encode_with_feedback(
    x: jax.Array,
    residual: jax.Array,
    /,
    *,
    method: str,
    block_size: int,
    platform: str,
    seed: jax.Array | None = None,
) -> tuple[QuantPayload, jax.Array]:
    """Kernel twin of :func:`torsh_jax.compress.quantize.encode_with_feedback` (one pass)."""
    _check_shape(method, x.shape[0], block_size)
    num_blocks = x.shape[0] // block_size
    values, scales, new_residual = _encode_call(
        _feedback_kernel,
        [x.reshape(num_blocks, block_size), residual.reshape(num_blocks, block_size)],
        seed,
        method=method,
        block_size=block_size,
        platform=platform,
        extra_out=(_out((num_blocks, block_size), jnp.float32, x),),
    )
    return QuantPayload(values, scales), new_residual.reshape(-1)


def decode(payload: QuantPayload, /, *, method: str, block_size: int, platform: str) -> jax.Array:
    """Kernel twin of :func:`torsh_jax.compress.quantize.decode`."""
    num_blocks = payload.scales.shape[0]
    _check_shape(method, num_blocks * block_size, block_size)
    rows = rows_per_tile(num_blocks, platform=platform)
    out = pl.pallas_call(
        functools.partial(_decode_kernel, method=method, block_size=block_size),
        out_shape=_out((num_blocks, block_size), jnp.float32, payload.values),
        grid=(grid_steps(num_blocks, rows),),
        in_specs=[_row_spec(rows, _values_width(method, block_size)), _row_spec(rows, 1)],
        out_specs=_row_spec(rows, block_size),
        **_call_options(platform),
    )(payload.values, payload.scales)
    return out.reshape(-1)
