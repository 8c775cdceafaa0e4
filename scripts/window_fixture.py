"""Record llama.cpp's logits of a prompt longer than gemma3's 512-token sliding window, as the fixture
`tests/test_targets.py::test_gemma3_beyond_sliding_window` reads (`tests/data/fixtures/reference/gemma3/window.npz`):
the prompt's token ids, and for each position past the window llama.cpp's top 40 token ids and logits.

    python scripts/window_fixture.py [GGUF]    # default: the zoo's gemma3-270m; needs llama-cpp-python

The prompt is 320 words drawn (seeded) from the fixtures' texts, about 820 tokens; llama.cpp evaluates it in one
context of 2048 with batches of 512, keeping every position's logits.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "data" / "fixtures" / "reference"
WINDOW = 512  # gemma3-270m's sliding window
TOP = 40


def window_prompt() -> str:
    """The shuffled-words prompt: long enough that positions past the window see only it on the local layers."""
    words = " ".join(json.loads((FIXTURES / "texts.json").read_text())).split()
    rng = random.Random(1)
    return " ".join(rng.choice(words) for _ in range(320))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="GGUF path (default: the zoo's gemma3-270m)")
    args = ap.parse_args()
    import llama_cpp

    from polystrata import zoo
    from polystrata.gguf import GGUFFile
    from polystrata.tokenizer import Tokenizer

    path = Path(args.model) if args.model else zoo.pull("gemma3-270m")
    with GGUFFile(path) as f:
        ids = Tokenizer.from_metadata(f.metadata).encode(window_prompt())
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_batch=512, verbose=False, logits_all=True)
    llm.eval(ids)
    past = np.asarray(llm.scores[WINDOW: len(ids)], dtype=np.float32)
    top = np.argsort(-past, axis=1)[:, :TOP]
    out = FIXTURES / "gemma3" / "window.npz"
    np.savez_compressed(out, ids=np.asarray(ids, np.int32), first=np.int32(WINDOW), top_ids=top.astype(np.int32),
                        top_logits=np.take_along_axis(past, top, 1), llama_cpp=llama_cpp.__version__)
    print(f"{len(ids)} tokens, {len(ids) - WINDOW} positions past the window -> {out}")


if __name__ == "__main__":
    main()
