"""Compare a parallel train step with its single-device twin, within round-off.

:func:`record_gradients` is an optax transformation that keeps the last
gradient it saw in its state, so the reduced gradients of both programs can
be compared step by step; :func:`compare_with_twin` runs both for a few steps
and returns the largest relative loss, gradient and parameter differences.

The twin criterion (:meth:`TwinReport.within_roundoff`): given the twin's math
run in float64 as well (``exact=``), the parallel program's error against it is
at most ``ROUNDOFF_FACTOR`` (4) x the float32 twin's own error + ``ROUNDOFF_FLOOR``
(8 float32 ulps), for the loss and gradients (and parameters when asked), worst
step of each. Both float32 programs compute the same sums in different orders,
so their errors are two samples of one round-off, whatever the CPU and XLA
flags; a wrong gradient changes the math and its error does not shrink with
the unit round-off (``docs/strategies.md``, "The twin criterion").

Two comparisons: *free-running* (each program follows its own trajectory) and
*lockstep* (before every step the twin and the float64 run restart from the
parallel program's state, so each step is compared from the same starting
point). Lockstep measures the error a step adds; free-running adds how the
optimizer carries it on, which Adam amplifies where a gradient is within
round-off of zero: there parameters are not compared free-running.

Example:
    >>> import jax.numpy as jnp, optax
    >>> opt = optax.chain(record_gradients(), optax.sgd(0.1))
    >>> state = opt.init({"w": jnp.zeros(2)})
    >>> _, state = opt.update({"w": jnp.ones(2)}, state)
    >>> state[0].grads["w"].tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
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
    "ROUNDOFF_FACTOR",
    "ROUNDOFF_FLOOR",
    "StepErrors",
    "TwinReport",
    "compare_with_twin",
    "twin_state_of",
    "float64_batch",
    "with_float64",
]

PyTree = Any

# The twin criterion: parallel error <= ROUNDOFF_FACTOR x the twin's own error + ROUNDOFF_FLOOR, both
# measured against the float64 run. 4: the spread between two samples of one round-off (measured
# <= 1.2); 8 float32 ulps: a twin that by chance lands on the float64 value (docs/strategies.md).
ROUNDOFF_FACTOR = 4.0
ROUNDOFF_FLOOR = 8 * float(np.finfo(np.float32).eps)


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
    """Largest over leaves of ``max|a - e| / max|e|`` (``max|a - e|`` when ``e`` is all zero);
    equal infinities count as equal, a NaN makes the result NaN."""
    worst = 0.0
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale = float(np.max(np.abs(e))) if e.size else 0.0
        with np.errstate(invalid="ignore"):  # inf - inf, where both are the same infinity
            diff = float(np.max(np.where(a == e, 0.0, np.abs(a - e)))) if e.size else 0.0
        error = diff / scale if scale > 0 else diff
        worst = error if not error <= worst else worst
    return worst


@dataclass
class StepErrors:
    """Per step, the largest relative error of one program against another (:func:`relative_error`)
    of the loss, the reduced gradients (empty without :func:`record_gradients`) and the parameters."""

    loss: list[float] = field(default_factory=list)
    grads: list[float] = field(default_factory=list)
    params: list[float] = field(default_factory=list)

    def add(self, loss: float, reference_loss: float, grads, reference_grads, params, reference_params):
        self.loss.append(relative_error(loss, reference_loss))
        if grads is not None:
            self.grads.append(relative_error(_as_twin(grads, reference_grads), reference_grads))
        self.params.append(relative_error(_as_twin(params, reference_params), reference_params))

    def worst(self, quantity: str) -> float:
        """The largest error of ``quantity`` over the steps (NaN if any step's is NaN)."""
        values = getattr(self, quantity)
        return float(np.max(values)) if values else 0.0


@dataclass
class TwinReport:
    """Per-step losses of both programs and their largest relative differences; with a float64
    run (``compare_with_twin(..., exact=...)``) its losses and each program's error against it,
    per step (``parallel_error``, ``twin_error``), which :meth:`within_roundoff` judges.

    Example:
        >>> report = TwinReport(exact_losses=[2.0], parallel_error=StepErrors([3e-7], [2e-6], [0.0]),
        ...                     twin_error=StepErrors([1e-7], [1e-6], [0.0]))
        >>> report.within_roundoff()
        True
        >>> report.roundoff_violations(factor=1.0)
        ['grads: parallel error 2e-06 > 1 x twin error 1e-06 + 9.5e-07']
    """

    losses: list[float] = field(default_factory=list)
    twin_losses: list[float] = field(default_factory=list)
    max_loss_rel_err: float = 0.0
    max_grad_rel_err: float = 0.0
    max_param_rel_err: float = 0.0
    exact_losses: list[float] = field(default_factory=list)
    parallel_error: StepErrors = field(default_factory=StepErrors)
    twin_error: StepErrors = field(default_factory=StepErrors)

    def roundoff_violations(
        self,
        quantities: Sequence[str] = ("loss", "grads"),
        *,
        factor: float = ROUNDOFF_FACTOR,
        floor: float = ROUNDOFF_FLOOR,
    ) -> list[str]:
        """One line per quantity (``loss``, ``grads``, ``params``) whose parallel error exceeds
        ``factor`` x the twin's own error + ``floor``, worst step of each; empty when within."""
        if not self.exact_losses:
            raise ValueError("no float64 run to measure round-off against: compare_with_twin(..., exact=...)")
        if "grads" in quantities and not self.twin_error.grads:
            raise ValueError("no gradients recorded: put record_gradients() first in the optimizer chain")
        out = []
        for quantity in quantities:
            parallel, twin = self.parallel_error.worst(quantity), self.twin_error.worst(quantity)
            bound = self.roundoff_bound(quantity, factor=factor, floor=floor)
            if not parallel <= bound:
                bound_text = f"{factor:g} x twin error {twin:.3g} + {floor:.2g}"
                out.append(f"{quantity}: parallel error {parallel:.3g} > {bound_text}")
        return out

    def roundoff_bound(
        self, quantity: str, *, factor: float = ROUNDOFF_FACTOR, floor: float = ROUNDOFF_FLOOR
    ) -> float:
        """The largest error against the float64 run the parallel program may have in ``quantity``:
        ``factor`` x the twin's own (worst step) + ``floor``."""
        return factor * self.twin_error.worst(quantity) + floor

    def within_roundoff(self, quantities: Sequence[str] = ("loss", "grads"), **criterion) -> bool:
        """Whether the parallel program is within round-off of the math (:meth:`roundoff_violations`)."""
        return not self.roundoff_violations(quantities, **criterion)


def compare_with_twin(
    parallel: tuple[Callable, Callable],
    twin: tuple[Callable, Callable],
    params: PyTree,
    batches: Iterable[PyTree],
    *,
    lockstep: bool = False,
    exact: tuple[Callable, Callable] | None = None,
) -> TwinReport:
    """Run both ``(init, step)`` pairs on the same batches and compare.

    Gradients are compared when the optimizer contains :func:`record_gradients`;
    parameters after every step. ``exact`` is the twin in float64
    (``make_reference_step(..., dtype="float64")``), run under ``jax.enable_x64``
    on the batches in float64, the reference of :meth:`TwinReport.within_roundoff`.
    With ``lockstep`` the twin and the float64 run start every step from the
    parallel program's state (gathered to one device, without the per-device
    compression feedback), so only the error of one step is measured.
    """
    (p_init, p_step), (t_init, t_step) = parallel, twin
    p_state, t_state = p_init(params), t_init(params)
    x_state = None if exact is None else with_float64(exact[0], params)
    report = TwinReport()
    for batch in batches:
        if lockstep:
            t_state = twin_state_of(p_state, like=t_state)
            x_state = None if exact is None else with_float64(twin_state_of, p_state, like=x_state)
        p_state, p_metrics = p_step(p_state, batch)
        t_state, t_metrics = t_step(t_state, batch)
        _add_twin_step(report, p_state, t_state, float(p_metrics["loss"]), float(t_metrics["loss"]))
        if exact is not None:
            x_state, x_metrics = with_float64(exact[1], x_state, float64_batch(batch))
            _add_exact_step(report, p_state, t_state, x_state, float(x_metrics["loss"]), p_metrics, t_metrics)
    return report


def _add_twin_step(report: TwinReport, p_state, t_state, loss: float, twin_loss: float) -> None:
    report.losses.append(loss)
    report.twin_losses.append(twin_loss)
    report.max_loss_rel_err = max(report.max_loss_rel_err, relative_error(loss, twin_loss))
    report.max_param_rel_err = max(
        report.max_param_rel_err, relative_error(_as_twin(p_state.params, t_state.params), t_state.params)
    )
    grads = _recorded_or_none(p_state)
    if grads is not None:
        twin_grads = recorded(t_state.opt_state)
        report.max_grad_rel_err = max(
            report.max_grad_rel_err, relative_error(_as_twin(grads, twin_grads), twin_grads)
        )


def _add_exact_step(report: TwinReport, p_state, t_state, x_state, exact_loss: float, p_metrics, t_metrics):
    report.exact_losses.append(exact_loss)
    x_grads = _recorded_or_none(x_state)
    for errors, state, metrics in [
        (report.parallel_error, p_state, p_metrics),
        (report.twin_error, t_state, t_metrics),
    ]:
        grads = None if x_grads is None else recorded(state.opt_state)
        errors.add(float(metrics["loss"]), exact_loss, grads, x_grads, state.params, x_state.params)


def _recorded_or_none(state) -> PyTree | None:
    try:
        return recorded(state.opt_state)
    except ValueError:
        return None


def float64_batch(batch: PyTree) -> PyTree:
    """``batch`` with its floating leaves in float64 (host arrays: no float64 mode needed).

    Example:
        >>> float64_batch({"x": jnp.ones(2), "ids": jnp.arange(2)})["x"].dtype
        dtype('float64')
    """
    as_float64 = lambda x: np.asarray(x, np.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return jax.tree.map(as_float64, batch)


def with_float64(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` with float64 enabled (``jax.enable_x64``): how the float64 run
    (``make_reference_step(..., dtype="float64")``) is initialised and stepped. Under standard
    dtype promotion: a model that computes some values in at least float32 on purpose (flax's
    normalisation statistics) promotes them to float64, which strict promotion refuses; the
    float32 programs under test keep the caller's mode.

    Example:
        >>> with_float64(lambda: (jnp.ones(1, jnp.float64) + jnp.ones(1, jnp.float32)).dtype)
        dtype('float64')
    """
    with jax.enable_x64(True), jax.numpy_dtype_promotion("standard"):
        return fn(*args, **kwargs)


def _as_twin(tree: PyTree, like: PyTree) -> PyTree:
    """Whole host arrays in the twin's shapes: a state that stores stacked layers in chunks
    (an interleaved pipeline) holds them in the same order, reshaped."""
    return jax.tree.map(lambda x, t: np.asarray(x).reshape(np.shape(t)), tree, like)


def twin_state_of(state: PyTree, *, like: PyTree) -> PyTree:
    """A parallel program's ``state`` as a twin state: whole arrays on the default device, in the
    structure and shapes of the twin state ``like``, without the per-device compression feedback."""
    state = _as_twin(state._replace(feedback=like.feedback), like)
    return jax.tree.map(lambda x, t: jnp.asarray(x, dtype=t.dtype), state, like)
