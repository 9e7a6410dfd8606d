"""``torsh-jax report DIR [DIR_B] -o report.html``: a run's self-contained HTML report, or two side by side.

stdout gets the findings, one line each, and the path written; ``--json`` gives them as one JSON
object (``output``, ``runs``: per run ``path``, ``headline``, ``findings``).

Example:
    $ torsh-jax demo --plan zero3 --steps 20 --log-dir runs/z3 --profile 3:5
    $ torsh-jax report runs/z3 -o report.html
    $ torsh-jax report runs/ddp runs/z3 -o compare.html
"""

from __future__ import annotations

import argparse

from torsh_jax.cli.args import output_file_type
from torsh_jax.cli.output import print_json, write_output

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("report", help="write a run's self-contained HTML report (two runs: compared)")
    parser.add_argument(
        "runs", nargs="+", metavar="DIR", help="run directory (demo --log-dir, RunLog); two to compare"
    )
    parser.add_argument("-o", "--output", type=output_file_type(), default="report.html",
                        help="HTML file to write [report.html]")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the findings and headline as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from torsh_jax.errors import RunLogError
    from torsh_jax.runlog.findings import findings
    from torsh_jax.runlog.page import comparison_html, report_html
    from torsh_jax.runlog.read import read_run
    from torsh_jax.runlog.sections import headline

    if len(args.runs) > 2:
        raise RunLogError(
            f"{len(args.runs)} run directories given", key="DIR", fix="pass one run, or two to compare"
        )
    runs = [read_run(path, key="DIR") for path in args.runs]
    output = args.output
    page_dir = output.resolve().parent
    found = {str(r.path): findings(r) for r in runs}
    each = [found[str(r.path)] for r in runs]
    html = (
        report_html(runs[0], page_dir=page_dir, found=each[0])
        if len(runs) == 1
        else comparison_html(*runs, page_dir=page_dir, found=tuple(each))
    )
    write_output(output, html)
    if args.json:
        print_json(
            {
                "output": str(output),
                "runs": [
                    {
                        "path": str(r.path),
                        "headline": headline(r),
                        "findings": [f.to_dict() for f in found[str(r.path)]],
                    }
                    for r in runs
                ],
            }
        )
        return 0
    for path, items in found.items():
        for f in items:
            print(f"{path}: {f.severity} {f.kind}: {f.title}")
    print(f"wrote {output}")
    return 0
