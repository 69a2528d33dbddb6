"""``hpc-tp plot LOG.jsonl [LOG2.jsonl ...] -o loss.png``: a metric of ``--log`` files against step.

Several logs are overlaid, each labelled by its file name. matplotlib is an optional extra
(``hpc_tp[plot]``), imported only here, with the file-only Agg backend (no display on compute nodes).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..paths import check_output_file


def add_arguments(parser):
    parser.add_argument("logs", nargs="+", metavar="LOG", help="JSON-lines metrics files written by --log")
    parser.add_argument(
        "-o", "--output", default="loss.png", help="image to write (format from its suffix; default %(default)s)"
    )
    parser.add_argument("--metric", default="loss", help="field to plot against step (default %(default)s)")


def run(args) -> int:
    # loaded when the command runs, not by hpc-tp --help
    from .metrics import read_metrics

    check_output_file(args.output, "--output")
    curves = {path: _curve(read_metrics(path), path, args.metric) for path in args.logs}
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("hpc-tp plot needs matplotlib: pip install 'hpc_tp[plot]'") from None
    matplotlib.use("Agg")
    # loaded when the command runs, not by hpc-tp --help
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 5))
    formats = figure.canvas.get_supported_filetypes()
    if Path(args.output).suffix.lstrip(".").lower() not in formats:
        raise ConfigError(
            f"--output {args.output}: expected an image file ending in one of "
            f"{', '.join('.' + f for f in sorted(formats))}"
        )
    names = [Path(path).name for path in curves]
    labels = names if len(set(names)) == len(names) else list(curves)  # run1/log.jsonl vs run2/log.jsonl
    for label, (steps, values) in zip(labels, curves.values()):
        axes.plot(steps, values, label=label)
    axes.set_xlabel("step")
    axes.set_ylabel(args.metric)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.output)
    pyplot.close(figure)
    print(f"wrote {args.output}")
    return 0


def _curve(records: list[dict], path, metric: str) -> tuple[list, list]:
    points = [(r["step"], r[metric]) for r in records if "step" in r and r.get(metric) is not None]
    if not points:
        raise ConfigError(f"{path}: no record has both 'step' and '{metric}'")
    steps, values = zip(*points)
    return list(steps), list(values)
