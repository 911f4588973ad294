"""Command-line flags of the reference training scripts (kept argparse-free so each script's
docstring stays its whole interface)."""

import sys


def option(flag: str, default=None):
    """The value given after ``flag``, or ``default``."""
    return sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else default


def options(flag: str) -> list[str]:
    """Every value given with a repeatable flag."""
    return [sys.argv[i + 1] for i, arg in enumerate(sys.argv[:-1]) if arg == flag]
