"""``demo --verify``: the single-device twin and the twin in float64 beside the parallel run.

Each step, the twin (float32, the plan's precision policy) and the same math in float64 take the
batch the parallel step took. The summary keeps ``max_rel_err`` (the largest relative loss
difference from the twin) and judges the twin criterion on the losses
(:meth:`~torsh_jax.runtime.verify.TwinReport.within_roundoff`): the parallel run's loss error
against float64 is at most 4 x the twin's own + 8 float32 ulps, worst step of each.

Example:
    >>> import jax.numpy as jnp, optax
    >>> from torsh_jax.plan import ParallelPlan
    >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> twins = DemoTwins(loss, optax.sgd(0.1), ParallelPlan())
    >>> batch = {"x": jnp.ones((2, 3)), "y": jnp.ones((2, 1))}
    >>> twins.start({"w": jnp.zeros((3, 1))})
    >>> twins.step(batch, loss=1.0)
    1.0
    >>> summary = twins.summary()
    >>> summary["max_rel_err"], summary["within_roundoff"]
    (0.0, True)
"""

from __future__ import annotations

from collections.abc import Callable

import optax

from torsh_jax.plan.spec import ParallelPlan
from torsh_jax.runtime.twin import make_reference_step
from torsh_jax.runtime.verify import TwinReport, float64_batch, relative_error, twin_state_of, with_float64
from torsh_jax.typing import PyTree

__all__ = ["DemoTwins", "SUMMARY_KEYS"]

#: the summary keys of ``demo --verify`` (docs/cli.md)
SUMMARY_KEYS = ("max_rel_err", "within_roundoff", "parallel_vs_float64", "twin_vs_float64", "roundoff_bound")


class DemoTwins:
    """The twin and its float64 run of one demo, stepped beside it; :meth:`summary` gives the keys."""

    def __init__(self, loss_fn: Callable, optimizer: optax.GradientTransformation, plan: ParallelPlan):
        self.twin = make_reference_step(loss_fn, optimizer, plan)
        self.exact = make_reference_step(loss_fn, optimizer, plan, dtype="float64")
        self.report = TwinReport()
        self.states: tuple[PyTree, PyTree] | None = None

    def start(self, params: PyTree, state: PyTree | None = None) -> None:
        """Both start from ``params``, or (resuming) from the parallel ``state`` on one device."""
        twin_state, exact_state = self.twin[0](params), with_float64(self.exact[0], params)
        if state is not None:
            twin_state = twin_state_of(state, like=twin_state)
            exact_state = with_float64(twin_state_of, state, like=exact_state)
        self.states = twin_state, exact_state

    def compile(self, batch: PyTree) -> None:
        """Compile both steps now, not inside the first step."""
        twin_state, exact_state = self.states
        self.twin[1].lower(twin_state, batch).compile()
        with_float64(lambda: self.exact[1].lower(exact_state, float64_batch(batch)).compile())

    def step(self, batch: PyTree, *, loss: float) -> float:
        """Step both on ``batch``, record their losses against the parallel ``loss``; the twin's loss."""
        (twin_state, twin_metrics), (exact_state, exact_metrics) = (
            self.twin[1](self.states[0], batch),
            with_float64(self.exact[1], self.states[1], float64_batch(batch)),
        )
        self.states = twin_state, exact_state
        twin_loss, exact_loss = float(twin_metrics["loss"]), float(exact_metrics["loss"])
        report = self.report
        report.losses.append(loss)
        report.twin_losses.append(twin_loss)
        report.exact_losses.append(exact_loss)
        report.max_loss_rel_err = max(report.max_loss_rel_err, abs(loss - twin_loss) / abs(twin_loss))
        report.parallel_error.loss.append(relative_error(loss, exact_loss))
        report.twin_error.loss.append(relative_error(twin_loss, exact_loss))
        return twin_loss

    def summary(self) -> dict:
        """The summary keys: ``max_rel_err``, ``within_roundoff``, ``parallel_vs_float64``,
        ``twin_vs_float64``, ``roundoff_bound`` (all ``None`` before any step)."""
        report = self.report
        if not report.exact_losses:
            keys = (
                "max_rel_err",
                "within_roundoff",
                "parallel_vs_float64",
                "twin_vs_float64",
                "roundoff_bound",
            )
            return dict.fromkeys(keys)
        return {
            "max_rel_err": report.max_loss_rel_err,
            "within_roundoff": report.within_roundoff(("loss",)),
            "parallel_vs_float64": report.parallel_error.worst("loss"),
            "twin_vs_float64": report.twin_error.worst("loss"),
            "roundoff_bound": report.roundoff_bound("loss"),
        }
