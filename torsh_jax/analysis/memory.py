"""Per-device memory of a compiled program, from ``compiled.memory_analysis()``.

XLA reports, for one device's program: argument, output, temporary
(scratch) and generated-code bytes, the bytes shared between
arguments and outputs through donation (alias), and the compiler's own
peak. Some backends return ``None`` or leave fields out; those read as
``None`` here.

Example:
    >>> import jax, jax.numpy as jnp
    >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones((256,), jnp.float32)).compile()
    >>> report = memory_report(compiled)
    >>> report.argument_bytes
    1024
    >>> report.peak_estimate_bytes >= 2048
    True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["MemoryReport", "memory_report", "peak_bytes", "peak_of", "temporaries_at_peak"]

_FIELDS = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "generated_code_bytes": "generated_code_size_in_bytes",
    "host_argument_bytes": "host_argument_size_in_bytes",
    "host_output_bytes": "host_output_size_in_bytes",
    "host_temp_bytes": "host_temp_size_in_bytes",
    "host_alias_bytes": "host_alias_size_in_bytes",
    "compiler_peak_bytes": "peak_memory_in_bytes",
}


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of one device's compiled program; ``None`` where the backend is silent.

    Attributes:
        argument_bytes: inputs (parameters, optimizer state, batch shards).
        output_bytes: outputs, including XLA's tuple index tables (8 bytes
            per tuple element on CPU).
        temp_bytes: scratch buffers live during the program.
        alias_bytes: output bytes that reuse donated argument buffers.
        generated_code_bytes: compiled code (0 on CPU).
        host_*: the same for host (pinned) memory, when offloading.
        compiler_peak_bytes: the compiler's own peak. libtpu's is the most its buffers (the
            arguments among them) hold at once, the figure its out-of-memory check holds to
            the chip's HBM; its ``temp`` is not what is live at that peak (more on large steps,
            less on some small ones: docs/targets.md). XLA:CPU reports ``argument + output + temp``.
    """

    argument_bytes: int | None = None
    output_bytes: int | None = None
    temp_bytes: int | None = None
    alias_bytes: int | None = None
    generated_code_bytes: int | None = None
    host_argument_bytes: int | None = None
    host_output_bytes: int | None = None
    host_temp_bytes: int | None = None
    host_alias_bytes: int | None = None
    compiler_peak_bytes: int | None = None

    @property
    def available(self) -> bool:
        """The backend reported argument, output and temp bytes."""
        return None not in (self.argument_bytes, self.output_bytes, self.temp_bytes)

    @property
    def peak_estimate_bytes(self) -> int | None:
        """``argument + output + temp − alias``: everything live at the peak, donated buffers once.

        An upper bound of the device's peak (XLA may free arguments or
        temporaries early); ``None`` when the backend did not report the
        parts. Missing alias bytes count as 0.
        """
        if not self.available:
            return None
        return self.argument_bytes + self.output_bytes + self.temp_bytes - (self.alias_bytes or 0)

    def to_dict(self) -> dict[str, int | None]:
        """Fields plus ``peak_estimate_bytes``, JSON-able."""
        return {**asdict(self), "peak_estimate_bytes": self.peak_estimate_bytes}


def peak_bytes(report: MemoryReport, platform: str) -> int | None:
    """One device's peak on ``platform``: libtpu's own on a TPU, whose ``temp`` is not what is live at
    its peak (docs/targets.md); elsewhere ``argument + output + temp - alias``.

    Example:
        >>> peak_bytes(MemoryReport(4, 4, 8, 4, compiler_peak_bytes=10), "tpu")
        10
        >>> peak_bytes(MemoryReport(4, 4, 8, 4, compiler_peak_bytes=16), "cpu")
        12
    """
    if platform == "tpu" and report.compiler_peak_bytes:
        return report.compiler_peak_bytes
    return report.peak_estimate_bytes


def peak_of(memory: dict) -> int | None:
    """The peak of a summary's ``memory`` section (:func:`~torsh_jax.analysis.summarize`): its
    ``peak_bytes`` (:func:`peak_bytes`, libtpu's own on a TPU), or ``peak_estimate_bytes`` in a
    summary recorded before ``peak_bytes`` was.

    Example:
        >>> peak_of({"peak_estimate_bytes": 12, "peak_bytes": 10}), peak_of({"peak_estimate_bytes": 12})
        (10, 12)
    """
    return memory.get("peak_bytes", memory.get("peak_estimate_bytes"))


def temporaries_at_peak(report: MemoryReport, platform: str) -> int | None:
    """The temporaries in :func:`peak_bytes`: the peak less the arguments and the outputs that do not
    reuse them (at least 0), so that the parts add up to the peak. Elsewhere than a TPU this is
    ``temp``. On a TPU it is what libtpu holds at its peak besides those, which its ``temp`` is not:
    that is more on some steps, less on others (on v5e-16, a one-layer ZeRO-3 step: ``temp`` 2.2 MB,
    peak 34.3 MB; the ``pp_1f1b`` preset at d_model 64: ``temp`` 36.4 MB, peak 2.5 MB;
    docs/targets.md).

    Example:
        >>> temporaries_at_peak(MemoryReport(4, 4, 8, 4, compiler_peak_bytes=10), "tpu")
        6
        >>> temporaries_at_peak(MemoryReport(4, 4, 8, 4), "cpu")
        8
    """
    peak = peak_bytes(report, platform)
    if peak is None or report.argument_bytes is None or report.output_bytes is None:
        return None
    return max(0, peak - report.argument_bytes - report.output_bytes + (report.alias_bytes or 0))


def _read(stats, attribute: str) -> int | None:
    value = getattr(stats, attribute, None)
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def memory_report(compiled) -> MemoryReport:
    """Per-device memory of ``compiled`` (``jax.jit(f).lower(...).compile()``).

    Returns:
        A :class:`MemoryReport`; every field is ``None`` when the backend
        offers no memory analysis.
    """
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError, AttributeError):
        stats = None
    if isinstance(stats, list | tuple):
        stats = stats[0] if stats else None
    if stats is None:
        return MemoryReport()
    return MemoryReport(**{field: _read(stats, attr) for field, attr in _FIELDS.items()})
