"""Process layout and communication knobs from Horovod launch flags and variables.

Sources: horovod/runner/launch.py (``-np``, ``-H host:slots``,
``--slots-per-host``), horovod/runner/common/util/config_parser.py
(``--fusion-threshold-mb`` becomes ``HOROVOD_FUSION_THRESHOLD`` = MB x 1024 x
1024 bytes; ``--hierarchical-allreduce`` becomes
``HOROVOD_HIERARCHICAL_ALLREDUCE=1``).

Example:
    >>> layout = Layout(world_size=8, hosts=[("a", 4), ("b", 4)], hierarchical=True)
    >>> layout_mesh(layout).data
    AxisSize(ici=4, dcn=2)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torsh_jax.errors import TranslationError
from torsh_jax.plan.spec import AxisSize, MeshSpec
from torsh_jax.translate.hvd_launch import LaunchFlag
from torsh_jax.translate.hvd_tables import HOROVOD_ENV, env_role
from torsh_jax.translate.overrides import MAX_PROCESSES, NoteBook, as_bool, as_float, as_int

__all__ = ["Layout", "apply_flag", "apply_env", "layout_mesh", "parse_hosts"]

_MIB = 1024 * 1024


@dataclass
class Layout:
    """What the launch says about processes, hosts and communication."""

    world_size: int | None = None
    world_size_key: str | None = None
    hosts: list[tuple[str, int]] | None = None
    hostfile: str | None = None
    slots_per_host: int | None = None
    fusion_flag_bytes: int | None = None
    fusion_env_bytes: int | None = None
    cpu_fusion_bytes: int | None = None
    hierarchical: bool | None = None
    hierarchical_key: str | None = None
    hierarchical_value: Any = None
    launcher: str | None = None
    script: str | None = None
    env: dict[str, str | None] = field(default_factory=dict)

    @property
    def fusion_bytes(self) -> int | None:
        for value in (self.fusion_flag_bytes, self.fusion_env_bytes, self.cpu_fusion_bytes):
            if value is not None:
                return value
        return None

    def total_slots(self) -> int | None:
        return sum(slots for _, slots in self.hosts) if self.hosts else None

    def uniform_slots(self) -> int | None:
        if self.hosts:
            sizes = {slots for _, slots in self.hosts}
            return sizes.pop() if len(sizes) == 1 else None
        return self.slots_per_host

    def hierarchical_split(self) -> tuple[int, int] | None:
        """``(processes per host, hosts)`` when the layout is known and even."""
        per_host = self.uniform_slots()
        if not per_host or not self.world_size or self.world_size % per_host:
            return None
        hosts = self.world_size // per_host
        if self.hosts and hosts > len(self.hosts):
            return None
        return per_host, hosts

    def extras(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.hosts:
            out["hosts"] = [{"host": h, "slots": s} for h, s in self.hosts]
            out["num_hosts"] = len(self.hosts)
        if self.uniform_slots():
            out["processes_per_host"] = self.uniform_slots()
        if self.hostfile:
            out["hostfile"] = self.hostfile
        if self.fusion_bytes is None:
            out["fusion_threshold_bytes"] = {"value": 128 * _MIB, "from": "Horovod default (128 MiB)"}
        else:
            out["fusion_threshold_bytes"] = {"value": self.fusion_bytes, "from": "launch settings"}
        return out

    def finish(self, book: NoteBook) -> None:
        """Note hierarchical allreduce, once the world size is known."""
        if self.hierarchical_key is None:
            return
        if not self.hierarchical:
            book.mapped(self.hierarchical_key, self.hierarchical_value, "flat data axis (the default)")
            return
        split = self.hierarchical_split()
        if split:
            detail = (
                f"mesh.data = {{ici = {split[0]}, dcn = {split[1]}}}: reductions within a host and across "
                "hosts are separate mesh parts; XLA picks the algorithm"
            )
        else:
            detail = (
                "host layout unknown or uneven, data axis kept flat; give -H host:slots, or set "
                "mesh.data.ici / mesh.data.dcn with --set"
            )
        book.approximated(self.hierarchical_key, self.hierarchical_value, detail)


def parse_hosts(text: str, key: str) -> list[tuple[str, int]]:
    """``"a:4,b:4"`` -> ``[("a", 4), ("b", 4)]``; a host without slots has one."""
    hosts = []
    for item in text.split(","):
        name, sep, slots = item.strip().rpartition(":")
        if not sep:
            name, slots = slots, "1"
        if not name:
            raise TranslationError(f"empty host name in {text!r}", key=key, fix="write host:slots,host:slots")
        hosts.append((name, as_int(slots, key, minimum=1, maximum=MAX_PROCESSES)))
    return hosts


def _set_fusion(
    layout: Layout, attr: str, value: Any, key: str, scale: int, book: NoteBook, what: str
) -> None:
    amount = as_float(value, key)
    if amount * scale > 2**53:
        raise TranslationError(
            f"fusion threshold {value!r} is too large",
            key=key,
            fix="give a fusion threshold below 2**53 bytes",
        )
    setattr(layout, attr, int(amount * scale))
    mb = amount * scale / 1e6
    book.mapped(key, value, f"communication.bucket_mb = {mb:g} ({what})")


def apply_flag(flag: LaunchFlag, key: str, value: Any, layout: Layout, book: NoteBook) -> None:
    """Apply one launcher flag to ``layout`` and note it."""
    role = flag.role
    if role.startswith("ignored: "):
        book.ignored(key, value, role[len("ignored: ") :])
    elif role == "num_proc":
        _apply_num_proc(flag.values[0], key, layout, book)
    elif role == "hosts":
        layout.hosts = parse_hosts(flag.values[0], key)
        book.mapped(
            key, value, f"{len(layout.hosts)} host(s) with {layout.total_slots()} slot(s) (extras.hosts)"
        )
    elif role == "hostfile":
        layout.hostfile = flag.values[0]
        book.approximated(key, value, "hosts are read at launch time; the host layout is unknown here")
    elif role == "slots":
        layout.slots_per_host = as_int(flag.values[0], key, minimum=1, maximum=MAX_PROCESSES)
        book.mapped(key, value, f"{layout.slots_per_host} processes per host (extras.processes_per_host)")
    elif role == "fusion_mb":
        _set_fusion(layout, "fusion_flag_bytes", flag.values[0], key, _MIB, book, "MiB, 0 = no fusion")
    elif role in ("hier_on", "hier_off"):
        if layout.hierarchical_key is not None:
            book.ignored(layout.hierarchical_key, layout.hierarchical_value, f"{key} sets it instead")
        layout.hierarchical = role == "hier_on"
        layout.hierarchical_key, layout.hierarchical_value = key, value
    elif role == "config_file":
        book.ignored(
            key,
            value,
            "the YAML file is not read; its knobs (fusion, cycle time, autotune) are tuning only, "
            "pass --fusion-threshold-mb to set the bucket size",
        )
    elif role == "mca":
        book.ignored(
            key, list(flag.values), "Open MPI module parameter; JAX's distributed start-up replaces it"
        )
    else:
        raise TranslationError(
            f"no handler for launch option role {role!r}",
            key=key,
            fix="report this launch option; its role has no translation rule",
        )


def _apply_num_proc(text: str, key: str, layout: Layout, book: NoteBook) -> None:
    if text.startswith("$"):
        book.approximated(key, text, "a shell variable; the world size is unknown, pass --world-size N")
        return
    layout.world_size = as_int(text, key, minimum=1, maximum=MAX_PROCESSES)
    layout.world_size_key = key
    book.mapped(key, text, f"world size {layout.world_size} (extras.world_size); mesh.data fills the devices")


def apply_env(name: str, value: str | None, key: str, layout: Layout, book: NoteBook) -> None:
    """Apply one environment variable to ``layout`` and note it."""
    layout.env[name] = value
    role = env_role(name)
    if role is None:
        import difflib

        close = difflib.get_close_matches(name, list(HOROVOD_ENV), n=3)
        book.unsupported(
            key,
            value,
            "not a Horovod variable this translator knows",
            fix=f"did you mean {close}?" if close else "check the name against Horovod's documentation",
        )
        return
    if value is None:
        book.ignored(key, value, "passed through from the launching shell; its value is not in the file")
    elif role.startswith("ignored: "):
        book.ignored(key, value, role[len("ignored: ") :])
    elif role == "fusion_bytes":
        _set_fusion(layout, "fusion_env_bytes", value, key, 1, book, "bytes")
    elif role == "cpu_fusion_bytes":
        _set_fusion(layout, "cpu_fusion_bytes", value, key, 1, book, "bytes, CPU operations")
    elif role == "hier_env":
        if layout.hierarchical_key is None or not layout.hierarchical_key.startswith(
            ("horovodrun", "mpirun")
        ):
            layout.hierarchical = as_bool(value, key)
            layout.hierarchical_key, layout.hierarchical_value = key, value
        else:
            book.ignored(key, value, "the launch flag sets hierarchical allreduce instead")


def layout_mesh(layout: Layout) -> MeshSpec:
    """Pure data parallelism; split into in-host x across-host parts for hierarchical allreduce."""
    split = layout.hierarchical_split() if layout.hierarchical else None
    if split:
        return MeshSpec(data=AxisSize(ici=split[0], dcn=split[1]))
    return MeshSpec()
