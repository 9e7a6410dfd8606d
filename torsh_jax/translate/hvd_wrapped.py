"""The optimizer a Horovod ``DistributedOptimizer`` wraps -> :class:`OptimizerSpec`.

Sources: torch/optim/sgd.py (``SGD(params, lr, momentum=0, dampening=0,
weight_decay=0, nesterov=False)``, L2 decay added to the gradient),
torch/optim/adam.py and adamw.py (``betas``, ``eps=1e-8``, AdamW's
``weight_decay=1e-2``), keras/optimizers (``SGD(learning_rate=0.01, momentum,
nesterov)``, ``Adam(learning_rate=0.001, beta_1, beta_2, epsilon=1e-7)``) and
tensorflow/python/training/adam.py (``AdamOptimizer(learning_rate=0.001, beta1,
beta2, epsilon=1e-8)``). TensorFlow's Adam adds epsilon after folding the bias
correction into the step size, so it is noted as approximated.

Learning rates scaled by ``hvd.size()`` resolve when the world size is known;
otherwise the base rate is used and the note says so.

Example:
    >>> from torsh_jax.translate.hvd_pyexpr import CallValue, Evaluated
    >>> from torsh_jax.translate.overrides import NoteBook
    >>> call = CallValue("optim.SGD", (), {"lr": 0.1, "momentum": 0.9})
    >>> spec = wrapped_optimizer(Evaluated(call), None, "DistributedOptimizer.optimizer", NoteBook())
    >>> spec.name, spec.learning_rate, spec.params
    ('sgd', 0.1, {'momentum': 0.9})
"""

from __future__ import annotations

from typing import Any

from torsh_jax.plan.spec import OptimizerSpec
from torsh_jax.translate.hvd_pyexpr import CallValue, Evaluated, Unknown, shown
from torsh_jax.translate.overrides import NoteBook, as_bool, as_float

__all__ = ["wrapped_optimizer", "OPTIMIZER_CLASSES"]

#: (framework, class) -> (plan optimizer, positional argument names, defaults)
OPTIMIZER_CLASSES: dict[tuple[str, str], tuple[str, tuple[str, ...], dict[str, Any]]] = {
    ("torch", "SGD"): (
        "sgd",
        ("params", "lr", "momentum", "dampening", "weight_decay", "nesterov"),
        {"lr": 1e-3},
    ),
    ("torch", "Adam"): ("adam", ("params", "lr", "betas", "eps", "weight_decay", "amsgrad"), {"lr": 1e-3}),
    ("torch", "AdamW"): (
        "adamw",
        ("params", "lr", "betas", "eps", "weight_decay", "amsgrad"),
        {"lr": 1e-3, "weight_decay": 1e-2},
    ),
    ("keras", "SGD"): ("sgd", ("learning_rate", "momentum", "nesterov"), {"learning_rate": 0.01}),
    ("keras", "Adam"): (
        "adam",
        ("learning_rate", "beta_1", "beta_2", "epsilon", "amsgrad"),
        {"learning_rate": 1e-3, "epsilon": 1e-7},
    ),
    ("tf1", "AdamOptimizer"): (
        "adam",
        ("learning_rate", "beta1", "beta2", "epsilon"),
        {"learning_rate": 1e-3},
    ),
    ("tf1", "GradientDescentOptimizer"): ("sgd", ("learning_rate",), {}),
    ("tf1", "MomentumOptimizer"): (
        "sgd",
        ("learning_rate", "momentum", "use_locking", "name", "use_nesterov"),
        {},
    ),
}
_PARAM_NAMES = {
    "momentum": "momentum",
    "nesterov": "nesterov",
    "use_nesterov": "nesterov",
    "weight_decay": "weight_decay",
    "beta_1": "b1",
    "beta1": "b1",
    "beta_2": "b2",
    "beta2": "b2",
    "eps": "eps",
    "epsilon": "eps",
}
_IGNORED = {
    "params": "the model's parameters; the plan optimizes the whole parameter pytree",
    "use_locking": "TensorFlow variable locking; JAX updates are functional",
    "name": "TensorFlow op name",
    "foreach": "torch kernel choice; same update",
    "fused": "torch kernel choice; same update",
    "capturable": "CUDA graph capture switch; same update",
}
_LR_NAMES = ("lr", "learning_rate")
_TF_EPSILON = "TensorFlow adds epsilon after folding bias correction into the step size (epsilon-hat)"


def _framework(func: str) -> str:
    if func.startswith(("torch.", "optim.")):
        return "torch"
    if func.startswith("tf.train."):
        return "tf1"
    return "keras"


def _arguments(call: CallValue, order: tuple[str, ...]) -> dict[str, Any]:
    values = {order[i] if i < len(order) else f"arg{i}": v for i, v in enumerate(call.args)}
    values.update(call.kwargs)
    return values


def _learning_rate(
    actual: Any, base: Any, key: str, book: NoteBook, assumptions: tuple[str, ...]
) -> float | None:
    if isinstance(actual, (int, float)) and not isinstance(actual, bool):
        rate = as_float(actual, key)
        if assumptions:
            book.approximated(key, rate, f"optimizer.learning_rate = {rate:g}; {'; '.join(assumptions)}")
        else:
            book.mapped(key, rate, f"optimizer.learning_rate = {rate:g}")
        return rate
    if isinstance(base, (int, float)) and not isinstance(base, bool):
        rate = as_float(base, key)
        detail = (
            f"optimizer.learning_rate = {rate:g}, the base rate: the script multiplies it by "
            "hvd.size() or hvd.local_size(), unknown here; pass --world-size N (and -H host:slots)"
        )
        book.approximated(key, shown(actual), detail)
        return rate
    detail = "not in the excerpt; the optimizer's default is used. Fix: --set optimizer.learning_rate=..."
    book.approximated(key, shown(actual), detail)
    return None


def _param(name: str, value: Any, key: str, params: dict[str, Any], book: NoteBook, tf_adam: bool) -> None:
    target = _PARAM_NAMES[name]
    if isinstance(value, Unknown):
        book.approximated(key, value.source, "not in the excerpt; the optimizer's default is used")
        return
    params[target] = as_bool(value, key) if target == "nesterov" else as_float(value, key)
    if target == "eps" and tf_adam:
        book.approximated(key, value, f"optimizer.params.eps = {params[target]:g}; {_TF_EPSILON}")
    else:
        book.mapped(key, value, f"optimizer.params.{target} = {params[target]}")


def _apply_argument(name: str, value: Any, key: str, params: dict, book: NoteBook, tf_adam: bool) -> None:
    if name in _IGNORED:
        book.ignored(key, shown(value), _IGNORED[name])
    elif name == "betas":
        betas = value if isinstance(value, tuple) and len(value) == 2 else None
        if betas is None:
            book.approximated(key, shown(value), "not a pair in the excerpt; the default betas are used")
            return
        params["b1"], params["b2"] = as_float(betas[0], key), as_float(betas[1], key)
        book.mapped(key, list(betas), f"optimizer.params.b1 = {params['b1']}, b2 = {params['b2']}")
    elif name in _PARAM_NAMES:
        _param(name, value, key, params, book, tf_adam)
    elif name in ("dampening", "amsgrad") and (value in (0, 0.0, False, None)):
        book.mapped(key, value, "the default (off)")
    elif isinstance(value, Unknown):
        book.approximated(key, value.source, "not in the excerpt; the optimizer's default is assumed")
    else:
        what = f"{name!r} of the wrapped optimizer has no equivalent here"
        book.unsupported(
            key, shown(value), what, fix="drop it, or name an optimizer with --set optimizer.name=..."
        )


def wrapped_optimizer(
    actual: Evaluated, base: Evaluated | None, key: str, book: NoteBook
) -> OptimizerSpec | None:
    """Translate the wrapped optimizer; notes go under ``key`` and ``key.<argument>``.

    Args:
        actual: the evaluated optimizer expression (world size applied when known).
        base: the same with ``hvd.size()`` taken as 1 (the base learning rate).
        key: note key of the optimizer argument.
        book: where notes go.

    Returns:
        The spec, or None when the optimizer class has no translation.
    """
    call = actual.value
    if not isinstance(call, CallValue):
        book.ignored(
            key, shown(call), "built elsewhere in the script; name one with --set optimizer.name=..."
        )
        return None
    entry = OPTIMIZER_CLASSES.get((_framework(call.func), call.func.rsplit(".", 1)[-1]))
    if entry is None:
        book.ignored(
            key, shown(call), f"{call.func} has no translation; name one with --set optimizer.name=..."
        )
        return None
    name, order, defaults = entry
    arguments = _arguments(call, order)
    base_call = base.value if base is not None and isinstance(base.value, CallValue) else call
    base_arguments = _arguments(base_call, order)
    tf_adam = name == "adam" and _framework(call.func) != "torch"
    params: dict[str, Any] = {k: v for k, v in defaults.items() if k not in _LR_NAMES}
    params = {_PARAM_NAMES.get(k, k): v for k, v in params.items()}
    rate = None
    for argument, value in arguments.items():
        sub_key = f"{key}.{argument}"
        if argument in _LR_NAMES:
            rate = _learning_rate(value, base_arguments.get(argument), sub_key, book, actual.assumptions)
        else:
            _apply_argument(argument, value, sub_key, params, book, tf_adam)
    rate = rate if rate is not None else next((v for k, v in defaults.items() if k in _LR_NAMES), 1e-3)
    detail = f"optimizer = {name} (learning rate {rate:g})" + (f"; {_TF_EPSILON}" if tf_adam else "")
    book.add(key, "approximated" if tf_adam else "mapped", f"{call.func}(...)", detail)
    return OptimizerSpec(name=name, learning_rate=rate, params=params)
