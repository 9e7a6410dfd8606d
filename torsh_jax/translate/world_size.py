"""``world_size`` (``--world-size``), the processes of the job a translator plans for.

Example:
    >>> check_world_size(8)  # fine: nothing
    >>> try:
    ...     check_world_size(0)
    ... except ValueError as err:
    ...     print(str(err).split(". Fix")[0])
    world_size: must be an integer >= 1, got 0
"""

from __future__ import annotations

from torsh_jax.errors import TranslationError

__all__ = ["check_world_size"]


def check_world_size(world_size: int | None, /) -> None:
    """Refuse a ``world_size`` that is given but is not a positive integer."""
    if world_size is None:
        return
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise TranslationError(
            f"must be an integer >= 1, got {world_size!r}",
            key="world_size",
            fix="pass --world-size as a positive integer (processes in the job)",
        )
