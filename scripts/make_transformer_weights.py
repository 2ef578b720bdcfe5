"""Write the transformer's initial weights (crosscheck/fixtures/data/transformer_init.npz).

    python scripts/make_transformer_weights.py [--out PATH]

Run once; the file is committed. The same seed always gives the same values in every array
(``tests/test_transformer_weights.py`` regenerates and compares).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from crosscheck.fixtures.transformer_weights import WEIGHTS_PATH, WEIGHTS_SEED, draw_weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=WEIGHTS_PATH)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, **draw_weights(WEIGHTS_SEED))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
