"""``torsh-jax calibrate``: measure this machine's compute rate and links for ``torsh-jax plan``.

Started as the processes of a job (``torsh-jax launch -m torsh_jax calibrate``, under Slurm or
Ray too), it joins them (``torsh_jax.distributed.initialize``), measures each process's devices
and the link across the processes (``dcn``), and process 0 writes the machine file and prints.

Example:
    $ torsh-jax calibrate --devices 8 -o machine.json
    $ torsh-jax calibrate --devices 2 --global-batch 32 -o machine.json
    $ torsh-jax calibrate --devices 8 --model demo:d_model=256,layers=4,vocab=1024,seq_len=128 --json
    $ torsh-jax launch -n 2 --devices-per-process 4 -m torsh_jax calibrate -o machine.json
"""

from __future__ import annotations

import argparse
import sys
import warnings

from torsh_jax.cli.args import MAX_DEVICES, count_type, output_file_type
from torsh_jax.errors import BusyHostWarning

__all__ = ["register"]

#: The model the compute rate is measured on unless --model says otherwise.
DEFAULT_MODEL = "demo:d_model=256,layers=4,vocab=1024,seq_len=128"


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("calibrate", help="measure compute rate and link alpha-beta for torsh-jax plan")
    parser.add_argument(
        "--devices",
        type=count_type(1, MAX_DEVICES, fix="pass --devices 8"),
        default=None,
        help="devices; simulated on CPU [8; under a launcher, every process's: set by the launcher]",
    )
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"model the compute rate is measured on [{DEFAULT_MODEL}]"
    )
    parser.add_argument(
        "--repeats",
        type=count_type(1, 100, fix="pass --repeats 5"),
        default=5,
        help="timed runs per measurement (the median counts) [5]",
    )
    parser.add_argument(
        "--global-batch",
        type=count_type(1, 1 << 24, fix="pass the global batch plan will be given, e.g. --global-batch 256"),
        default=None,
        help="measure the compute rate at every micro-step size up to this batch over the devices "
        "[1, 2 and 4 examples per device]",
    )
    parser.add_argument("-o", "--output", type=output_file_type(), default=None,
                        help="write the machine file (JSON) here")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the machine as JSON")
    parser.set_defaults(func=run, starts_jax=True)


def run(args: argparse.Namespace) -> int:
    import jax

    from torsh_jax.cli.output import write_or_show
    from torsh_jax.planner.calibrate import calibrate
    from torsh_jax.planner.shape import parse_model

    shape = parse_model(args.model)
    devices = _devices(args.devices)
    largest = {} if args.global_batch is None else {"max_examples_per_device": _per_device(args, devices)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BusyHostWarning)
        machine = calibrate(devices, shape, repeats=args.repeats, **largest)
    _show(caught)
    if jax.process_index() > 0:  # process 0 speaks for the job
        return 0
    # the measurement is not lost to a full disk: the machine file's text is shown instead
    unwritten = write_or_show(args.output, machine.to_json() + "\n") if args.output else None
    written = args.output if args.output and unwritten is None else None
    print(machine.to_json() if args.json else _summary(machine, written))
    if unwritten is not None:
        raise unwritten
    return 0


def _summary(machine, written) -> str:
    """The machine in one line (``; wrote PATH`` when its file was written)."""
    from torsh_jax.units import format_bytes

    link = machine.link("ici")
    chunks = "".join(f", x{v:.2f} by chunks of {k}" for k, v in machine.chunk_recompute_costs.items())
    kinds = "".join(f", {kind} {beta / 1e9:.3f}" for kind, beta in link.bytes_per_s_by_kind.items())
    return (
        f"{machine.name}: {machine.flops_per_s / 1e9:.2f} GFLOP/s per device, link alpha "
        f"{link.alpha_s * 1e6:.1f} us, beta {link.bytes_per_s / 1e9:.3f} GB/s{kinds}{_across(machine)}, "
        f"step overhead "
        f"{machine.step_overhead_s * 1e3:.2f} ms, recompute x{machine.recompute_cost:.2f} per layer"
        f"{chunks}, {format_bytes(machine.memory_bytes)} per device{_busy(machine)}"
        + (f"; wrote {written}" if written else "")
    )


def _per_device(args: argparse.Namespace, devices: list) -> int:
    """Examples per device at ``--global-batch``; at least one."""
    from torsh_jax.errors import PlanError

    if args.global_batch < len(devices):
        raise PlanError(
            f"{args.global_batch} examples are fewer than one per device on {len(devices)} devices",
            key="--global-batch",
            fix=f"pass at least {len(devices)}, or leave it out for 1, 2 and 4 examples per device",
        )
    return args.global_batch // len(devices)


def _show(caught: list) -> None:
    """A busy host in one line on stderr; any other warning as Python shows it."""
    for w in caught:
        if issubclass(w.category, BusyHostWarning):
            print(f"torsh-jax calibrate: warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def _busy(machine) -> str:
    """``, host 3% busy with other work`` where the host was metered."""
    from torsh_jax.planner.host_load import HostLoad

    load = HostLoad.recorded(machine.host_load)
    return f", host {load.busy:.0%} busy with other work" if load is not None else ""


def _devices(count: int | None) -> list:
    """The devices to measure: the job's, when a launcher started this process (joined here); else
    ``count`` of this process's (8 unless given)."""
    from torsh_jax.distributed import initialize
    from torsh_jax.distributed.env import detect_environment
    from torsh_jax.errors import DistributedError

    if not detect_environment().is_multi_process:
        from torsh_jax.demo.devices import select_devices

        return select_devices(8 if count is None else count)
    if count is not None:
        raise DistributedError(
            "--devices is the launcher's under a launcher (every process's devices are measured)",
            key="--devices",
            fix="drop --devices; give launch --devices-per-process N",
        )
    import jax

    initialize()
    return jax.devices()


def _across(machine) -> str:
    """``, across 2 processes alpha .. us, beta .. GB/s`` for a machine of several processes."""
    if machine.slices == 1:
        return ""
    dcn = machine.link("dcn")
    return (
        f", across {machine.slices} processes alpha {dcn.alpha_s * 1e6:.1f} us, beta "
        f"{dcn.bytes_per_s / 1e9:.3f} GB/s"
    )
