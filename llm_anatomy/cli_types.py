"""Argument types for the commands. Each checks its value while the command line is parsed, so that a bad
flag is refused in one line (exit status 2) before anything is loaded. A command module uses them as
`parser.add_argument("--max-tokens", type=integer(1), ...)`."""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # what a torch.int64 tensor or a generator seed holds


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line: "llm-anatomy call: error: --top-p must be in (0, 1], got 2.0"
    (argparse prints the usage first, and a log then shows two lines for one mistake), and flags spelt in full
    (a prefix is an error, not a guess: `--out` must not become `--output-tokens`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # subcommands' parsers are made with this class, not its kwargs
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


OWN_PHRASES = ("must ", "is ", "names ", "cannot ", "does ")  # how this module's messages begin


def one_line(message: str) -> str:
    """argparse's "argument --x: must be ..." as "--x must be ..." (this module's messages read on from the flag's
    name), its own as "--x: expected one argument"; always one line."""
    m = re.fullmatch(r"argument ([^:]+): (.*)", message, flags=re.S)
    if m:
        name, what = m.group(1).split("/")[-1], m.group(2)
        message = f"{name} {what}" if what.startswith(OWN_PHRASES) else f"{name}: {what}"
    return " ".join(message.split())


def integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An integer in [low, high] (either bound optional); no flag may exceed a signed 64-bit integer."""
    low = INT64_MIN if low is None else low
    high = INT64_MAX if high is None else high

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        _check_range(value, low, high)
        return value

    return parse


def real(low: float | None = None, high: float | None = None, *, low_open: bool = False) -> Callable[[str], float]:
    """A finite number in [low, high], or (low, high] with low_open."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value):  # float() takes "nan" and "inf"
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if low_open and low is not None and (value <= low or high is not None and value > high):
            bound = f"in ({low:g}, {high:g}]" if high is not None else f"> {low:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value:g}")
        _check_range(float(value), low if low is None else float(low), high if high is None else float(high))
        return value

    return parse


def _check_range(value, low, high) -> None:
    """Integers say the side they crossed ("must be >= 1"); numbers bounded on both sides give the interval."""
    def show(x):
        return f"{x:g}" if isinstance(x, float) else str(x)

    if isinstance(value, float) and low is not None and high is not None:
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{show(low)}, {show(high)}], got {show(value)}")
        return
    if low is not None and value < low:
        raise argparse.ArgumentTypeError(f"must be >= {show(low)}, got {show(value)}")
    if high is not None and value > high:
        raise argparse.ArgumentTypeError(f"must be <= {show(high)}, got {show(value)}")


def nonempty(value: str) -> str:
    """A string with something in it (an empty --model or --stop is a mistake, never a choice)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("is empty")
    return value


def output_file(value: str) -> Path:
    """A file this process can write: its directory exists and takes a new file, and it is not a directory.
    Checked now, so that a long call's report is not lost at its end."""
    path = Path(value).expanduser()
    if not value:
        raise argparse.ArgumentTypeError("is empty; give a file name")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"is a directory: {value}; give a file name inside it")
    parent = path.parent
    if not parent.exists():
        raise argparse.ArgumentTypeError(f"names a directory that does not exist: {parent}; create it first")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"is inside {parent}, which is not a directory")
    if path.exists():
        try:
            open(path, "ab").close()  # appends nothing: the file is left as it is
        except OSError as e:
            raise argparse.ArgumentTypeError(f"cannot write {value} ({e.strerror}); choose another path") from None
    elif not _can_create_in(parent):
        raise argparse.ArgumentTypeError(f"cannot create a file in {parent}; choose another directory")
    return path


def output_dir(value: str) -> Path:
    """A directory this process can write into, or create (its nearest existing ancestor takes new entries)."""
    path = Path(value).expanduser()
    if not value:
        raise argparse.ArgumentTypeError("is empty; give a directory")
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"is not a directory: {value}")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"is inside {existing}, which is not a directory")
    if not _can_create_in(existing):
        raise argparse.ArgumentTypeError(f"cannot create or write {value}; choose another directory")
    return path


def input_file(value: str) -> Path:
    """An existing file (not a directory); reading and parsing it is the command's."""
    path = Path(value).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"does not exist: {value}")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"is a directory: {value}; give a file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"cannot be read: {value}")
    return path


def _can_create_in(directory: Path) -> bool:
    """Create and remove a scratch file: permission bits alone miss read-only mounts, ACLs and root."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".llm-anatomy-check-"):
            return True
    except OSError:
        return False
