"""The built-in fixtures, each setting one trap, and a seeded generator of random ones.

Every fixture uses the same bilinear model (vocabulary V = 40, hidden H = 12 unless stated):
V != H so a transposed parameter cannot pass for the right one, and 2 V H = 960 parameters
leave the per-group gradient contributions linearly independent for diagnosis.

`builtin_fixture` is the one lookup that `run`, `verify` and `bugs` use: it takes a built-in
name or the path of a user's fixture .npz (`Fixture.load`, validated like a built-in).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np

from crosscheck.fixtures import Fixture, FixtureError
from crosscheck.layout import IGNORE_INDEX

VOCAB_SIZE = 40
HIDDEN_SIZE = 12


def init_params(
    rng: np.random.Generator, vocab_size: int = VOCAB_SIZE, hidden_size: int = HIDDEN_SIZE
) -> dict[str, np.ndarray]:
    """float64 params with logits of order 1: embed ~ N(0, 1), unembed ~ N(0, 1/H)."""
    return {
        "embed": rng.standard_normal((vocab_size, hidden_size)),
        "unembed": rng.standard_normal((hidden_size, vocab_size)) / np.sqrt(hidden_size),
    }


class _RowWriter:
    """Fills [N, T] batch arrays one language-model document at a time."""

    def __init__(
        self,
        rng: np.random.Generator,
        num_rows: int,
        seq_len: int,
        vocab: int,
        text_vocab: int | None = None,
    ):
        # Document tokens are drawn from [0, text_vocab); ids above are reserved (placeholders).
        self.rng, self.vocab = rng, vocab
        self.text_vocab = vocab if text_vocab is None else text_vocab
        self.inputs = np.zeros((num_rows, seq_len), dtype=np.int32)
        self.targets = np.full((num_rows, seq_len), IGNORE_INDEX, dtype=np.int32)
        self.segment_ids = np.zeros((num_rows, seq_len), dtype=np.int32)
        self.weights = np.ones((num_rows, seq_len), dtype=np.float64)

    def document(
        self, row: int, start: int, length: int, segment: int, num_ignored: int = 0
    ) -> None:
        """A document of `length` tokens at [start, start+length) with next-token targets.

        Its last target would predict the next document's first token across the packing
        boundary, so it is ignored; so are the first `num_ignored` targets (a prompt).
        """
        tokens = self.rng.integers(0, self.text_vocab, size=length + 1)
        span = slice(start, start + length)
        self.inputs[row, span] = tokens[:-1]
        self.targets[row, span] = tokens[1:]
        self.targets[row, start + length - 1] = IGNORE_INDEX
        self.targets[row, start : start + min(num_ignored, length)] = IGNORE_INDEX
        self.segment_ids[row, span] = segment

    def pad_to(self, seq_len: int) -> None:
        """Widen every row to `seq_len` with padding: no input, an ignored target, segment 0.

        The padding carries no loss, so every token's loss and every count, segment and weight
        sum is unchanged; only `constant`, whose D = N T counts every target slot by
        definition (padding included, as T5X's), sees the longer rows. It gives the 8-row
        fixtures one shape, (8, 64), and a compiled JAX program per layout then serves all four
        instead of one per sequence length.
        """
        extra = seq_len - self.inputs.shape[1]
        if extra < 0:
            raise ValueError(f"cannot pad rows of {self.inputs.shape[1]} down to {seq_len}")
        widths = ((0, 0), (0, extra))
        self.inputs = np.pad(self.inputs, widths)
        self.targets = np.pad(self.targets, widths, constant_values=IGNORE_INDEX)
        self.segment_ids = np.pad(self.segment_ids, widths)
        self.weights = np.pad(self.weights, widths, constant_values=1.0)

    def build(self, name: str, description: str, rng: np.random.Generator) -> Fixture:
        return Fixture(
            name=name,
            description=description,
            inputs=self.inputs,
            targets=self.targets,
            segment_ids=self.segment_ids,
            weights=self.weights,
            **init_params(rng, self.vocab, HIDDEN_SIZE),
        )


#: Sequence length of every 8-row fixture: those drawn at 32 are padded to it (`pad_to`).
SHARED_SEQ_LEN = 64


def seed_fixture() -> Fixture:
    """Two rows (one per rank at layout (2, 1)) with exactly 100 and 900 valid targets."""
    rng = np.random.default_rng(100900)
    writer = _RowWriter(rng, 2, 1000, VOCAB_SIZE)
    # `document` ignores the last target of a span, so a span of n + 1 holds n valid targets.
    writer.document(0, 0, 101, segment=1)
    writer.document(1, 0, 901, segment=1)
    return writer.build(
        "seed",
        "ranks with 100 vs 900 valid tokens: a per-rank mean weighs a short-rank token 9x",
        rng,
    )


def packed_fixture() -> Fixture:
    """Rows packing 2-5 documents each, boundary targets ignored, padding at the end."""
    rng = np.random.default_rng(2)
    num_rows, seq_len = 8, SHARED_SEQ_LEN
    writer = _RowWriter(rng, num_rows, seq_len, VOCAB_SIZE)
    for row in range(num_rows):
        num_docs = int(rng.integers(2, 6))
        lengths = rng.integers(3, 18, size=num_docs)
        start = 0
        for segment, length in enumerate(lengths, start=1):
            length = int(min(length, seq_len - start))
            if length < 2:
                break
            writer.document(row, start, length, segment)
            start += length
    return writer.build(
        "packed",
        "packed documents: a per-row mean is not a per-document mean, and the target "
        "crossing each document boundary must be ignored",
        rng,
    )


def ragged_fixture() -> Fixture:
    """144 rows (layouts R, M in 1..4) whose lengths and prompt spans vary block by block."""
    rng = np.random.default_rng(3)
    num_rows, seq_len = 144, 24
    writer = _RowWriter(rng, num_rows, seq_len, VOCAB_SIZE)
    # 16 blocks of 9 rows = the microbatches of the finest layout (4, 4); each block draws its
    # own typical length so that counts differ widely between ranks and microbatches.
    block_scale = rng.choice([2, 4, 8, 16, 24], size=16)
    for row in range(num_rows):
        scale = int(block_scale[row // 9])
        length = int(rng.integers(max(2, scale // 2), scale + 1))
        prompt = int(rng.integers(0, length)) if rng.random() < 0.6 else 0
        writer.document(row, 0, length, segment=1, num_ignored=prompt)
    _redraw_duplicate_rows(writer, np.random.default_rng(33))
    return writer.build(
        "ragged",
        "row lengths and ignored prompt spans that differ widely between ranks and "
        "microbatches of every layout up to (4, 4)",
        rng,
    )


def _redraw_duplicate_rows(writer: _RowWriter, rng: np.random.Generator) -> None:
    """Redraw the tokens of any row whose (input, target) pairs repeat an earlier row's.

    Two one-document rows with the same valid pairs have the same gradient contribution, so
    the diagnosis could not tell their weights apart (its least-squares system would lose
    full column rank). Lengths and prompt spans stay as drawn.
    """
    seen: set[tuple] = set()
    for row in range(writer.targets.shape[0]):
        while True:
            valid = writer.targets[row] != IGNORE_INDEX
            inputs, targets = writer.inputs[row][valid], writer.targets[row][valid]
            pairs = tuple(sorted(zip(inputs.tolist(), targets.tolist(), strict=True)))
            if not pairs or pairs not in seen:
                seen.add(pairs)
                break
            span = writer.segment_ids[row] > 0
            length = int(span.sum())
            tokens = rng.integers(0, writer.text_vocab, size=length + 1)
            writer.inputs[row, :length] = tokens[:-1]
            writer.targets[row, :length] = np.where(valid[:length], tokens[1:], IGNORE_INDEX)


def empty_rank_fixture() -> Fixture:
    """Rows 4..7 attend to tokens but carry no loss: at R = 2 (or 4) whole ranks are empty."""
    rng = np.random.default_rng(4)
    num_rows, seq_len = 8, 32
    writer = _RowWriter(rng, num_rows, seq_len, VOCAB_SIZE)
    for row in range(num_rows):
        length = int(rng.integers(6, seq_len + 1))
        prompt = length if row >= 4 else int(rng.integers(0, 4))
        writer.document(row, 0, length, segment=1, num_ignored=prompt)
    writer.pad_to(SHARED_SEQ_LEN)
    return writer.build(
        "empty-rank",
        "the second half of the batch has no valid target: a rank with zero tokens must add "
        "nothing, not NaN (0/0)",
        rng,
    )


IMAGE_TOKEN = VOCAB_SIZE - 1
"""Input id of a multimodal placeholder (image patch) token in the `multimodal` fixture."""


def multimodal_fixture() -> Fixture:
    """Prompt, a long image-placeholder span, then answer text; only the answer has a loss."""
    rng = np.random.default_rng(5)
    num_rows, seq_len = 8, SHARED_SEQ_LEN
    writer = _RowWriter(rng, num_rows, seq_len, VOCAB_SIZE, text_vocab=IMAGE_TOKEN)
    for row in range(num_rows):
        prompt = int(rng.integers(2, 6))
        image = int(rng.integers(8, 44))
        answer = int(rng.integers(2, seq_len - prompt - image + 1))
        length = prompt + image + answer
        writer.document(row, 0, length, segment=1, num_ignored=prompt + image)
        writer.inputs[row, prompt : prompt + image] = IMAGE_TOKEN
    return writer.build(
        "multimodal",
        "long image-placeholder spans are attended but carry no loss: counting attended "
        "tokens instead of targets shrinks the gradient",
        rng,
    )


def soft_weights_fixture() -> Fixture:
    """Fractional per-token weights in [0, 3], zero on some valid tokens, nonzero on ignored."""
    rng = np.random.default_rng(6)
    num_rows, seq_len = 8, 32
    writer = _RowWriter(rng, num_rows, seq_len, VOCAB_SIZE)
    for row in range(num_rows):
        length = int(rng.integers(4, seq_len + 1))
        writer.document(row, 0, length, segment=1, num_ignored=int(rng.integers(0, 3)))
    weights = rng.uniform(0.05, 3.0, size=(num_rows, seq_len))
    weights[rng.random((num_rows, seq_len)) < 0.1] = 0.0
    # Ignored tokens keep their nonzero weights on purpose: w_t v_t must still drop them.
    writer.weights = weights
    writer.pad_to(SHARED_SEQ_LEN)
    return writer.build(
        "soft-weights",
        "fractional per-token weights (some zero on valid tokens, nonzero on ignored ones): "
        "the denominator is the weight sum over valid tokens, not a count",
        rng,
    )


def packed_wide_fixture() -> Fixture:
    """16 rows of 48 packing 1-6 documents with prompts: a second packing trap for diagnosis."""
    rng = np.random.default_rng(7)
    num_rows, seq_len = 16, 48
    writer = _RowWriter(rng, num_rows, seq_len, VOCAB_SIZE)
    for row in range(num_rows):
        start = 0
        for segment in range(1, int(rng.integers(1, 7)) + 1):
            length = int(min(rng.integers(2, 16), seq_len - start))
            if length < 2:
                break
            writer.document(row, start, length, segment, num_ignored=int(rng.integers(0, 3)))
            start += length
    return writer.build(
        "packed-wide",
        "rows packing one to six documents, each with a short ignored prompt",
        rng,
    )


#: Total multiplicity of a dedup fixture: odd and above 2^24, so no float32 number equals it.
DEDUP_MIN_TOTAL = 2**24 + 1


def _dedup(base: Fixture, name: str, seed: int) -> Fixture:
    """`base` with integer token multiplicities as weights, summing to an odd total > 2^24.

    A deduplicated corpus weighs each kept token by how often it occurred, so the weighted
    mean's denominator is a token count of a 16M-token batch while only a few hundred tokens
    are computed. Each multiplicity is below 2^24 (exact in float32); their sum is not.
    """
    rng = np.random.default_rng(seed)
    valid = base.targets != IGNORE_INDEX
    n_valid = int(valid.sum())
    per_token = DEDUP_MIN_TOTAL // n_valid + 1
    weights = np.zeros(base.targets.shape, dtype=np.float64)
    weights[valid] = rng.integers(per_token, 2 * per_token, size=n_valid)
    if int(weights.sum()) % 2 == 0:
        weights[np.argwhere(valid)[0][0], np.argwhere(valid)[0][1]] += 1
    return Fixture(
        name=name,
        description=f"{base.name} with integer token multiplicities summing to "
        f"{int(weights.sum())} > 2^24: a float32 count of them is inexact",
        inputs=base.inputs,
        targets=base.targets,
        segment_ids=base.segment_ids,
        weights=weights,
        embed=base.embed,
        unembed=base.unembed,
    )


BUILTIN_FIXTURES: dict[str, Callable[[], Fixture]] = {
    "seed": seed_fixture,
    "packed": packed_fixture,
    "ragged": ragged_fixture,
    "empty-rank": empty_rank_fixture,
    "multimodal": multimodal_fixture,
    "soft-weights": soft_weights_fixture,
}


#: Fixtures the bug catalogue needs beyond the default matrix's: a second packed batch, and
#: token counts past 2^24 for float32-count (built from seed and packed by multiplicities).
DIAGNOSIS_FIXTURES: dict[str, Callable[[], Fixture]] = {
    "packed-wide": packed_wide_fixture,
    "dedup-seed": lambda: _dedup(seed_fixture(), "dedup-seed", 24),
    "dedup-packed": lambda: _dedup(packed_fixture(), "dedup-packed", 25),
}


def is_fixture_path(name: str | os.PathLike[str]) -> bool:
    """Whether a fixture reference names a file rather than a built-in fixture.

    A path object, or a string ending in ``.npz`` or holding a path separator (``/``, and
    ``os.sep`` / ``os.altsep`` where they differ): no built-in name has either. The JAX verify
    worker (crosscheck/runners/jax_verify_worker.py, ``_fixture``) applies the same rule.
    """
    if isinstance(name, os.PathLike):
        return True
    separators = {"/", os.sep, os.altsep} - {None}
    return name.endswith(".npz") or any(sep in name for sep in separators)


def fixture_reference(name: str | os.PathLike[str]) -> str:
    """The form of a fixture reference to hand on: a built-in name as it is, a path absolute.

    Worker processes may start in another directory (or be given the reference much later),
    so a relative path is resolved once, here, against the caller's working directory.
    """
    if is_fixture_path(name):
        return str(Path(name).expanduser().resolve())
    return str(name)


def builtin_fixture(name: str | os.PathLike[str]) -> Fixture:
    """A built-in fixture by name (default-matrix or diagnosis), or a fixture .npz by path.

    Built-ins are built once and shared read-only. A path (see `is_fixture_path`) is resolved
    to an absolute one and loaded with `Fixture.load`, validated as a built-in is, and cached
    while the file is unchanged (same inode, size and modification time). Its `Fixture.name`
    is the reference as given, as a built-in's is its name: the harness keys its rows by the
    reference, and `builtin_fixture(fixture.name)` finds the fixture again (pass references
    through `fixture_reference` first so that they stay valid in other directories). A missing
    or bad file raises FixtureError naming the file and the problem; an unknown name,
    ValueError listing the built-ins.
    """
    if is_fixture_path(name):
        reference = os.fspath(name)
        path = Path(fixture_reference(name))
        try:
            stat = path.stat()
        except OSError as exc:
            raise FixtureError(
                f"fixture file {path} cannot be read ({exc.strerror or exc}); a fixture is a "
                f"built-in name ({', '.join(_known_names())}) or the path of a fixture .npz"
            ) from None
        return _fixture_file(reference, str(path), stat.st_ino, stat.st_mtime_ns, stat.st_size)
    return _builtin(name)


def _known_names() -> list[str]:
    return [*BUILTIN_FIXTURES, *DIAGNOSIS_FIXTURES]


@cache
def _builtin(name: str) -> Fixture:
    builder = BUILTIN_FIXTURES.get(name) or DIAGNOSIS_FIXTURES.get(name)
    if builder is None:
        raise ValueError(
            f"unknown fixture {name!r}; built-in fixtures: {', '.join(_known_names())}; "
            "or give the path of a fixture .npz (a name ending in .npz or containing '/')"
        )
    return builder()


@cache
def _fixture_file(reference: str, path: str, inode: int, mtime_ns: int, size: int) -> Fixture:
    """A fixture file named `reference`, cached by reference, path, inode, modification time
    and size: a file rewritten or replaced (renamed over) is read again."""
    return Fixture.load(path, name=reference)


def random_fixture(
    seed: int,
    num_rows: int,
    seq_len: int,
    *,
    vocab_size: int = 16,
    hidden_size: int = 6,
    max_segments: int = 3,
    ignore_fraction: float = 0.3,
    empty_row_fraction: float = 0.15,
    soft_weights: bool = True,
) -> Fixture:
    """A reproducible random fixture of any shape, for property tests.

    Rows pack up to `max_segments` documents followed by padding; a fraction of rows has no
    valid target at all, and every other target is ignored with probability
    `ignore_fraction`. Soft weights, when asked for, are uniform in [0, 2] with some zeros.
    """
    if num_rows < 1 or seq_len < 1:
        raise ValueError(f"random_fixture needs num_rows, seq_len >= 1, got {num_rows}, {seq_len}")
    rng = np.random.default_rng(seed)
    writer = _RowWriter(rng, num_rows, seq_len, vocab_size)
    for row in range(num_rows):
        start = 0
        for segment in range(1, int(rng.integers(1, max_segments + 1)) + 1):
            if seq_len - start < 1:
                break
            length = int(rng.integers(1, seq_len - start + 1))
            writer.document(row, start, length, segment)
            start += length
        if rng.random() < empty_row_fraction:
            writer.targets[row] = IGNORE_INDEX
    writer.targets[rng.random((num_rows, seq_len)) < ignore_fraction] = IGNORE_INDEX
    if soft_weights:
        writer.weights = rng.uniform(0.0, 2.0, size=(num_rows, seq_len))
        writer.weights[rng.random((num_rows, seq_len)) < 0.1] = 0.0
    return Fixture(
        name=f"random-{seed}-{num_rows}x{seq_len}",
        description="seeded random batch for property tests",
        inputs=writer.inputs,
        targets=writer.targets,
        segment_ids=writer.segment_ids,
        weights=writer.weights,
        **init_params(rng, vocab_size, hidden_size),
    )
