"""Argument parsing shared by the benchmark scripts: bad input is refused with one line on stderr and exit
status 2 (no usage block, no traceback), before any work."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path


class Parser(argparse.ArgumentParser):
    """One-line errors; flags spelt in full (`--out` was taken for `--output-tokens`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"want a positive whole number, got {text!r}")
    return int(text)


def positive_real(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"want a positive number, got {text!r}")
    return value


def non_negative_real(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"want a number >= 0, got {text!r}")
    return value


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive whole numbers, e.g. 1,64,256."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"want comma-separated positive whole numbers, got {text!r}")
    return [int(p) for p in parts]


def cpu_list(text: str) -> set[int]:
    """CPUs in Linux's list syntax (`taskset -c`'s), e.g. 0-7 or 0,2,8-11: each one this process may run on."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not (first.isdigit() and (last.isdigit() if dash else True)) or (dash and int(last) < int(first)):
            raise argparse.ArgumentTypeError(f"want CPUs as a list such as 0-7 or 0,2,8-11, got {text!r}")
        cpus.update(range(int(first), int(last if dash else first) + 1))
    usable = os.sched_getaffinity(0)
    if not cpus <= usable:
        raise argparse.ArgumentTypeError(f"CPU {min(cpus - usable)} is not one this process may run on "
                                         f"(it may run on {as_cpu_list(usable)})")
    return cpus


def as_cpu_list(cpus) -> str:
    """CPUs written as cpu_list reads them: runs of neighbours as FIRST-LAST."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def names_from(allowed, what: str):
    """An argparse type: a comma-separated list of names from `allowed`, refused with the choices otherwise."""
    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown) or '(none given)'}; "
                                             f"pick from {','.join(allowed)}")
        return names
    return parse


def checkout(text: str) -> Path:
    """A directory holding a checkout of the project: llm_anatomy/ importable from it."""
    path = Path(text).expanduser().resolve()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"no such directory: {text}")
    if not (path / "llm_anatomy" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text} holds no llm_anatomy package; make one with "
                                         f"`git worktree add DIR COMMIT` or `git archive COMMIT | tar -x -C DIR`")
    return path


def output_dir(text: str) -> Path:
    """A directory for the results (created when missing); a file or a .json name is refused."""
    path = Path(text).expanduser()
    if path.suffix == ".json" or (path.exists() and not path.is_dir()):
        raise argparse.ArgumentTypeError(f"want a directory (the results go in files under it), got {text}")
    return path


def output_file(text: str) -> Path:
    """A file for the results, its directory created when missing; a directory is refused."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"want a file name, got the directory {text}")
    return path
