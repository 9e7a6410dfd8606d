"""``torsh-jax translate``: a DeepSpeed, Horovod or PyTorch FSDP config -> a plan.

Never imports JAX, so it answers at once and runs anywhere.

Example:
    $ torsh-jax translate ds_config.json --world-size 16 -o plan.toml
    $ torsh-jax translate launch.sh --set args.use_adasum=false --format json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torsh_jax.cli.args import MAX_DEVICES, count_type, output_file_type

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "translate",
        help="translate a DeepSpeed / Horovod / PyTorch FSDP config into a plan",
        description="Translate a DeepSpeed JSON/YAML, Horovod launch line or script excerpt, or PyTorch FSDP "
        "arguments into a plan TOML; every input key gets a note (mapped, approximated, ignored, "
        "unsupported).",
    )
    parser.add_argument("file", metavar="FILE", help="the config, launch line or script excerpt")
    parser.add_argument(
        "--world-size", type=count_type(1, MAX_DEVICES, fix="pass e.g. --world-size 8"),
        default=None, help="number of devices/processes",
    )  # fmt: skip
    parser.add_argument(
        "--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
        help="override an input key or a plan field; VALUE is JSON when it parses (8, true, \"auto\")",
    )  # fmt: skip
    parser.add_argument(
        "--hf-trainer", dest="hf_trainer", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
        help="Hugging Face TrainingArguments values that fill DeepSpeed \"auto\" entries",
    )  # fmt: skip
    strictness = parser.add_mutually_exclusive_group()
    strictness.add_argument("--lenient", action="store_true", help="note unsupported keys instead of failing")
    strictness.add_argument(
        "--strict", action="store_true", help="fail on keys the source tool ignores (unknown DeepSpeed keys)"
    )
    parser.add_argument(
        "--format", choices=("text", "json", "toml"), default="text", help="output format [text]"
    )
    parser.add_argument("-o", "--output", type=output_file_type(".toml", ".json"), default=None,
                        help="write the plan here (TOML, or JSON for .json)")  # fmt: skip
    parser.set_defaults(func=run)


def _write(result, path: Path) -> Path:
    from torsh_jax.cli.output import write_output
    from torsh_jax.plan.io import plan_to_json
    from torsh_jax.translate.report import render_toml

    # the suffix and the directory were checked with the arguments (output_file_type); a TOML file
    # is headed by comments naming the source (render_toml)
    text = plan_to_json(result.plan) + "\n" if path.suffix == ".json" else render_toml(result)
    return write_output(path, text)


def run(args: argparse.Namespace) -> int:
    from torsh_jax.translate.detect import translate_file
    from torsh_jax.translate.overrides import parse_set_items
    from torsh_jax.translate.report import render_json, render_text, render_toml

    result = translate_file(
        args.file,
        world_size=args.world_size,
        overrides=parse_set_items(args.overrides),
        hf_trainer=parse_set_items(args.hf_trainer, flag="--hf-trainer") or None,
        lenient=args.lenient,
        strict=args.strict,
    )
    written = _write(result, args.output) if args.output else None
    if args.format == "json":
        print(render_json(result))
    elif args.format == "toml":
        sys.stdout.write(render_toml(result))
    else:
        print(render_text(result, color=sys.stdout.isatty()))
        if written:
            print(f"plan written to {written}")
        else:
            print("plan (TOML; write it with -o PLAN.toml):")
            sys.stdout.write(render_toml(result))
    return 0
