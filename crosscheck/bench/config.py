"""What the bench runs: its sizes (`BenchConfig`) and the packed batch every path sees.

The batch is numpy, built once by the parent process and sent to every rank and worker, so
both frameworks time the same tokens. Each rank gets M microbatches of B rows x T tokens
(weak scaling: the global batch grows with R). Rows pack documents back to back; the target
that would cross into the next document is ignored, as are a short prompt at the start of
every document and the padding (segment 0) at the end of a row. Rank r's rows are filled to a
different length than rank 0's, so the ranks hold different numbers of valid targets: the
naive path's gradient then differs from the global token mean's, which the bench checks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

IGNORE_INDEX = -100
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Sizes and counts of one bench run (`quick` is what the test suite runs)."""

    # B x T x M: 4 x 128 x 4 = 2048 tokens per rank and update, a step of 65 ms per rank on
    # one CPU core. What fused postnorm adds in torch is per update and per gradient byte,
    # not per token: about 0.7 ms of CPU per rank here (a copy of the bucket to carry the
    # count, a Python comm hook, one division of the gradient; docs/bench.md), 2.4% of a
    # step of 1024 tokens (M = 2), 1 to 1.5% of one of 2048. A training step's thousands of
    # tokens per rank and update are closer to the second.
    rows: int = 4  # B: rows per microbatch per rank
    seq_len: int = 128  # T: tokens per row (the transformer's max_positions)
    accum: int = 4  # M: microbatches per update
    warmup: int = 3  # untimed rounds first: allocator, caches, JAX dispatch warm up
    #: Timed rounds; each runs every path once, in turn. One round's ratio t_path / t_naive
    #: scatters by about 10% on a 2-core machine, so the median of 20 moved by 2-3% from run
    #: to run, as much as the 2% the fused path is allowed; 100 bring that to about 1% (JAX:
    #: a 95% interval of +-0.6% on 8 devices, +-1.5% on 2).
    rounds: int = 100
    #: torch's rounds: its per-round ratio scatters more (gloo's loopback TCP between two
    #: rank processes on two cores): at M = 2 the median of 100 moved by 2% from run to run,
    #: its 95% interval +-2%; 300 gave +-1.3%. At M = 4, 200 give about +-0.8% in 40 s.
    torch_rounds: int = 200
    torch_ranks: int = 2
    jax_world_sizes: tuple[int, ...] = (2, 8)
    device: str = "cpu"
    platform: str | None = None  # passed to JAX's jax_platforms (None: JAX's default)
    seed: int = 0
    vocab: int = 40
    #: The test suite's run: few rounds of a small batch, JAX compiled for compile speed.
    quick: bool = False

    def __post_init__(self) -> None:
        for name in ("rows", "seq_len", "accum", "rounds", "torch_rounds", "torch_ranks"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"bench config: {name} must be >= 1, got {value}")
        if self.warmup < 0:
            raise ValueError(f"bench config: warmup must be >= 0, got {self.warmup}")
        if self.device not in DEVICES:
            raise ValueError(f"bench config: device must be one of {DEVICES}, got {self.device!r}")
        if not self.jax_world_sizes or min(self.jax_world_sizes) < 1:
            raise ValueError(
                f"bench config: JAX world sizes must be positive, got {self.jax_world_sizes}"
            )

    def quickly(self) -> BenchConfig:
        """The same bench in a few seconds: checks that it runs, says little about speed."""
        # No warm-up round: the gradient check before the timing has run every path once.
        return dataclasses.replace(
            self, warmup=0, rounds=3, torch_rounds=3, rows=1, seq_len=64, accum=2, quick=True
        )

    def record(self) -> dict:
        """The config as the JSON report holds it."""
        return {**dataclasses.asdict(self), "jax_world_sizes": list(self.jax_world_sizes)}


def packed_batch(config: BenchConfig, world_size: int) -> dict[str, np.ndarray]:
    """`inputs`, `targets`, `segment_ids`, each int32 [R, M, B, T], for `world_size` ranks.

    Rank r fills its rows to a fraction 1 - 0.4 r / (R - 1) of T (rank 0 full, the last rank
    60%), the rest padding; documents are 8 to T/2 tokens long with a prompt of up to 4
    ignored targets. Deterministic in `config.seed` and `world_size`.
    """
    R, M, B, T = world_size, config.accum, config.rows, config.seq_len
    rng = np.random.default_rng([config.seed, world_size])
    inputs = np.zeros((R, M, B, T), dtype=np.int32)
    targets = np.full((R, M, B, T), IGNORE_INDEX, dtype=np.int32)
    segments = np.zeros((R, M, B, T), dtype=np.int32)
    for r in range(R):
        fill = max(2, int(T * (1.0 - 0.4 * r / max(R - 1, 1))))
        for m in range(M):
            for b in range(B):
                start, segment = 0, 1
                while start < fill:
                    length = min(int(rng.integers(8, max(9, T // 2))), fill - start)
                    doc = rng.integers(1, config.vocab, size=length + 1)
                    span = slice(start, start + length)
                    inputs[r, m, b, span] = doc[:-1]
                    segments[r, m, b, span] = segment
                    # Next-token targets inside the document; the last position's target
                    # would be the next document's first token: ignored, as is the prompt.
                    doc_targets = doc[1:].copy()
                    doc_targets[-1] = IGNORE_INDEX
                    doc_targets[: int(rng.integers(0, 5))] = IGNORE_INDEX
                    targets[r, m, b, span] = doc_targets
                    start, segment = start + length, segment + 1
    return {"inputs": inputs, "targets": targets, "segment_ids": segments}


def rank_valid_counts(batch: dict[str, np.ndarray]) -> list[int]:
    """Valid targets per rank over its M microbatches (what the naive path divides by)."""
    valid = batch["targets"] != IGNORE_INDEX
    return [int(n) for n in valid.reshape(valid.shape[0], -1).sum(axis=1)]
