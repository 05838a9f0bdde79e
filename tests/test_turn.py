"""The engine core's step loop and its helper threads: a helper's turn comes when the loop waits (for the device,
marked by the engine's hooks, or for requests), or after its longest wait."""

import math
import threading
import time

import pytest
import torch

from llm_anatomy.server.turn import LoopTurn


def test_a_helper_goes_on_while_the_loop_waits_and_waits_while_it_works():
    turn = LoopTurn(max_wait_s=10)
    assert turn.loop_waits and turn.take() is True  # nobody has said the loop works
    turn.works()
    took = []
    helper = threading.Thread(target=lambda: took.append((turn.take(), time.monotonic())))
    helper.start()
    time.sleep(0.3)
    assert not took
    waited_at = time.monotonic()
    turn.waits()
    helper.join(5)
    assert took and took[0][0] is True and took[0][1] >= waited_at


def test_a_helper_waits_at_most_max_wait_s():
    turn = LoopTurn(max_wait_s=0.1)
    turn.works()
    started = time.monotonic()
    assert turn.take() is False
    assert 0.1 <= time.monotonic() - started < 5


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, "1", None])
def test_max_wait_s_is_checked(bad):
    with pytest.raises(ValueError, match="max_wait_s"):
        LoopTurn(max_wait_s=bad)


def test_the_engines_hooks_give_the_turn_from_a_launch_to_its_tokens(tmp_path):
    """Observed through a real engine with lookahead: at every launch the loop works; between a launch and the
    step's tokens on the host (the device's time) it waits; after them it works again."""
    from conftest import tiny_hf_model
    from llm_anatomy import Engine

    tiny_hf_model().save_pretrained(tmp_path)
    engine = Engine.from_pretrained(tmp_path, device="cpu", dtype=torch.float32, kv_cache_tokens=256, block_size=4,
                                    lookahead=True)
    turn, seen = LoopTurn(), []

    class Watch:
        def on_add(self, seq, t_ns): pass

        def on_launch(self, step): seen.append(("launch", turn.loop_waits))

        def on_launched(self, step): seen.append(("launched", turn.loop_waits))

        def on_step(self, step): seen.append(("step", turn.loop_waits))

        def on_finish(self, seq, t_ns): pass

    engine.observers += [turn, Watch()]
    engine.generate([1, 2, 3], max_tokens=4, temperature=0, ignore_eos=True)
    assert {kind for kind, _ in seen} == {"launch", "launched", "step"}
    assert all(waits is (kind == "launched") for kind, waits in seen), seen
    assert not turn.loop_waits
