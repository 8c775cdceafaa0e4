"""Batched decoding (polystrata/batch.py): sequences sharing each decode step give what each gives alone."""

from __future__ import annotations

import numpy as np
import pytest
from suite_plugin import targets_under_test

from polystrata.batch import BatchDecoder
from polystrata.engine import Engine
from polystrata.errors import PolystrataError
from polystrata.synth import synth_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    # The same model and context as test_targets' llama: the kernels compile once per run.
    return synth_model("llama", tmp_path_factory.mktemp("batch") / "llama.gguf", preset="tiny", qtype="Q8_0", seed=7)


def _tokens(n: int, seed: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 1000, size=n)]


@pytest.mark.parametrize("target", ["reference", *targets_under_test()])
def test_batched_steps_match_each_sequence_alone(tiny_llama, target):
    """Three sequences prefilled one by one, then decoded together, leaving at different steps; a fourth joins in
    the slot the first left (its rows hold the first's stale K/V). Every sequence's logits equal those of the
    same tokens run alone: bit for bit on the kernel targets (the same kernels, rows independent), within float
    rounding on the reference (numpy's sums over other shapes)."""
    eng = Engine(tiny_llama, target=target, n_ctx=64)
    prompts = [_tokens(n, s) for n, s in ((5, 1), (9, 2), (3, 3), (4, 4))]
    conts = [_tokens(n, s) for n, s in ((3, 5), (6, 6), (5, 7), (3, 8))]
    alone = []
    for p, c in zip(prompts, conts):
        eng.reset()
        alone.append(np.stack([eng.forward(p)[-1], *(eng.forward([t])[-1] for t in c[:-1])]))
    bd = BatchDecoder(eng, 3)
    assert bd.n_ctx == 21
    got: dict[int, list] = {s: [] for s in range(4)}
    slot: dict[int, int] = {}

    def join(s: int) -> None:
        slot[s] = bd.open()
        got[s].append(bd.prefill(slot[s], prompts[s]))

    for s in range(3):
        join(s)
    step, done = 0, set()
    pending = {s: 0 for s in range(3)}  # sequence -> index of its next token
    while pending:
        seqs = sorted(pending, key=lambda s: (s + step) % 3)  # rows in a varying order
        out = bd.step([slot[s] for s in seqs], [conts[s][pending[s]] for s in seqs])
        for row, s in enumerate(seqs):
            got[s].append(out[row])
            pending[s] += 1
            if pending[s] == len(conts[s]) - 1:
                del pending[s]
                bd.close(slot[s])
                done.add(s)
        if 0 in done and 3 not in slot:
            join(3)
            assert slot[3] == slot[0]
            pending[3] = 0
        step += 1
    for s in range(4):
        have = np.stack(got[s])
        if target == "reference":
            np.testing.assert_allclose(have, alone[s], rtol=1e-4, atol=1e-4)
        else:
            np.testing.assert_array_equal(have, alone[s])


def test_slots_and_their_context(tiny_llama):
    """Each sequence holds n_ctx // N tokens; slots are refused when all are taken or the context is too small."""
    eng = Engine(tiny_llama, target="reference", n_ctx=16)
    bd = BatchDecoder(eng, 2)
    a, b = bd.open(), bd.open()
    with pytest.raises(PolystrataError, match="slots are busy"):
        bd.open()
    bd.prefill(a, _tokens(7, 1))
    bd.step([a], [5])
    with pytest.raises(PolystrataError, match="context length exceeded"):
        bd.step([a, b], [5, 6])
    with pytest.raises(PolystrataError, match="context length exceeded: 9 tokens > 8"):
        bd.prefill(b, _tokens(9, 2))
    bd.close(a)
    assert bd.open() == a
    with pytest.raises(PolystrataError, match="cannot hold 9 sequences"):
        BatchDecoder(eng, 9)
