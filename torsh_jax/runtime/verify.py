"""Compare a parallel train step with its single-device twin.

:func:`record_gradients` is an optax transformation that keeps the last
gradient it saw in its state, so the reduced gradients of both programs can
be compared step by step; :func:`compare_with_twin` runs both for a few steps
and returns the largest relative loss, gradient and parameter differences.

Two comparisons: *free-running* (each program follows its own trajectory) and
*lockstep* (before every step the twin is reset to the parallel program's
state, so each step is compared from the same starting point). Lockstep
measures the error a step adds; free-running adds how the optimizer carries it
on, which Adam can amplify where a gradient is within round-off of zero
(``docs/strategies.md``, "Which comparison the 1e-5 bound covers").

Example:
    >>> import jax.numpy as jnp, optax
    >>> opt = optax.chain(record_gradients(), optax.sgd(0.1))
    >>> state = opt.init({"w": jnp.zeros(2)})
    >>> _, state = opt.update({"w": jnp.ones(2)}, state)
    >>> state[0].grads["w"].tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "RecordedGradients",
    "record_gradients",
    "recorded",
    "relative_error",
    "TwinReport",
    "compare_with_twin",
    "twin_state_of",
]

PyTree = Any


class RecordedGradients(NamedTuple):
    grads: PyTree


def record_gradients() -> optax.GradientTransformation:
    """Identity transformation whose state is the last incoming gradient."""

    def init(params):
        return RecordedGradients(jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        del state, params
        return updates, RecordedGradients(updates)

    return optax.GradientTransformation(init, update)


def recorded(opt_state: PyTree) -> PyTree:
    """The gradients stored by the first :func:`record_gradients` in ``opt_state``."""
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, RecordedGradients)):
        if isinstance(node, RecordedGradients):
            return node.grads
    raise ValueError("no record_gradients() state found in the optimizer state")


def relative_error(actual: PyTree, expected: PyTree) -> float:
    """Largest over leaves of ``max|a - e| / max|e|`` (``max|a - e|`` when ``e`` is all zero)."""
    worst = 0.0
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale = float(np.max(np.abs(e))) if e.size else 0.0
        diff = float(np.max(np.abs(a - e))) if e.size else 0.0
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


@dataclass
class TwinReport:
    """Per-step losses of both programs and the largest relative differences."""

    losses: list[float] = field(default_factory=list)
    twin_losses: list[float] = field(default_factory=list)
    max_loss_rel_err: float = 0.0
    max_grad_rel_err: float = 0.0
    max_param_rel_err: float = 0.0


def compare_with_twin(
    parallel: tuple[Callable, Callable],
    twin: tuple[Callable, Callable],
    params: PyTree,
    batches: Iterable[PyTree],
    *,
    lockstep: bool = False,
) -> TwinReport:
    """Run both ``(init, step)`` pairs on the same batches and compare.

    Gradients are compared when the optimizer contains :func:`record_gradients`;
    parameters after every step. With ``lockstep`` the twin starts every step
    from the parallel program's state (gathered to one device, without the
    per-device compression feedback), so only the error of one step is measured.
    """
    (p_init, p_step), (t_init, t_step) = parallel, twin
    p_state, t_state = p_init(params), t_init(params)
    report = TwinReport()
    for batch in batches:
        if lockstep:
            t_state = twin_state_of(p_state, like=t_state)
        p_state, p_metrics = p_step(p_state, batch)
        t_state, t_metrics = t_step(t_state, batch)
        loss, twin_loss = float(p_metrics["loss"]), float(t_metrics["loss"])
        report.losses.append(loss)
        report.twin_losses.append(twin_loss)
        report.max_loss_rel_err = max(report.max_loss_rel_err, abs(loss - twin_loss) / abs(twin_loss))
        report.max_param_rel_err = max(
            report.max_param_rel_err, relative_error(_as_twin(p_state.params, t_state.params), t_state.params)
        )
        try:
            grads, twin_grads = recorded(p_state.opt_state), recorded(t_state.opt_state)
        except ValueError:
            continue
        report.max_grad_rel_err = max(
            report.max_grad_rel_err, relative_error(_as_twin(grads, twin_grads), twin_grads)
        )
    return report


def _as_twin(tree: PyTree, like: PyTree) -> PyTree:
    """Whole host arrays in the twin's shapes: a state that stores stacked layers in chunks
    (an interleaved pipeline) holds them in the same order, reshaped."""
    return jax.tree.map(lambda x, t: np.asarray(x).reshape(np.shape(t)), tree, like)


def twin_state_of(state: PyTree, *, like: PyTree) -> PyTree:
    """A parallel program's ``state`` as a twin state: whole arrays on the default device, in the
    structure and shapes of the twin state ``like``, without the per-device compression feedback."""
    state = _as_twin(state._replace(feedback=like.feedback), like)
    return jax.tree.map(lambda x, t: jnp.asarray(x, dtype=t.dtype), state, like)
