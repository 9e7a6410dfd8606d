"""Slurm's compressed text formats: host lists, tasks per node, and the coordinator port.

Example:
    >>> expand_hostlist("gpu[03-04],login1")
    ['gpu03', 'gpu04', 'login1']
    >>> expand_tasks_per_node("2(x3),1", key="SLURM_TASKS_PER_NODE")
    [2, 2, 2, 1]
    >>> slurm_port(4242)
    61586
"""

from __future__ import annotations

import re

from torsh_jax.errors import DistributedError

__all__ = ["expand_hostlist", "expand_tasks_per_node", "slurm_port"]


def slurm_port(job_id: int) -> int:
    """Coordinator port derived from a Slurm job id, in [61440, 65535].

    Same rule as JAX's Slurm detection (jax/_src/clusters/slurm_cluster.py),
    so processes started by either agree.

    Example:
        >>> slurm_port(4242)
        61586
    """
    return job_id % 2**12 + (65535 - 2**12 + 1)


def expand_tasks_per_node(raw: str, *, key: str) -> list[int]:
    """``"2(x3),1"`` -> ``[2, 2, 2, 1]`` (Slurm's SLURM_TASKS_PER_NODE format).

    Raises:
        DistributedError: ``raw`` is not in that format (names ``key``).
    """
    counts: list[int] = []
    for part in raw.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise DistributedError(
                f"cannot parse {raw!r} (expected e.g. '2(x3),1')",
                key=key,
                fix="use counts like '2(x3),1' (SLURM_TASKS_PER_NODE syntax)",
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def expand_hostlist(hostlist: str, *, key: str = "SLURM_NODELIST") -> list[str]:
    """Expand a Slurm compressed host list.

    Example:
        >>> expand_hostlist("node[01-03,07],login2")
        ['node01', 'node02', 'node03', 'node07', 'login2']
        >>> expand_hostlist("r[1-2]-n[1-2]")
        ['r1-n1', 'r1-n2', 'r2-n1', 'r2-n2']
    """
    hosts: list[str] = []
    for item in _split_outside_brackets(hostlist, key=key):
        hosts += _expand_host(item, key=key)
    if not hosts:
        raise DistributedError("is empty", key=key, fix="run inside a Slurm allocation (srun/sbatch)")
    return hosts


def _split_outside_brackets(text: str, *, key: str) -> list[str]:
    items, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise DistributedError(
                f"unbalanced brackets in host list {text!r}",
                key=key,
                fix="close every '[' with ']' and do not nest brackets, as in node[01-04]",
            )
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if depth != 0:
        raise DistributedError(
            f"unbalanced brackets in host list {text!r}",
            key=key,
            fix="close every '[' with ']', as in node[01-04],login1",
        )
    return [item.strip() for item in [*items, current] if item.strip()]


def _expand_host(item: str, *, key: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    prefix, rest = item[: match.start()], item[match.end() :]
    values: list[str] = []
    for part in match.group(1).split(","):
        bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if bounds is None:
            raise DistributedError(
                f"bad range {part!r} in host list {item!r}", key=key, fix="use ranges like node[01-04,07]"
            )
        low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
        values += [f"{n:0{len(low)}d}" for n in range(int(low), int(high) + 1)]
    return [prefix + value + tail for value in values for tail in _expand_host(rest, key=key)]
