"""Shared command-line plumbing for the thin stage entry points in ``stages/``.

Every stage accepts ``--params PATH`` (default ``params.yaml``) and repeated
``--set section.key=value`` overrides, resolves the config before doing any
work, and turns expected errors into one clear line and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from hope.config import Config, load_config
from hope.errors import ConfigError, StageError
from hope.io import check_writable


def stage_parser(description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(description or "").strip().splitlines()[0])
    parser.add_argument(
        "--params", default="params.yaml", help="params file (default: params.yaml)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one knob, e.g. --set train.steps=50 (repeatable)",
    )
    return parser


def run_stage(
    description: str | None,
    body: Callable[[Config, argparse.Namespace], None],
    argv: Sequence[str] | None = None,
    extra_args: Callable[[argparse.ArgumentParser], None] | None = None,
    outputs: Sequence[Path] = (),
) -> int:
    """Parse args, load the config, check that the ``outputs`` folders are writable, run
    ``body``; map known errors to exit code 2."""
    parser = stage_parser(description)
    if extra_args is not None:
        extra_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.params, args.overrides)
        check_writable(outputs)
        body(cfg, args)
    except (ConfigError, StageError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
