"""Whose turn the engine core's interpreter is: its step loop's, or its helper threads'.

The step loop shares the process's interpreter lock with the anatomy builders' threads, and each runnable thread
holds the lock up to the switch interval before the next takes it. With a few helpers busy (a wave of finished
calls to record and send), the loop's own host work (an eager prefill's launches one by one, the step after a step
boundary the lookahead could not cover) stretched to two or three times its length while the device waited. The
helpers' work is not urgent; the loop's is, except while the loop itself waits (for a step's tokens, or for
requests). So the loop says when it waits and when it works, and each helper asks for its turn before each unit of
its work (one call's anatomy sent, one built anatomy passed on): it goes on at once while the loop waits, and else
waits until it does, or at most `max_wait_s`, so that a loop that hardly ever waits cannot starve them. (On a CPU the
forward is the loop's own work and there is no wait to lend: the engine core gives its helpers no wait there,
max_wait_s 0.)
"""

from __future__ import annotations

import threading

MAX_WAIT_S = 0.05  # a helper's longest wait for its turn


class LoopTurn:
    """An engine observer (its hooks mark the loop's waits for the device) and the helpers' gate."""

    def __init__(self, max_wait_s: float = MAX_WAIT_S):
        if not (isinstance(max_wait_s, (int, float)) and 0 <= max_wait_s < float("inf")):
            raise ValueError(f"max_wait_s must be a finite number >= 0, got {max_wait_s!r}")
        self.max_wait_s = max_wait_s
        self._loop_waits = threading.Event()
        self._loop_waits.set()  # until the loop says it works

    # ---- the step loop ------------------------------------------------------------------------------------
    def works(self) -> None:
        self._loop_waits.clear()

    def waits(self) -> None:
        self._loop_waits.set()

    @property
    def loop_waits(self) -> bool:
        return self._loop_waits.is_set()

    # the engine's observer hooks: a step's launch is the loop's work; from its launch to its tokens on the host the
    # loop waits for the device (with lookahead, the step launched ahead is queued behind the one it waits for)
    def on_add(self, seq, t_ns) -> None:
        pass

    def on_launch(self, step) -> None:
        self.works()

    def on_launched(self, step) -> None:
        self.waits()

    def on_step(self, step) -> None:
        self.works()

    def on_finish(self, seq, t_ns) -> None:
        pass

    # ---- a helper thread ----------------------------------------------------------------------------------
    def take(self) -> bool:
        """Before a unit of a helper's work: returns when the loop waits, or after max_wait_s (False then)."""
        return self._loop_waits.wait(self.max_wait_s)
