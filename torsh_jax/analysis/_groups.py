"""Replica groups of HLO collectives, and which mesh axes they run over.

HLO prints replica groups either explicitly, ``{{0,1},{2,3}}``, or in iota
form, ``[2,4]<=[8]`` (2 groups of 4: ``arange(8).reshape(2, 4)``) and
``[4,2]<=[2,4]T(1,0)`` (``arange(8).reshape(2, 4).transpose(1, 0).reshape(4, 2)``).
The ids mean different things depending on the collective's mode (see
:func:`device_groups`); for jax's SPMD programs (one replica, N partitions)
they are partition ids, i.e. positions in the mesh's flattened device order.

Example:
    >>> parse_replica_groups("[4,2]<=[2,4]T(1,0)")
    ((0, 4), (1, 5), (2, 6), (3, 7))
    >>> axes_for_groups([[0, 4], [1, 5], [2, 6], [3, 7]], {"data": 2, "fsdp": 4})
    ('data',)
"""

from __future__ import annotations

import itertools
import math
import re

import numpy as np

from torsh_jax.errors import NotSupportedYetError

__all__ = ["parse_replica_groups", "parse_pairs", "pair_components", "device_groups", "axes_for_groups"]

Groups = tuple[tuple[int, ...], ...]

_IOTA_RE = re.compile(r"^\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?$")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _mesh_device_ids(text: str, count: int) -> np.ndarray:
    """Device id at each mesh position: ``device_ids=([2,4]T(1,0))`` (iota) or a list; default iota."""
    found = re.search(r"device_ids=\((.*)\)\s*\{", text)
    if found is None:
        return np.arange(count)
    body = found.group(1)
    iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", body.strip())
    if iota:
        ids = np.arange(count).reshape(_ints(iota.group(1)))
        return (ids.transpose(_ints(iota.group(2))) if iota.group(2) else ids).ravel()
    return np.asarray(_ints(body))


def _mesh_groups(text: str) -> Groups:
    """Groups of the ``mesh['a'=2,'b'=4] {'b'}`` form (optionally with ``device_ids=(...)``):
    devices that differ only along the named axes.

    >>> _mesh_groups("mesh['a'=2,'b'=4] {'b'}")
    ((0, 1, 2, 3), (4, 5, 6, 7))
    >>> _mesh_groups("mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}")
    ((0, 1, 2, 3), (4, 5, 6, 7))
    """
    sizes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", text.split("]")[0])]
    chosen = re.findall(r"'([^']+)'", text.rsplit("{", 1)[1])
    names = [n for n, _ in sizes]
    shape = [s for _, s in sizes]
    ids = _mesh_device_ids(text, math.prod(shape)).reshape(shape)
    order = [names.index(n) for n in names if n not in chosen] + [names.index(n) for n in chosen]
    group_size = math.prod(dict(sizes)[n] for n in chosen) if chosen else 1
    return tuple(tuple(int(i) for i in row) for row in ids.transpose(order).reshape(-1, group_size))


def parse_replica_groups(text: str | None) -> Groups:
    """Groups from an HLO ``replica_groups=`` value; ``()`` for ``{}`` or ``None``.

    Example:
        >>> parse_replica_groups("{{0,1},{2,3}}")
        ((0, 1), (2, 3))
        >>> parse_replica_groups("[2,4]<=[8]")
        ((0, 1, 2, 3), (4, 5, 6, 7))
    """
    if text is None:
        return ()
    text = text.strip()
    iota = _IOTA_RE.match(text)
    if iota:
        shape, dims = _ints(iota.group(1)), _ints(iota.group(2))
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose(_ints(iota.group(3)))
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape[0], -1))
    if text.startswith("{"):
        return tuple(tuple(_ints(group)) for group in re.findall(r"\{([\d,\s]*)\}", text[1:-1]))
    if text.startswith("mesh["):
        return _mesh_groups(text)
    raise NotSupportedYetError(
        f"cannot read replica groups {text!r}",
        key="hlo.replica_groups",
        fix="expected '{{0,1},...}' or an iota form such as '[2,4]<=[8]'",
    )


def parse_pairs(text: str | None) -> tuple[tuple[int, int], ...]:
    """``source_target_pairs={{0,1},{1,2}}`` -> ``((0, 1), (1, 2))``."""
    groups = parse_replica_groups(text)
    return tuple((g[0], g[1]) for g in groups if len(g) == 2)


def pair_components(pairs: tuple[tuple[int, int], ...]) -> Groups:
    """Connected components (sorted) of the devices a collective-permute links."""
    parent: dict[int, int] = {}

    def root(i: int) -> int:
        while parent.setdefault(i, i) != i:
            i = parent[i]
        return i

    for source, target in pairs:
        parent[root(source)] = root(target)
    components: dict[int, list[int]] = {}
    for device in sorted(parent):
        components.setdefault(root(device), []).append(device)
    return tuple(sorted(tuple(c) for c in components.values()))


def device_groups(
    groups: Groups,
    *,
    mode: str,
    replica_count: int,
    num_partitions: int,
) -> Groups:
    """Groups of flattened device ids (``replica * num_partitions + partition``).

    Args:
        groups: parsed ``replica_groups`` (``()`` means one group of all ids).
        mode: XLA's collective op group mode: ``cross_replica`` (no channel
            id: groups of replicas, per partition), ``cross_partition``
            (channel id, all-to-all/collective-permute: groups of partitions,
            per replica), ``cross_replica_and_partition`` (channel id without
            ``use_global_device_ids``: groups of replicas times all
            partitions) or ``flattened_id`` (``use_global_device_ids=true``).
        replica_count: replicas of the module.
        num_partitions: partitions of the module.

    Example:
        >>> device_groups(((0,),), mode="cross_replica_and_partition", replica_count=1, num_partitions=4)
        ((0, 1, 2, 3),)
    """
    total = replica_count * num_partitions
    if mode == "flattened_id":
        return groups or (tuple(range(total)),)
    if mode == "cross_partition":
        groups = groups or (tuple(range(num_partitions)),)
        return tuple(tuple(r * num_partitions + p for p in g) for r in range(replica_count) for g in groups)
    groups = groups or (tuple(range(replica_count)),)
    if mode == "cross_replica":
        return tuple(tuple(r * num_partitions + p for r in g) for p in range(num_partitions) for g in groups)
    if mode == "cross_replica_and_partition":
        return tuple(tuple(r * num_partitions + p for r in g for p in range(num_partitions)) for g in groups)
    raise NotSupportedYetError(
        f"unknown collective group mode {mode!r}",
        key="hlo.mode",
        fix="report this HLO module; the collective group mode is not one XLA documents",
    )


def _axis_subset_groups(shape: dict[str, int], axes: tuple[str, ...]) -> list[tuple[int, ...]]:
    """Device groups (mesh positions) varying over ``axes`` in that order, others fixed."""
    names = list(shape)
    ids = np.arange(math.prod(shape.values())).reshape(tuple(shape.values()))
    order = [names.index(a) for a in names if a not in axes] + [names.index(a) for a in axes]
    size = math.prod(shape[a] for a in axes)
    return [tuple(int(i) for i in row) for row in ids.transpose(order).reshape(-1, size)]


def _candidate_subsets(shape: dict[str, int]) -> list[tuple[str, ...]]:
    """Non-empty subsets of the axes larger than 1, in mesh order, smallest first."""
    names = [a for a, size in shape.items() if size > 1]
    subsets = [s for r in range(1, len(names) + 1) for s in itertools.combinations(names, r)]
    return sorted(subsets, key=lambda s: (math.prod(shape[a] for a in s), len(s)))


def axes_for_groups(groups, shape: dict[str, int]) -> tuple[str, ...] | None:
    """The mesh axes whose device groups are ``groups`` (given as mesh positions).

    Matching, in order of preference: the groups equal the groups of an axis
    subset with the same device order inside each group (this tells
    ``("fsdp", "data")`` from ``("data", "fsdp")``); equal as sets; else the
    smallest axis subset each group lies within (collective-permutes that link
    only some devices). Groups of one device give ``()``; ids outside the
    mesh give ``None``.

    Example:
        >>> axes_for_groups([[0, 1, 2, 3, 4, 5, 6, 7]], {"data": 2, "fsdp": 4})
        ('data', 'fsdp')
    """
    groups = [tuple(g) for g in groups if len(g) > 0]
    if any(not 0 <= d < math.prod(shape.values()) for g in groups for d in g):
        return None
    if all(len(g) == 1 for g in groups):
        return ()
    ordered = sorted(groups)
    as_sets = {frozenset(g) for g in groups}
    subsets = _candidate_subsets(shape)
    for subset in subsets:
        for perm in itertools.permutations(subset):
            if sorted(_axis_subset_groups(shape, perm)) == ordered:
                return perm
    for subset in subsets:
        if {frozenset(g) for g in _axis_subset_groups(shape, subset)} == as_sets:
            return subset
    for subset in subsets:
        blocks = [frozenset(g) for g in _axis_subset_groups(shape, subset)]
        if all(any(frozenset(g) <= b for b in blocks) for g in groups):
            return subset
    return None
