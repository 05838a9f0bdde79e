"""The greedy kernel (kernels/greedy.py) against torch.argmax, and the next step's inputs it leaves: under Triton's
interpreter on the CPU, natively on a GPU (there with its token written straight into pinned host memory)."""

import pytest
import torch

pytest.importorskip("triton")

from llm_anatomy.kernels import use_kernels  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if not use_kernels(DEVICE):
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from llm_anatomy.kernels.greedy import BLOCK, DecodeInputs, GreedyScratch, greedy_next  # noqa: E402


def logits_with_ties(rows: int, vocab: int, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g).to(dtype)
    top = x.max() + 1
    x[0, vocab - 1] = top  # the largest in the last chunk alone
    if rows > 1:  # the same largest value in two chunks: the first index wins
        x[1, 7] = x[1, vocab - 3] = top
    if rows > 2:  # ties inside one chunk
        x[2, 100] = x[2, 101] = x[2, (BLOCK + 5) % vocab] = top
    if rows > 3:
        x[3] = float("-inf")  # nothing above -inf: index 0, as torch gives
    return x.to(DEVICE)


@pytest.mark.parametrize("vocab", [1000, 3 * BLOCK + 17])
def test_tokens_are_torch_argmax_over_several_chunks_with_ties(vocab):
    logits = logits_with_ties(4, vocab)
    scratch = GreedyScratch(8, vocab, DEVICE)
    tokens = torch.full((8,), -5, dtype=torch.int64, device=DEVICE)
    for _ in range(2):  # the counts left at zero: a second launch gives the same
        got = greedy_next(logits, tokens, scratch)
        assert got.tolist() == logits.argmax(-1).tolist()
        assert scratch.counts.tolist() == [0] * 8
    assert tokens[4:].tolist() == [-5] * 4  # rows past the batch untouched


def test_a_nan_ranks_above_every_number():
    logits = logits_with_ties(1, 2000)
    logits[0, 1500] = float("nan")
    got = greedy_next(logits, torch.zeros(1, dtype=torch.int64, device=DEVICE), GreedyScratch(1, 2000, DEVICE))
    assert got.tolist() == [1500] == logits.argmax(-1).tolist()


def test_the_next_steps_inputs_advance_from_the_block_table():
    """Row 0 moves into its table's second page, row 1 stays in its page, row 2 is padding (context 0: untouched),
    row 3 steps past what its table holds (slot -1, which the host replaces by uploading)."""
    vocab, page = 1500, 16
    logits = logits_with_ties(4, vocab)
    ids = torch.tensor([1, 2, 3, 4], device=DEVICE)
    positions = torch.tensor([15, 20, 0, 31], device=DEVICE)
    lens = torch.tensor([16, 21, 0, 32], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([5 * 16 + 15, 9 * 16 + 4, -1, 8 * 16 + 15], device=DEVICE)
    tables = torch.tensor([[5, 6], [7, 9], [0, 0], [3, 8]], dtype=torch.int32, device=DEVICE)
    tokens = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    want = logits.argmax(-1).tolist()
    inputs = DecodeInputs(ids, positions, lens, slots, tables, page)
    greedy_next(logits, tokens, GreedyScratch(4, vocab, DEVICE), inputs)
    assert tokens.tolist() == want
    assert ids.tolist() == [want[0], want[1], 3, want[3]]
    assert positions.tolist() == [16, 21, 0, 32]
    assert lens.tolist() == [17, 22, 0, 33]
    assert slots.tolist() == [6 * 16 + 0, 9 * 16 + 5, -1, -1]


def test_the_host_copy_alternates_halves():
    vocab = 3000
    host = torch.zeros(2, dtype=torch.int64, pin_memory=DEVICE.type == "cuda")
    turn = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    scratch, tokens = GreedyScratch(1, vocab, DEVICE), torch.zeros(1, dtype=torch.int64, device=DEVICE)
    seen = []
    for seed in range(3):
        logits = logits_with_ties(1, vocab, seed=seed)
        logits[0, 10 + seed] = 1e4
        greedy_next(logits, tokens, scratch, host=host, turn=turn)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        seen.append((host.tolist(), turn.item()))
    assert seen == [([10, 0], 1), ([10, 11], 0), ([12, 11], 1)]


def test_bad_arguments_are_refused():
    scratch = GreedyScratch(2, 1000, DEVICE)
    tokens = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="scratch for 2 rows"):
        greedy_next(torch.zeros(3, 1000, device=DEVICE), tokens, scratch)
    with pytest.raises(ValueError, match="scratch for 2 rows of 1000"):
        greedy_next(torch.zeros(1, 999, device=DEVICE), tokens, scratch)
    with pytest.raises(ValueError, match="int64"):
        greedy_next(torch.zeros(1, 1000, device=DEVICE), tokens.int(), scratch)
    host, turn = torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="single row"):
        greedy_next(torch.zeros(2, 1000, device=DEVICE), tokens, scratch, host=host, turn=turn)
    with pytest.raises(ValueError, match="come together"):
        greedy_next(torch.zeros(1, 1000, device=DEVICE), tokens, scratch, host=host)
    if DEVICE.type == "cuda":  # a kernel can write host memory only where it is pinned (and so mapped)
        with pytest.raises(ValueError, match="pinned"):
            greedy_next(torch.zeros(1, 1000, device=DEVICE), tokens, scratch, host=host, turn=turn)
