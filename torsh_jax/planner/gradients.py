"""The gradient programs ``calibrate`` compiles to read a model's memory: the model's loss and
gradient on one device, its stack ``layers`` deep, each layer recomputed in the backward pass or
not, on ``rows`` examples.

Two sources: :class:`DemoGradients`, the demo model of a :class:`~torsh_jax.planner.shape.ModelShape`
(what ``torsh-jax calibrate`` compiles), and :class:`ModelGradients`, a
:class:`~torsh_jax.runtime.layered.LayeredModel` of your own (a flax model converted with
``from_linen`` or ``from_nnx`` too), so the cost model's compiled gradients are that model's: its
activations, what it keeps recomputing a layer, what ZeRO-3 and a pipeline stage hold.

Example (the demo model of a shape, four layers deep on three examples; nothing is allocated;
:class:`ModelGradients` takes your model, its parameters and an example batch instead):
    >>> from torsh_jax.planner.shape import parse_model
    >>> source = DemoGradients(parse_model("demo:d_model=64,layers=2,vocab=64,seq_len=16"))
    >>> loss, shapes, batch = source.program(4, remat=True, rows=3)
    >>> shapes["layers"]["w_in"].shape, batch["inputs"].shape
    ((4, 64, 256), (3, 16))
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torsh_jax.errors import PlanError
from torsh_jax.typing import PyTree

if TYPE_CHECKING:  # pragma: no cover
    from torsh_jax.planner.shape import ModelShape
    from torsh_jax.runtime.layered import LayeredModel

__all__ = [
    "GradientSource",
    "DemoGradients",
    "ModelGradients",
    "gradient_temp_bytes",
    "compiled_temp_bytes",
    "stack_at_depth",
]


class GradientSource(Protocol):
    """Where the gradient programs come from: ``program(layers, remat=, rows=)`` gives the loss
    (``(params, batch) -> scalar``), the parameters' and the batch's shapes."""

    def program(self, layers: int, /, *, remat: bool, rows: int) -> tuple: ...


@dataclass(frozen=True)
class DemoGradients:
    """The demo model of ``shape``'s widths (``shape.demo_config``) at ``layers`` layers."""

    shape: ModelShape

    def program(self, layers: int, /, *, remat: bool, rows: int) -> tuple:
        import jax
        import jax.numpy as jnp

        from torsh_jax.demo.model import init_params, layered_model
        from torsh_jax.runtime.layered import layered_loss

        cfg = self.shape.demo_config(layers=layers)
        params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
        tokens = jax.ShapeDtypeStruct((rows, self.shape.seq_len), jnp.int32)
        return layered_loss(layered_model(cfg, remat=remat)), params, {"inputs": tokens, "targets": tokens}


@dataclass(frozen=True, eq=False)
class ModelGradients:
    """``model`` with ``params`` (arrays or their shapes) on batches shaped like ``example`` (any
    leading dim), its stack ``layers`` deep (fewer layers than its own, or more: only shapes are
    compiled, each layer's like the stack's). Two are equal when they compile the same programs
    (the same model's functions, the same shapes).

    Raises (from :meth:`program`):
        PlanError: ``model`` has no stacked layers.
    """

    model: LayeredModel
    params: PyTree
    example: PyTree

    def __post_init__(self):
        """Keeps shapes only: the compiled programs are cached, and with them this source, which must
        not hold a model's arrays alive."""
        import jax

        as_shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
        object.__setattr__(self, "params", jax.tree.map(as_shape, self.params))
        object.__setattr__(self, "example", jax.tree.map(as_shape, self.example))

    def _compiled(self) -> tuple:
        import jax

        flat = lambda tree: (jax.tree.structure(tree), tuple(jax.tree.leaves(tree)))
        return id(self.model), flat(self.params), flat(self.example)  # held: no other model has its id

    def __eq__(self, other) -> bool:
        return isinstance(other, ModelGradients) and self._compiled() == other._compiled()

    def __hash__(self) -> int:
        return hash(self._compiled())

    def program(self, layers: int, /, *, remat: bool, rows: int) -> tuple:
        import jax

        from torsh_jax.runtime.layered import layered_loss

        key = self.model.layers_key
        shapes = self.params
        if key is None or key not in shapes:
            raise PlanError(
                "the model has no stacked layers to compile a few of",
                key=f"params[{key!r}]" if key else "model.layers_key",
                fix="give a LayeredModel whose params hold its layers stacked under its layers_key",
            )
        shapes = stack_at_depth(shapes, key, layers)
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), self.example)
        return layered_loss(self.model._replace(remat=remat)), shapes, batch


def check_tokens_per_example(source: GradientSource, seq_len: int, /) -> None:
    """One-line error unless an example of ``source`` holds ``seq_len`` tokens (a leaf whose dim 1
    is ``seq_len``): the compiled bytes are read per token at that length. A model without a
    sequence dim has one token per example (``seq_len`` 1): its features may have any width, but
    an integer leaf with a dim 1 (token ids, positions) is a sequence.

    Example:
        >>> import jax.numpy as jnp
        >>> check_tokens_per_example(ModelGradients(None, {}, {"tokens": jnp.zeros((1, 8))}), 8)
        >>> mlp_batch = {"x": jnp.zeros((1, 16)), "y": jnp.zeros(1)}  # no sequence dim
        >>> check_tokens_per_example(ModelGradients(None, {}, mlp_batch), 1)
    """
    if not isinstance(source, ModelGradients):
        return
    import jax
    import jax.numpy as jnp

    leaves = [x for x in jax.tree.leaves(source.example) if len(x.shape) >= 2]
    if seq_len == 1:
        leaves = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.integer)]
    dims = {x.shape[1] for x in leaves}
    if seq_len not in dims and (seq_len > 1 or dims - {1}):
        raise PlanError(
            f"the example batch's examples hold {sorted(dims)} positions, the shape {seq_len} tokens",
            key="seq_len",
            fix=f"give an example batch of {seq_len} tokens per example, or the shape its length "
            "(seq_len=1 for a model without a sequence dim)",
        )


#: Per gradient source, the temporaries read so far by ``(layers, remat, rows, device)``: held while
#: the source is (a source's model may close over its arrays, e.g. ``from_nnx``'s loss).
_READ: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_READ_LOCK = threading.Lock()


def gradient_temp_bytes(source: GradientSource, layers: int, remat: bool, rows: int, device) -> int:
    """The compiler's temporaries of ``source``'s gradient with ``layers`` layers on ``rows``
    examples, compiled for ``device`` (one of a target's compile-only devices too: nothing runs).
    Kept while the source it was first read for lives (a source equal to it finds it meanwhile):
    ``calibrate``'s readings share programs, and a model's arrays are not kept alive. A source no
    weak reference can be made to is compiled every time."""
    key = (layers, remat, rows, device)
    with _READ_LOCK:
        try:
            read = _READ.setdefault(source, {})
        except TypeError:  # no weak reference to it (a NamedTuple, __slots__)
            read = {}
        if key in read:
            return read[key]
    temp = compiled_temp_bytes(source, *key)
    with _READ_LOCK:
        read[key] = temp
    return temp


def compiled_temp_bytes(source: GradientSource, layers: int, remat: bool, rows: int, device) -> int:
    """:func:`gradient_temp_bytes`, compiled every time."""
    import jax
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    from torsh_jax.analysis.memory import memory_report

    loss, params, batch = source.program(layers, remat=remat, rows=rows)
    mesh = jax.make_mesh((1, 1), ("devices", "tensor"), axis_types=(AxisType.Explicit,) * 2, devices=[device])
    grads = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
    return memory_report(jax.jit(grads).lower(params, batch).compile()).temp_bytes


def stack_at_depth(params, layers_key: str, layers: int):
    """``params`` (arrays or shapes) as shapes, with the stack under ``layers_key`` ``layers`` deep.

    Example:
        >>> import jax.numpy as jnp
        >>> params = {"layers": {"w": jnp.zeros((4, 3))}, "embed": jnp.zeros(2)}
        >>> stack_at_depth(params, "layers", 2)["layers"]["w"].shape
        (2, 3)
    """
    import jax

    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    depth = lambda s: jax.ShapeDtypeStruct((layers, *s.shape[1:]), s.dtype)
    return {**shapes, layers_key: jax.tree.map(depth, shapes[layers_key])}
