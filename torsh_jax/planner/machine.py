"""The machine a plan runs on, as the cost model needs it: compute rate, links, memory.

A :class:`Machine` holds per-device sustained FLOP/s, device memory, and an α-β model per link
kind: a collective step costs ``α`` seconds of latency plus its bytes over ``β`` bytes/s. A mesh
axis travels over ICI/NVLink inside a slice or node and over DCN/InfiniBand across them.

Where figures come from, in order: a machine file written by ``torsh-jax calibrate`` (measured
here), else a target's published figures (:data:`torsh_jax.targets.CHIPS`, sources named there)
with the assumptions of :data:`ASSUMED` for what is not published.

Example:
    >>> m = Machine.from_target("v5e-16")
    >>> m.devices, m.link("ici").bytes_per_s / 1e9, m.overlaps
    (16, 200.0, True)
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from torsh_jax.errors import MeshError, PlanError

__all__ = ["ALGORITHMS", "Link", "Machine", "ASSUMED", "CODEC_VS_INT8"]

#: What a target's published figures leave out, assumed until ``calibrate`` measures it.
ASSUMED = {
    "compute_efficiency": 0.5,  # sustained / peak FLOP/s of a training step's matmuls
    "ici_alpha_s": 5e-6,  # per collective step inside a slice / node
    "dcn_alpha_s": 25e-6,  # per collective step across slices / nodes
}
#: Encode and decode time per element of a compression method over int8's, where the machine has
#: no measurement of its own (``calibrate`` measures top-k and PowerSGD; a target has neither):
#: XLA:CPU, 8 simulated devices, 1 Mi and 256 Ki values per device, the methods' default settings
#: (top-k 1 % of chunks of 4,096; PowerSGD rank 4): top-k 194-196 ns, PowerSGD 20-28 ns, int8 22 ns
#: per value. Assumed to carry over to other machines. The blockwise, fp8 and cast methods are
#: taken at int8's rate (the same passes over the values).
CODEC_VS_INT8 = {"topk": 9.0, "powersgd": 1.0}


#: All-reduce algorithms a link's collective library may run (it picks the faster). Over ``n``
#: devices, ``ring`` takes ``2 (n - 1)`` steps each sending ``1/n`` of the bytes; ``tree`` reduces up
#: and broadcasts down a binary tree, ``2 ceil(log2 n)`` steps each sending all of them (NCCL's
#: double binary tree keeps both directions busy, so a device sends twice the bytes, as a ring does to
#: within ``(n - 1) / n``). The other collectives run as rings.
ALGORITHMS = ("ring", "tree")


@dataclass(frozen=True)
class Link:
    """One link kind's α-β figures.

    Attributes:
        alpha_s: latency per collective step (a ring all-reduce over ``n`` has ``2 (n-1)`` steps).
        bytes_per_s: bytes per second one device sends on it (one direction).
        bytes_per_s_by_kind: the same for one collective kind (``all-reduce``, ``all-gather``,
            ``reduce-scatter``), where measured apart; other kinds use :attr:`bytes_per_s`. On
            simulated CPU devices the kinds differ by several times: a ``psum`` sums in shared
            memory, an ``all_gather`` writes every device's whole output.
        medium: what carries it: ``ICI``, ``DCN``, ``NVLink``, ``InfiniBand``, ``shared memory``
            (simulated devices of one process), ``loopback`` (processes of one host).
        algorithms: the all-reduce algorithms its collective library may run (:data:`ALGORITHMS`):
            NCCL's ring and tree across GPU nodes; rings elsewhere (TPU ICI and DCN, NVLink in a
            node, and what ``calibrate`` fits its ring steps to).

    Example:
        >>> link = Link(0.0, 1e9, {"all-reduce": 4e9})
        >>> link.seconds(4e9, 1, "all-reduce"), link.seconds(4e9, 1, "all-gather")
        (1.0, 4.0)
    """

    alpha_s: float
    bytes_per_s: float
    bytes_per_s_by_kind: dict[str, float] = field(default_factory=dict)
    medium: str = ""
    algorithms: tuple[str, ...] = ("ring",)

    def seconds(self, wire_bytes: float, steps: int, kind: str | None = None) -> float:
        """Time of a collective of ``kind`` that sends ``wire_bytes`` per device in ``steps`` ring steps."""
        return steps * self.alpha_s + wire_bytes / self.bytes_per_s_by_kind.get(kind, self.bytes_per_s)

    def all_reduce_seconds(self, wire_bytes: float, devices: int, count: int = 1) -> float:
        """``count`` all-reduces over ``devices`` that send ``wire_bytes`` per device in all as rings,
        by the faster of the link's :attr:`algorithms`.

        Example (64 GPUs across nodes: a tree's 12 steps against a ring's 126, which sends 63/64 of
        the tree's bytes; on this link the tree is faster below about 4.5 GB sent per device):
            >>> ib, ring = Link(25e-6, 25e9, algorithms=("ring", "tree")), Link(25e-6, 25e9)
            >>> [round(link.all_reduce_seconds(1e6, 64) * 1e3, 3) for link in (ib, ring)]  # ms
            [0.341, 3.19]
            >>> [round(link.all_reduce_seconds(1e9, 64), 3) for link in (ib, ring)]  # s
            [0.041, 0.043]
        """
        ring = self.seconds(wire_bytes, 2 * (devices - 1) * count, "all-reduce")
        if "tree" not in self.algorithms or devices < 3:
            return ring
        steps = 2 * math.ceil(math.log2(devices)) * count
        return min(ring, self.seconds(wire_bytes * devices / (devices - 1), steps, "all-reduce"))


def nearest_in_ratio(value: float, known, /) -> int:
    """The one of ``known`` nearest ``value`` in ratio (the larger on a tie): which measured size
    stands for an unmeasured one.

    Example:
        >>> nearest_in_ratio(3, [2, 4, 8]), nearest_in_ratio(2, [1, 4]), nearest_in_ratio(100, [2, 4])
        (4, 4, 4)
    """
    return min(known, key=lambda k: (abs(math.log(value / k)), -k))


@dataclass(frozen=True)
class Machine:
    """Devices, their rate and memory, and their links.

    Attributes:
        name: e.g. ``v5e-16`` or ``cpu-8 (calibrated)``.
        devices: devices of the whole machine.
        slices: slices (TPU) or nodes (GPU) joined by DCN; 1 for one.
        flops_per_s: sustained FLOP/s of one device on a training step's matmuls.
        flops_per_s_by_tokens: the same by the tokens of a device's micro-step, where measured
            (``calibrate`` times 1, 2 and 4 examples per device: on XLA:CPU 2 examples ran
            faster per token than 4 here, run to run 0.5-13 %); :meth:`flops_per_s_at` reads it.
        memory_bytes: memory one device may use.
        links: ``ici`` (in a slice or node) and ``dcn`` (across).
        overlaps: collectives can run beside compute (accelerators: yes; simulated CPU devices
            share the host's cores: no).
        shared_cores: the devices share the host's cores (simulated CPU devices, more of them than
            the process's cores): a device idle in a pipeline bubble gives its core to the others,
            so a bubble costs no time. With a core each, it does (2 devices on a 2-core host:
            benchmarks/README.md, run 11).
        step_overhead_s: time of a step that does nothing (dispatch, one program launch).
        codec_s_per_element: int8 encode and decode of one gradient element (measured by
            ``calibrate``; from a target: three passes over float32 at HBM bandwidth, read, write
            int8, read back).
        codec_s_per_element_by_method: the same for other methods, measured by ``calibrate``
            (``topk``, ``powersgd`` at their default settings); a method absent here is costed by
            :meth:`codec_seconds_per_element` (machine files written before it have none).
        activation_scale: the compiler's activation bytes per token and layer over the cost model's
            formula (``calibrate`` compiles the model at two and four layers; 1 from a target).
        recompute_scale: the compiler's working set of one recomputed layer's backward pass per
            token over the same formula (ZeRO-3 gathering each layer on use recomputes it;
            ``calibrate`` compiles the model with and without recomputing; 1 from a target).
        recompute_cost: time of a step whose layers run forward again in the backward pass over the
            same step without (``calibrate`` times both; ``None``: the FLOP ratio,
            :meth:`~torsh_jax.planner.shape.ModelShape.train_flops_per_token`).
        chunk_recompute_costs: the same for a step whose layers run forward again in chunks of ``k``
            layers, each from its saved input, as a pipeline stage recomputes its chunk, by ``k``
            (``calibrate`` times ``k`` = 2, 4, ... up to the model's layers; ``k`` = 1 is
            :attr:`recompute_cost`). A chunk's activations are all alive again while it is
            recomputed, so the ratio grows with ``k`` (XLA:CPU, the benchmark's medium model: 0.87
            at 1, 1.19 at 8).
        recompute_costs_by_tokens: the two above by the tokens of a device's micro-step too,
            ``{k: {tokens: ratio}}`` (``k`` = 1: each layer on its own), where measured: on XLA:CPU
            the ratio is not one figure (the benchmark's smaller model, layers recomputed one at a
            time: 0.95 at 1 example per device, 0.86 at 2, 0.62 at 4), so a pipeline's
            micro-batches and a ZeRO-3 step read it at their own size
            (:func:`~torsh_jax.planner.cost.recompute_cost` reads it first).
        chunk_gradient_bytes: the compiler's temporaries of the model's gradient with ``k`` layers on
            one device, ``(fixed, per token)`` bytes by ``k``: a pipeline stage's backward recomputes
            its chunk of ``k`` layers (with the embedding and head, which every stage holds) on one
            micro-batch, which is that program (``calibrate`` compiles ``k`` = 1, 2, 4, ... at two
            batch sizes; a lone layer is not a scan: XLA:CPU holds 0.28-0.34 of a scanned
            layer's bytes for it on the benchmark's models). Empty: the per-layer formula (a target).
        remat_gradient_bytes: the same ``(fixed, per token)`` of the model's gradient with every
            layer recomputed from its saved input, which ZeRO-3 gathering each layer on use is
            (``calibrate`` compiles it at the model's depth); ``None``: the formula.
        compiled_for: the :attr:`~torsh_jax.planner.shape.ModelShape.signature` of the model
            :attr:`chunk_gradient_bytes` and :attr:`remat_gradient_bytes` are of; another model's
            plans use the formula.
        update_bytes_per_s: the rate of the optimizer's update, a pass over parameters, gradients
            and optimizer state (``calibrate`` times AdamW's on every device at once; from a
            target: HBM bandwidth); ``None``: the update is not timed.
        platform: ``tpu``, ``gpu`` or ``cpu``.
        source: where the figures come from.
        host_load: the shares of the host's cores other work took while ``calibrate`` measured
            (``others``: other processes; ``steal``: the hypervisor, for other guests;
            :mod:`~torsh_jax.planner.host_load`); empty where not metered (a target's figures, a
            job of several processes, whose others run beside it by design).
    """

    name: str
    devices: int
    slices: int
    flops_per_s: float
    memory_bytes: int
    links: dict[str, Link] = field(default_factory=dict)
    overlaps: bool = True
    shared_cores: bool = False
    step_overhead_s: float = 0.0
    codec_s_per_element: float = 0.0
    codec_s_per_element_by_method: dict[str, float] = field(default_factory=dict)
    activation_scale: float = 1.0
    recompute_scale: float = 1.0
    recompute_cost: float | None = None
    chunk_recompute_costs: dict[int, float] = field(default_factory=dict)
    chunk_gradient_bytes: dict[int, tuple[float, float]] = field(default_factory=dict)
    remat_gradient_bytes: tuple[float, float] | None = None
    compiled_for: str = ""
    update_bytes_per_s: float | None = None
    platform: str = "tpu"
    source: str = ""
    flops_per_s_by_tokens: dict[int, float] = field(default_factory=dict)
    recompute_costs_by_tokens: dict[int, dict[int, float]] = field(default_factory=dict)
    host_load: dict[str, float] = field(default_factory=dict)

    def flops_per_s_at(self, tokens: int, /) -> float:
        """The per-device rate on micro-steps of ``tokens`` tokens: the measured count nearest in
        ratio (the larger on a tie), else :attr:`flops_per_s`.

        Example:
            >>> m = Machine("m", 8, 1, 4e9, 2**30, flops_per_s_by_tokens={256: 4.4e9, 512: 4e9})
            >>> m.flops_per_s_at(128) / 1e9, m.flops_per_s_at(2048) / 1e9
            (4.4, 4.0)
        """
        rates = self.flops_per_s_by_tokens
        return rates[nearest_in_ratio(tokens, rates)] if rates else self.flops_per_s

    def codec_seconds_per_element(self, method: str, /) -> float:
        """Encode and decode of one gradient element with ``method``: measured
        (:attr:`codec_s_per_element_by_method`; int8: :attr:`codec_s_per_element`), else int8's rate
        times the stated assumption :data:`CODEC_VS_INT8` (1 for methods it does not list).

        Example:
            >>> m = Machine("m", 8, 1, 1e9, 2**30, codec_s_per_element=2e-9)
            >>> m.codec_seconds_per_element("topk") / 1e-9, m.codec_seconds_per_element("int8") / 1e-9
            (18.0, 2.0)
        """
        if method in self.codec_s_per_element_by_method:
            return self.codec_s_per_element_by_method[method]
        return self.codec_s_per_element * CODEC_VS_INT8.get(method, 1.0)

    def compiled_gradients_of(self, signature: str, /) -> bool:
        """Whether the compiled gradients (:attr:`chunk_gradient_bytes`, :attr:`remat_gradient_bytes`)
        are of the model with this :attr:`~torsh_jax.planner.shape.ModelShape.signature`.

        Example:
            >>> m = Machine("m", 8, 1, 1e9, 2**30, compiled_for="d_model=8")
            >>> m.compiled_gradients_of("d_model=8"), Machine("t", 8, 1, 1e9, 2**30).compiled_gradients_of("")
            (True, False)
        """
        return bool(self.compiled_for) and self.compiled_for == signature

    def with_devices(self, devices: int, /) -> Machine:
        """This machine's kind of device and links at ``devices`` devices: whole slices (nodes) of
        its slice's size joined by its ``dcn`` link, or part of one slice.

        Example:
            >>> links = {"ici": Link(1e-6, 1e11), "dcn": Link(1e-5, 1e10)}
            >>> nodes = Machine("h100-16", 16, 2, 4e14, 2**36, links).with_devices(64)
            >>> nodes.name, nodes.devices, nodes.slices
            ('h100-16 at 64 devices', 64, 8)

        Raises:
            MeshError: more devices than a slice holds but not whole slices, or no ``dcn`` link
                measured to join them.
        """
        per_slice = self.devices // self.slices
        if devices == self.devices:
            return self
        slices = -(-devices // per_slice)
        if slices > 1 and devices % per_slice:
            what = f"{devices} devices are not whole slices of {per_slice} ({self.name})"
            fix = f"pass --devices {per_slice} or fewer, or a multiple of {per_slice}"
            raise MeshError(what, key="--devices", fix=fix)
        if slices > 1 and "dcn" not in self.links:
            what = f"{devices} devices are {slices} slices of {per_slice}; {self.name} has no dcn link"
            fix = "calibrate over processes (torsh-jax launch -n 2 -m torsh_jax calibrate -o machine.json)"
            raise MeshError(what, key="--devices", fix=f"{fix}, or pass --devices {per_slice} or fewer")
        links = self.links if slices > 1 else {"ici": self.links["ici"]}
        name = f"{self.name} at {devices} devices"
        return replace(self, name=name, devices=devices, slices=slices, links=links)

    def link(self, kind: str) -> Link:
        """The ``ici`` or ``dcn`` link (``dcn`` falls back to ``ici`` on one slice)."""
        return self.links.get(kind) or self.links["ici"]

    @classmethod
    def from_target(cls, name: str, /, *, slices: int = 1) -> Machine:
        """A target's published figures (``v5e-256``, ``h100-16``) and :data:`ASSUMED`."""
        from torsh_jax.targets import parse_target

        target = parse_target(name, slices=slices)
        chip = target.chip
        gpu = target.platform == "gpu"
        ici_bytes_per_s = (chip.ici_bytes_per_s or chip.hbm_bytes_per_s) / 2
        ici = Link(ASSUMED["ici_alpha_s"], ici_bytes_per_s, medium="NVLink" if gpu else "ICI")
        across = {"medium": "InfiniBand", "algorithms": ALGORITHMS} if gpu else {"medium": "DCN"}
        dcn = Link(ASSUMED["dcn_alpha_s"], chip.dcn_bytes_per_s or ici.bytes_per_s, **across)
        gpu_nodes = gpu and target.devices > 8
        return cls(
            name=target.name if slices == 1 else f"{target.name} x {slices}",
            devices=target.devices,
            slices=slices if target.platform == "tpu" else max(1, target.devices // 8),
            flops_per_s=chip.peak_bf16_flops * ASSUMED["compute_efficiency"],
            codec_s_per_element=(4 + 1 + 4) / chip.hbm_bytes_per_s,
            update_bytes_per_s=chip.hbm_bytes_per_s,
            memory_bytes=target.memory_limit_bytes,
            links={"ici": ici, "dcn": dcn} if slices > 1 or gpu_nodes else {"ici": ici},
            overlaps=True,
            platform=target.platform,
            source=f"{chip.source}; memory per device: {target.memory_limit_source}; assumed: {ASSUMED}",
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str, /, *, source: str = "<json>") -> Machine:
        """A machine file (``torsh-jax calibrate -o machine.json``)."""
        try:
            data = json.loads(text)
            links = {kind: _link(link) for kind, link in data.pop("links").items()}
            chunks = data.pop("chunk_recompute_costs", {})  # JSON keys are strings
            data["chunk_recompute_costs"] = {int(k): float(v) for k, v in chunks.items()}
            rates = data.pop("flops_per_s_by_tokens", {})
            data["flops_per_s_by_tokens"] = {int(k): float(v) for k, v in rates.items()}
            costs = data.pop("recompute_costs_by_tokens", {})
            data["recompute_costs_by_tokens"] = {
                int(k): {int(t): float(r) for t, r in by_tokens.items()} for k, by_tokens in costs.items()
            }
            sets = data.pop("chunk_gradient_bytes", {})
            data["chunk_gradient_bytes"] = {int(k): (float(a), float(b)) for k, (a, b) in sets.items()}
            if data.get("remat_gradient_bytes") is not None:
                data["remat_gradient_bytes"] = tuple(float(x) for x in data["remat_gradient_bytes"])
            return cls(**data, links=links)
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise PlanError(
                f"not a machine file: {err}",
                key=source,
                fix="write it with torsh-jax calibrate -o machine.json",
            ) from None

    @classmethod
    def load(cls, path: str | Path, /) -> Machine:
        path = Path(path)
        if not path.is_file():
            raise PlanError(
                f"no such machine file {path}", key="machine", fix="run torsh-jax calibrate -o " + str(path)
            )
        return cls.from_json(path.read_text(), source=str(path))


def _link(fields: dict) -> Link:
    """A link of a machine file (JSON lists its algorithms as a list; a file written before them
    has none: :class:`Link`'s default)."""
    if "algorithms" in fields:
        fields = {**fields, "algorithms": tuple(fields["algorithms"])}
    return Link(**fields)
