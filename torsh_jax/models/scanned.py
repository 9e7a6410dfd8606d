"""A loss whose model scans over a stack of layers, split at the scan into a
:class:`~torsh_jax.runtime.layered.LayeredModel`.

Models stack their blocks on a leading dim and run them with a scan (``nnx.scan`` over
``nnx.vmap``-made blocks, ``nn.scan``, ``jax.lax.scan``). The loss is traced to a jaxpr
(``jax.make_jaxpr``, at the dtypes it is called with) and cut at the ``scan`` whose scanned
inputs are the stacked parameters:

* **embed**: the equations the scan's carried input depends on, evaluated up to the scan;
* **layer**: the scan's body on one layer's slice of the stack;
* **head**: every equation but the scan, with the scan's carried output given.

The scan must carry one value (the hidden state) and scan over the stacked parameters alone; what
else the body reads (a mask computed outside it) is refused. Each part reads the top-level
parameter keys its equations use.

Example:
    >>> import jax, jax.numpy as jnp
    >>> def loss(p, batch):
    ...     h = p["embed"][batch]
    ...     h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["stack"])
    ...     return jnp.mean(h @ p["embed"].T)
    >>> params = {"embed": jnp.ones((8, 4)) / 4, "stack": jnp.ones((3, 4, 4)) / 4}
    >>> layered = from_scan(loss, params, jnp.zeros((2,), jnp.int32), layers="stack")
    >>> layered.model.embed_keys, layered.model.head_keys
    (('embed',), ('embed',))
    >>> from torsh_jax.runtime.layered import layered_loss
    >>> bool(jnp.allclose(layered_loss(layered.model)(layered.params, jnp.zeros((2,), jnp.int32)),
    ...                   loss(params, jnp.zeros((2,), jnp.int32))))
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from torsh_jax.errors import ModelStructureError, NotSupportedYetError
from torsh_jax.models.blocks import FlaxLayers
from torsh_jax.runtime.layered import LayeredModel
from torsh_jax.tensor.axis import vary_over, varying_axes
from torsh_jax.typing import PyTree

__all__ = ["from_scan", "keys_read", "needed_vars"]


def _like(x, shape=None, dtype=None) -> jax.ShapeDtypeStruct:
    """``x``'s shape and dtype (each replaceable), without its ``shard_map`` type: the jaxpr is traced
    outside any, and :func:`evaluate` types its values as it goes."""
    shape = np.shape(x) if shape is None else shape
    return jax.ShapeDtypeStruct(shape, dtype or jnp.result_type(x))


def _abstract(tree: PyTree) -> PyTree:
    return jax.tree.map(_like, tree)


def _signature(tree: PyTree) -> tuple:
    leaves, structure = jax.tree_util.tree_flatten(_abstract(tree))
    return structure, tuple((x.shape, str(x.dtype)) for x in leaves)


#: Call-like primitives whose jaxpr is evaluated in place. A custom JVP rule is replaced by
#: differentiating what it computes (jax's own choose a value where that derivative is undefined or
#: unstable, as ``relu``'s at exactly 0); a rematerialized call is computed once (the step's own
#: remat applies to the layers).
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr"}  # fmt: skip
#: Primitives whose gradient is not what differentiating their computation gives.
_REFUSED = ("custom_vjp_call", "custom_vjp_call_jaxpr")


def evaluate(jaxpr, consts, *args) -> list:
    """``jaxpr`` (traced outside ``shard_map``) on ``args``, which may be values inside one: each
    equation's operands are typed as varying over the union of the manual axes any of them varies
    over, as tracing them there would have (``jax.core.eval_jaxpr`` binds them as they are, and a
    product of a varying and an unvarying value is refused)."""
    env: dict = {}
    read = lambda v: jnp.asarray(v.val, v.aval.dtype) if isinstance(v, jex.Literal) else env[v]
    for var, value in zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args]):
        env[var] = value
    for eqn in jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        if eqn.primitive.name in _REFUSED:
            raise NotSupportedYetError(
                "the model uses a custom gradient (jax.custom_vjp), which a model cut at its layer scan "
                "cannot keep yet",
                key=str(eqn.source_info.name_stack) or eqn.primitive.name,
                fix="write the LayeredModel by hand (embed, layer, head), or use the model without a "
                "pipeline or ZeRO-3",
            )
        sub = _CALLS.get(eqn.primitive.name)
        if sub is not None:
            closed = eqn.params[sub]
            inner = closed.jaxpr if hasattr(closed, "jaxpr") else closed
            outs = evaluate(inner, getattr(closed, "consts", ()), *values)
        else:
            outs = eqn.primitive.bind(*_typed_alike(values), **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        for var, value in zip(eqn.outvars, outs):
            env[var] = value
    return [read(v) for v in jaxpr.outvars]


def _typed_alike(values: list) -> list:
    """``values``, each typed as varying over every manual axis one of them varies over."""
    values = [jnp.asarray(v) if isinstance(v, (np.ndarray, np.generic)) else v for v in values]
    arrays = [v for v in values if isinstance(v, jax.Array)]
    axes = sorted(set().union(*(varying_axes(v) for v in arrays))) if arrays else []
    return [vary_over(v, axes) if isinstance(v, jax.Array) and axes else v for v in values]


def needed_vars(outvars, eqns, given=()) -> set:
    """The variables ``outvars`` depend on through ``eqns`` (``given``: taken as inputs)."""
    needed = {v for v in outvars if isinstance(v, jex.Var)} - set(given)
    for eqn in reversed(eqns):
        if any(v in needed for v in eqn.outvars):
            needed |= {v for v in eqn.invars if isinstance(v, jex.Var)}
    return needed


def _top_keys(params: dict) -> list:
    """The top-level key of every leaf of ``params``, in leaf order (a lifted key such as
    ``transformer/wte`` whole)."""
    return [path[0].key for path, _ in jax.tree_util.tree_leaves_with_path(params)]


def keys_read(fn: Callable, params: dict) -> tuple[str, ...]:
    """The top-level keys of ``params`` whose values ``fn(params)`` depends on (by its jaxpr)."""
    jaxpr = jax.make_jaxpr(fn)(_abstract(params)).jaxpr
    keys = _top_keys(params)
    needed = needed_vars(jaxpr.outvars, jaxpr.eqns)
    read = {k for k, v in zip(keys, jaxpr.invars) if v in needed}
    return tuple(k for k in params if k in read)


class _Cut:
    """The loss's jaxpr at one set of argument shapes and dtypes, and where its layer scan is."""

    def __init__(self, loss: Callable, params: dict, batch: PyTree, layers: str):
        self.closed = jax.make_jaxpr(loss)(*_abstract((params, batch)))
        jaxpr = self.closed.jaxpr
        self.keys = _top_keys(params)
        self.param_vars = jaxpr.invars[: len(self.keys)]
        stacked = {v: i for i, v in enumerate(self.param_vars) if self.keys[i] == layers}
        self.index, self.scan = _find_scan(jaxpr, stacked, layers)
        n_consts, n_carry = self.scan.params["num_consts"], self.scan.params["num_carry"]
        first = min(stacked.values())
        self.xs_order = [stacked[v] - first for v in self.scan.invars[n_consts + n_carry :]]
        self.consts = [self._const_value(v) for v in self.scan.invars[:n_consts]]
        self.carry_in, self.carry_out = self.scan.invars[n_consts], self.scan.outvars[0]

    def _const_value(self, var):
        """The value of one loop-invariant input of the scan: a literal or a closed-over constant."""
        if isinstance(var, jex.Literal):
            return var.val
        return self.closed.consts[self.closed.jaxpr.constvars.index(var)]

    def used_keys(self, outvars, eqns, given=()) -> set[str]:
        """Top-level parameter keys ``outvars`` depend on through ``eqns`` (``given``: not computed)."""
        needed = needed_vars(outvars, eqns, given)
        return {key for key, v in zip(self.keys, self.param_vars) if v in needed}

    def head_eqns(self) -> list:
        return [e for i, e in enumerate(self.closed.jaxpr.eqns) if i != self.index]

    def embed(self, args: list) -> jax.Array:
        jaxpr = self.closed.jaxpr.replace(eqns=self.closed.jaxpr.eqns[: self.index], outvars=[self.carry_in])
        return evaluate(jaxpr, self.closed.consts, *args)[0]

    def head(self, args: list, hidden: jax.Array) -> jax.Array:
        jaxpr = self.closed.jaxpr
        jaxpr = jaxpr.replace(eqns=self.head_eqns(), invars=[*jaxpr.invars, self.carry_out])
        return evaluate(jaxpr, self.closed.consts, *args, hidden)[0]

    def layer(self, stacked_leaves: list, hidden: jax.Array) -> jax.Array:
        body = self.scan.params["jaxpr"]
        xs = [stacked_leaves[i] for i in self.xs_order]
        return evaluate(body.jaxpr, body.consts, *self.consts, hidden, *xs)[0]


def _find_scan(jaxpr, stacked: dict, layers: str):
    for index, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != "scan":
            continue
        n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
        xs = eqn.invars[n_consts + n_carry :]
        if not any(v in stacked for v in xs if isinstance(v, jex.Var)):
            continue
        if set(xs) != set(stacked) or n_carry != 1:
            raise NotSupportedYetError(
                f"the scan over {layers} carries {n_carry} values and scans over {len(xs)} inputs "
                f"({len(stacked)} of them the stacked parameters): one carried hidden state and the "
                "stacked parameters alone are what splits into layers",
                key=layers,
                fix="scan over the blocks' parameters only, carrying the hidden state",
            )
        computed = [v for v in eqn.invars[:n_consts] if isinstance(v, jex.Var) and v not in jaxpr.constvars]
        if computed:
            raise NotSupportedYetError(
                f"the scanned blocks of {layers} read {len(computed)} values computed outside the scan "
                "(a mask, positions, a parameter every layer shares)",
                key=layers,
                fix="compute them inside the block, from the hidden state's shape",
            )
        return index, eqn
    raise ModelStructureError(
        f"no scan over the parameters under {layers!r} in the loss",
        key=layers,
        fix="pass layers= the key of the stacked blocks the model scans over",
    )


def from_scan(
    loss: Callable[[PyTree, Any], jax.Array], params: PyTree, example: Any, /, *, layers: str
) -> FlaxLayers:
    """``loss(params, batch)``, whose model scans over ``params[layers]`` (stacked on a leading dim),
    as a :class:`~torsh_jax.models.blocks.FlaxLayers` (see the module docstring). The batch's leaves
    have the batch on their leading dim.

    Raises:
        ModelStructureError: no scan runs over ``params[layers]``.
        NotSupportedYetError: the scan carries more than the hidden state, or its body reads values
            computed outside it.
    """
    params = dict(params)
    if layers not in params:
        raise ModelStructureError(
            f"no {layers!r} among the parameters' keys ({', '.join(map(str, params))})",
            key=layers,
            fix="pass layers= the key of the stacked blocks",
        )
    cuts: dict = {}

    def cut(p: dict, batch: PyTree) -> _Cut:
        # the context mesh too: traced inside a step's shard_map, the jaxpr's equations name it
        key = (_signature(p), _signature(batch), str(jax.sharding.get_abstract_mesh()))
        if key not in cuts:
            cuts[key] = _Cut(loss, p, batch, layers)
        return cuts[key]

    first = cut(params, example)
    embed = first.used_keys([first.carry_in], first.closed.jaxpr.eqns[: first.index])
    head = first.used_keys(first.closed.jaxpr.outvars, first.head_eqns(), given=[first.carry_out])
    others = [k for k in params if k != layers]
    keys = tuple(k for k in others if k in embed), tuple(k for k in others if k in head)
    model = _layered(cut, params, example, layers, keys)
    return FlaxLayers(model, params, layers_key=layers, layout="stacked")


def _layered(cut: Callable, params: dict, example: PyTree, layers: str, keys: tuple) -> LayeredModel:
    from torsh_jax.models.blocks import zeros_like

    def full(given: dict) -> dict:
        """Every parameter key: the part's own, zeros of the others' shapes (they go unread)."""
        return {k: given[k] if k in given else zeros_like(v) for k, v in params.items()}

    def embed(p, batch):
        p = full(p)
        return cut(p, batch).embed(jax.tree.leaves((p, batch)))

    def head(p, h, batch):
        p = full(p)
        return cut(p, batch).head(jax.tree.leaves((p, batch)), h)

    def layer(one, h):
        """The scan's body on one layer, traced at the layer's dtypes and the hidden state's batch."""
        like = jax.tree.map(lambda x, s: _like(x, shape=np.shape(s)), one, params[layers])
        rest = {k: jax.tree.map(lambda x: _like(x, dtype=h.dtype), v) for k, v in params.items()}
        batch = jax.tree.map(lambda x: _like(x, shape=(h.shape[0], *np.shape(x)[1:])), example)
        return cut({**rest, layers: like}, batch).layer(jax.tree.leaves(one), h)

    embed_keys, head_keys = keys
    return LayeredModel(embed, layer, head, embed_keys=embed_keys, head_keys=head_keys, layers_key=layers)
