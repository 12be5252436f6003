"""`rollway report DIR`: (re)write a run folder's report.html and plots/*.png."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "report"
HELP = "Write DIR/report.html (reward curves, episode timeline, tools, stop reasons) and DIR/plots/*.png."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run folder of a finished `rollway up` (holds trajectories.jsonl)")


def run(args: argparse.Namespace) -> int:
    from rollway.reports.report import write_report
    from rollway.schemas.codec import DecodeError

    try:
        path = write_report(Path(args.run_dir))
    except (FileNotFoundError, DecodeError) as err:
        print(f"rollway report: {err}", file=sys.stderr)
        return 2
    except ImportError as err:
        print(f"rollway report: {err}; plots need matplotlib (pip install -e '.[train]' or make setup)",
              file=sys.stderr)
        return 2
    print(path)
    return 0
