"""The tensor axis as the building blocks see it: a name, whether sequence parallelism is on,
and collectives that vanish when the axis is absent or has size 1.

Outside ``shard_map`` (a single-device twin, a plain ``jit``) the axis is
unbound and every block computes the dense result; inside the train step's
``shard_map`` each device holds its shard and the blocks place the tensor
collectives. Gradients need no extra code: under ``shard_map``'s varying-axis
types, a value replicated over ``tensor`` that meets a split one is broadcast
implicitly, and its gradient is summed over ``tensor`` by that broadcast's
transpose (Megatron's "f" operator); ``psum`` transposes to a broadcast ("g").

Example:
    >>> tp = TensorAxis()
    >>> tp.size(), tp.index()
    (1, 0)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import jax

from torsh_jax.errors import PlanError, ShardingError

__all__ = [
    "TensorAxis",
    "tensor_axis",
    "uses_tensor_blocks",
    "has_tensor_blocks",
    "planned_sequence_parallel",
]

#: the running step's plan's ``tensor.sequence_parallel`` while its program is traced, else ``None``
_PLANNED_SEQUENCE_PARALLEL: ContextVar[bool | None] = ContextVar("planned_sequence_parallel", default=None)


@contextlib.contextmanager
def planned_sequence_parallel(on: bool) -> Iterator[None]:
    """Within: the blocks split the sequence as a step's plan says (``on``): a :class:`TensorAxis`
    left unset follows it, and one set otherwise is refused (the train step traces its program in it).

    Example:
        >>> with planned_sequence_parallel(True):
        ...     TensorAxis().splits_sequence()
        True
    """
    token = _PLANNED_SEQUENCE_PARALLEL.set(on)
    try:
        yield
    finally:
        _PLANNED_SEQUENCE_PARALLEL.reset(token)


@dataclass(frozen=True)
class TensorAxis:
    """Where the tensor blocks split work.

    Args:
        name: the mesh axis (``tensor``).
        sequence_parallel: activations between blocks are split on the
            sequence dim over the axis (all-gather before a column-parallel
            matmul, reduce-scatter after a row-parallel one). ``None`` (the
            default): as the plan of the step that runs the blocks says
            (``tensor.sequence_parallel``; off outside a train step).
        seq_dim: the sequence dim of activations ``[batch, seq, features]``.
    """

    name: str = "tensor"
    sequence_parallel: bool | None = None
    seq_dim: int = 1

    def size(self) -> int:
        """Devices along the axis here: 1 outside ``shard_map`` or where the compiler partitions it.

        Raises:
            ShardingError: inside a ``shard_map`` whose mesh has no axis of this name
                (the weights would be shards computed on as if they were whole).
        """
        try:
            return int(jax.lax.axis_size(self.name))
        except NameError:
            mesh = jax.sharding.get_abstract_mesh()
            if mesh.axis_names and self.name not in mesh.axis_names:
                raise ShardingError(
                    f"a tensor block runs on the axis {self.name!r}, which the mesh "
                    f"{dict(zip(mesh.axis_names, mesh.axis_sizes))} does not have",
                    key="mesh.tensor",
                    fix="build the blocks with tensor_axis(plan) (axis 'tensor'), or run the model "
                    "under a plan whose mesh has that axis",
                ) from None
            return 1

    def active(self) -> bool:
        return self.size() > 1

    def splits_sequence(self) -> bool:
        """Whether the activations between blocks are split on the sequence: this axis's setting,
        else the running step's plan's (:func:`planned_sequence_parallel`).

        Raises:
            PlanError: the setting differs from the running step's plan: the step would run
                without the sequence parallelism its plan has, or with what it does not have.
        """
        planned = _PLANNED_SEQUENCE_PARALLEL.get()
        if self.sequence_parallel is None:
            return bool(planned)
        if planned is not None and planned != self.sequence_parallel:
            said, done = ("on", "off") if planned else ("off", "on")
            raise PlanError(
                f"the plan's tensor.sequence_parallel is {said}, but these tensor blocks were built "
                f"with it {done} (TensorAxis(sequence_parallel={self.sequence_parallel}))",
                key="tensor.sequence_parallel",
                fix="build the blocks with tensor_axis(plan), or with a TensorAxis whose "
                "sequence_parallel is left unset (it follows the plan)",
            )
        return self.sequence_parallel

    def index(self) -> jax.Array | int:
        """This device's position along the axis (0 when inactive)."""
        return jax.lax.axis_index(self.name) if self.active() else 0

    def psum(self, x: jax.Array) -> jax.Array:
        return jax.lax.psum(x, self.name) if self.active() else x

    def pmax(self, x: jax.Array) -> jax.Array:
        return jax.lax.pmax(x, self.name) if self.active() else x

    def vary(self, x: jax.Array) -> jax.Array:
        """``x`` typed as per-device along the axis, once, before several column-parallel matmuls use it.

        Each use of a replicated ``x`` by a split weight sums its own gradient
        over the axis; varying it first sums their total once (Megatron's fused
        QKV: one backward reduction for the three projections).
        """
        return vary_over(x, (self.name,)) if self.active() else x

    def gather_sequence(self, x: jax.Array) -> jax.Array:
        """``x[B, T/t, ...] -> x[B, T, ...]`` (sequence parallel only)."""
        if not (self.active() and self.splits_sequence()):
            return x
        return jax.lax.all_gather(x, self.name, axis=self.seq_dim, tiled=True)

    def scatter_sum_sequence(self, x: jax.Array) -> jax.Array:
        """Partial sums ``x[B, T, ...]`` -> this device's summed chunk ``[B, T/t, ...]`` (or the full sum)."""
        if not self.active():
            return x
        if not self.splits_sequence():
            return jax.lax.psum(x, self.name)
        self._check_sequence(x.shape[self.seq_dim])
        return jax.lax.psum_scatter(x, self.name, scatter_dimension=self.seq_dim, tiled=True)

    def split_sequence(self, x: jax.Array) -> jax.Array:
        """This device's chunk of a replicated ``x[B, T, ...]`` (sequence parallel only; no communication)."""
        if not (self.active() and self.splits_sequence()):
            return x
        chunk = self._check_sequence(x.shape[self.seq_dim])
        return jax.lax.dynamic_slice_in_dim(x, self.index() * chunk, chunk, axis=self.seq_dim)

    def _check_sequence(self, length: int) -> int:
        """This device's chunk of a sequence of ``length``; a typed error when the axis does not divide it."""
        t = self.size()
        if length % t:
            raise ShardingError(
                f"sequence length {length} is not divisible by the tensor axis size {t}",
                key="tensor.sequence_parallel",
                fix=f"use a sequence length divisible by {t}, or set tensor.sequence_parallel = false",
            )
        return length // t


def varying_axes(x: jax.Array) -> frozenset:
    """The manual axes ``x`` differs along (its ``shard_map`` type)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def vary_over(x: jax.Array, axes) -> jax.Array:
    """``x`` typed as varying over ``axes`` (no data moves); axes it varies over already are kept."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def tensor_axis(plan) -> TensorAxis:
    """The :class:`TensorAxis` of a :class:`~torsh_jax.plan.ParallelPlan`."""
    return TensorAxis(sequence_parallel=plan.tensor.sequence_parallel)


def uses_tensor_blocks(loss_fn: Callable) -> Callable:
    """Mark a plain ``loss_fn(params, batch)`` as written with these blocks (it sees local tensor shards).

    A :class:`~torsh_jax.runtime.layered.LayeredModel` says the same with
    ``tensor_blocks=True``.
    """

    @functools.wraps(loss_fn)
    def marked(*args, **kwargs):
        return loss_fn(*args, **kwargs)

    marked.tensor_blocks = True
    return marked


def has_tensor_blocks(loss) -> bool:
    """Whether ``loss`` (a function or a layered model) computes on local tensor shards."""
    return bool(getattr(loss, "tensor_blocks", False))
