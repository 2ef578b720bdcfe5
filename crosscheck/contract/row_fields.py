"""Contract v2's optional batch fields: prompt groups, documents across rows, row weights.

docs/schemes-as-data.md, "What a token and a row carry":

* ``group_ids`` [N] int >= 0, the prompt group of a row (default: every row its own group);
* ``document_ids`` [N, T] int >= 0, a document that may continue across rows; 0 exactly on
  padding (segment id 0); default: one id per (row, segment), ``row * (S + 1) + segment``;
* ``row_weights`` [N] float, a per-sample weight of any sign (default 1);
* ``sample_mask`` [N] 0 or 1, 0 drops the row (default 1).

A fixture keeps which of them were given (`explicit`) apart from their values: only the given
ones are written to its .npz, so a v1 fixture's file and exported vectors stay byte-identical.
"""

from __future__ import annotations

import numpy as np

#: The optional keys, in the order a .npz lists them after the six v1 keys.
ROW_FIELD_KEYS: tuple[str, ...] = ("group_ids", "document_ids", "row_weights", "sample_mask")


def default_row_fields(segment_ids: np.ndarray) -> dict[str, np.ndarray]:
    """The value of every field a fixture did not give, for a batch with these segments."""
    N = segment_ids.shape[0]
    width = int(segment_ids.max(initial=0)) + 1
    rows = np.arange(N, dtype=np.int64)[:, None]
    documents = np.where(segment_ids > 0, rows * width + segment_ids, 0).astype(np.int64)
    return {
        "group_ids": np.arange(N, dtype=np.int64),
        "document_ids": documents,
        "row_weights": np.ones(N, dtype=np.float64),
        "sample_mask": np.ones(N, dtype=np.int64),
    }


def check_row_fields(given: dict[str, np.ndarray], segment_ids: np.ndarray) -> str | None:
    """Why the given fields break the contract (naming the field, row and position), or None."""
    N, T = segment_ids.shape
    for key, array in given.items():
        want = (N, T) if key == "document_ids" else (N,)
        if array.shape != want:
            return f"{key} has shape {array.shape}, it must be {list(want)}"
        if key == "row_weights":
            if not np.issubdtype(array.dtype, np.floating):
                return f"row_weights must be a floating-point array, got {array.dtype}"
            bad = ~np.isfinite(array)
            if bad.any():
                row = int(np.argmax(bad))
                return f"row_weights[{row}] = {float(array[row])!r} is not finite"
            continue
        if not (np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_):
            return f"{key} must be an integer array, got {array.dtype}"
        if key == "sample_mask":
            bad = (array != 0) & (array != 1)
            if bad.any():
                row = int(np.argmax(bad))
                return f"sample_mask[{row}] = {int(array[row])} must be 0 or 1"
        bad = array < 0
        if bad.any():
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            return f"{key}{list(index)} = {int(array[index])} is negative"
    documents = given.get("document_ids")
    if documents is not None:
        bad = (documents == 0) != (segment_ids == 0)
        if bad.any():
            row, pos = (int(i) for i in np.argwhere(bad)[0])
            return (
                f"document_ids[{row}, {pos}] = {int(documents[row, pos])} with segment id "
                f"{int(segment_ids[row, pos])}: document 0 is padding, exactly where segment "
                "id 0 is"
            )
    return None
