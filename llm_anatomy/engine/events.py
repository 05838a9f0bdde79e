"""What the engine tells its observers. The engine never imports the probe: it calls these hooks, and with
no observer attached it does no extra work (no clock reads, no events)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .scheduler import Sequence


@dataclass
class Step:
    """One engine step: a pure decode of the running sequences, or a step that also prefills (whole prompts
    or chunks of them), with the running sequences' decodes riding along."""

    index: int
    is_prefill: bool
    seqs: list["Sequence"]
    query_lens: list[int]  # tokens forwarded, per sequence
    context_lens: list[int]  # per sequence, after this step
    t_start_ns: int  # the step began (scheduling)
    t_launch_ns: int = 0  # scheduled, the forward about to be launched
    t_launched_ns: int = 0  # the step's device work (forward, sampling, token copy) is queued
    t_sampled_ns: int = 0  # the sampled tokens are on the host
    t_end_ns: int = 0  # tokens appended, detokenized, stop conditions checked
    detokenize_ns: int = 0  # part of [t_sampled, t_end] spent detokenizing
    tokens: list[int | None] = field(default_factory=list)  # per sequence; None: a prompt chunk, no token
    finished: list[str] = field(default_factory=list)  # request ids this step finished


    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def host_work_ns(self) -> int:
        """Host time spent on this step itself (scheduling, inputs, launch, detokenizing, stop checks), not
        waiting for the device nor, with lookahead, completing the step before it."""
        return (self.t_launched_ns - self.t_start_ns) + (self.t_end_ns - self.t_sampled_ns)


class Observer(Protocol):
    def on_add(self, seq: "Sequence", t_ns: int) -> None: ...

    def on_launch(self, step: Step) -> None: ...  # just before the step's GPU work is launched

    def on_launched(self, step: Step) -> None: ...  # its GPU work is queued, before the host waits for it

    def on_step(self, step: Step) -> None: ...  # after the tokens are appended

    def on_finish(self, seq: "Sequence", t_ns: int) -> None: ...
