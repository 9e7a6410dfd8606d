"""Inspection of compiled programs: every collective and per-device memory, from the HLO.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from torsh_jax.analysis import collectives, memory_report
    >>> mesh = jax.make_mesh((len(jax.devices()),), ("data",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
    ...                   in_specs=P("data"), out_specs=P(), check_vma=False)
    >>> compiled = jax.jit(f).lower(jnp.ones((mesh.size, 4))).compile()
    >>> memory_report(compiled).argument_bytes
    16
"""

from torsh_jax.analysis import theory
from torsh_jax.analysis.hlo import KINDS, Collective, collectives, collectives_from_text
from torsh_jax.analysis.memory import MemoryReport, memory_report
from torsh_jax.analysis.report import render_text, summarize
from torsh_jax.analysis.theory import Theory, TheoryCollective

__all__ = [
    "KINDS",
    "Collective",
    "collectives",
    "collectives_from_text",
    "MemoryReport",
    "memory_report",
    "summarize",
    "render_text",
    "theory",
    "Theory",
    "TheoryCollective",
]
