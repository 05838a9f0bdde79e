"""A live line on stderr that says what a long command is doing (loading, compiling, calibrating, prefill,
decode). Only when stderr is a terminal: a log or a pipe gets nothing extra, nor does --quiet."""

from __future__ import annotations

import time
from contextlib import contextmanager

from rich.console import Console
from rich.live import Live
from rich.text import Text


class ProgressLine:
    """`stage(text)` shows a spinner and the text until the next stage; `during_call(engine, ...)` follows a
    measured call step by step. With `enabled` False every method does nothing."""

    def __init__(self, enabled: bool | None = None, console: Console | None = None, prefix: str = "llm-anatomy"):
        self.console = console or Console(stderr=True)
        self.enabled = self.console.is_terminal if enabled is None else enabled
        self.prefix = prefix
        self._status = None

    def stage(self, text: str) -> None:
        if not self.enabled:
            return
        line = f"{self.prefix}: {text}"
        if self._status is None:
            # A spinner thread redraws the line 4 times a second: harmless while loading or calibrating, and
            # stopped before the measured call starts (during_call refreshes by hand between steps instead).
            self._status = self.console.status(line, refresh_per_second=4)
            self._status.start()
        else:
            self._status.update(line)

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    @contextmanager
    def during_call(self, engine, prompt_tokens: int, max_tokens: int):
        """Attach an engine observer that redraws the line as the call's steps complete."""
        if not self.enabled:
            yield
            return
        self.stop()
        live = Live(Text(f"{self.prefix}: prefill of {prompt_tokens:,} tokens"), console=self.console,
                    auto_refresh=False, transient=True)
        live.start(refresh=True)
        observer = CallProgress(live, self.prefix, max_tokens)
        engine.observers.append(observer)
        try:
            yield
        finally:
            engine.observers.remove(observer)
            live.stop()

    def __enter__(self) -> "ProgressLine":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class CallProgress:
    """Engine observer: "decode: 37 of 256 tokens" after each step, redrawn at most every `every_s` seconds.

    The redraw runs in on_step, after the step's last timestamp, so no step's own timing includes it; it falls
    in the gap before the next step (with lookahead the device already runs that step). No thread: a redraw
    thread would take the GIL at instants no measurement can account for."""

    def __init__(self, live: Live, prefix: str, max_tokens: int, every_s: float = 0.25):
        self.live, self.prefix, self.max_tokens, self.every_ns = live, prefix, max_tokens, int(every_s * 1e9)
        self.tokens = 0
        self._drawn_ns = 0

    def on_step(self, step) -> None:
        self.tokens += sum(t is not None for t in step.tokens)
        now = time.perf_counter_ns()
        if now - self._drawn_ns >= self.every_ns:
            self._drawn_ns = now
            self.live.update(Text(f"{self.prefix}: decode: {self.tokens:,} of at most {self.max_tokens:,} tokens"),
                             refresh=True)

    def on_add(self, seq, t_ns: int) -> None:
        pass

    def on_launch(self, step) -> None:
        pass

    def on_launched(self, step) -> None:
        pass

    def on_finish(self, seq, t_ns: int) -> None:
        pass
