r"""Carrying per-rank float64 scalars exactly through a SUM all-reduce of any float dtype.

The postnorm strategy sends the denominator d (and, for metrics, the loss sum and the valid
token count) inside the gradient bucket's own all-reduce, so normalization costs no extra
collective. The bucket has the parameters' dtype, and a count in float32 is exact only up to
:math:`2^{24}` (bf16: 256), so a 16M-token global batch would be silently miscounted if d
were summed in the bucket dtype (docs/bugs.md, float32-count). Two steps keep it exact:

1. *Limbs.* A float64 value x is split into K parts of the bucket dtype,
   :math:`x = h_1 + h_2 + \dots + h_K`, with :math:`h_1` = x rounded to the dtype,
   :math:`h_2` = the rest rounded, and so on. Each remainder is computed exactly in float64
   (it is the rounding error of the previous step), and K mantissas hold the 53 bits of a
   float64: K = 3 for float32 (3 x 24 bits), 7 for bf16 (7 x 8), 1 for float64.
2. *One slot per rank.* Rank r writes its limbs into slot r of an R-slot vector and zeros
   everywhere else. A SUM all-reduce then adds only zeros to every limb (x + 0 = x exactly, in
   any order the backend chooses), so every rank receives every rank's limbs bit for bit and
   adds them up itself in float64 with ``math.fsum``, which is exact and order-independent.

The cost is R x values x K extra elements in one bucket (R = 1024, 3 values, float32: 9216
floats, 36 KiB), which is negligible next to a gradient bucket of megabytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

#: Significand bits (with the implicit one) per dtype that can carry limbs.
_SIGNIFICAND_BITS: dict[torch.dtype, int] = {
    torch.float64: 53,
    torch.float32: 24,
    torch.bfloat16: 8,
}
_FLOAT64_BITS = 53


class CarryError(ValueError):
    """A value that cannot be carried exactly (non-finite, or too small for the dtype)."""


def limbs_per_value(dtype: torch.dtype) -> int:
    """K: how many parts of `dtype` hold any float64 exactly (ceil(53 / significand bits))."""
    try:
        bits = _SIGNIFICAND_BITS[dtype]
    except KeyError:
        # float16 has the precision for 5 limbs but not the range: a count above 65504
        # overflows to inf. Carry such buckets' extras in a float32 bucket or use precount.
        raise CarryError(
            f"cannot carry counts exactly in a {dtype} bucket; supported: "
            f"{', '.join(str(d) for d in _SIGNIFICAND_BITS)}"
        ) from None
    return -(-_FLOAT64_BITS // bits)


def split_exact(value: float, dtype: torch.dtype) -> list[float]:
    """K limbs of `dtype`, largest first, whose float64 sum is exactly `value`."""
    if not math.isfinite(value):
        raise CarryError(f"cannot carry a non-finite value ({value!r})")
    limbs = []
    rest = float(value)
    for _ in range(limbs_per_value(dtype)):
        limb = float(torch.tensor(rest, dtype=torch.float64).to(dtype))
        limbs.append(limb)
        rest -= limb  # exact: the rounding error of a float64 to a coarser float is a float64
    if rest != 0.0:
        # Only when the last remainder, ~2^-53 of the value, falls below the dtype's smallest
        # normal number (2^-126 for float32 and bf16): values under ~1e-22, never a count or
        # a weight sum of any realistic size.
        raise CarryError(f"{value!r} cannot be split exactly into {dtype} limbs")
    return limbs


def join_exact(limbs: Sequence[float]) -> float:
    """The float64 value whose limbs these are."""
    return math.fsum(limbs)


def encode_slots(
    values: Sequence[float], rank: int, world_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """A [R * len(values) * K] vector of `dtype`: this rank's limbs in its slot, zeros elsewhere."""
    if not 0 <= rank < world_size:
        raise CarryError(f"rank {rank} is not in a world of size {world_size}")
    K = limbs_per_value(dtype)
    out = torch.zeros(world_size, len(values), K, dtype=torch.float64)
    for i, value in enumerate(values):
        out[rank, i] = torch.tensor(split_exact(value, dtype), dtype=torch.float64)
    # Every limb is exactly representable in `dtype`, so this cast does not round.
    return out.to(dtype).flatten()


def decode_slots(
    reduced: torch.Tensor, num_values: int, world_size: int
) -> list[tuple[float, ...]]:
    """Every rank's values from a summed slot vector: result[r][i] is rank r's value i."""
    K = limbs_per_value(reduced.dtype)
    expected = world_size * num_values * K
    if reduced.numel() != expected:
        raise CarryError(
            f"slot vector has {reduced.numel()} elements, expected {world_size} ranks x "
            f"{num_values} values x {K} limbs = {expected}"
        )
    limbs = reduced.detach().to(torch.float64).view(world_size, num_values, K).tolist()
    return [tuple(join_exact(parts) for parts in rank) for rank in limbs]


def all_ranks_values(
    values: Sequence[float], *, group: dist.ProcessGroup | None = None
) -> list[tuple[float, ...]]:
    """One SUM all-reduce that hands every rank every rank's float64 `values`, exactly.

    The precount strategy's one collective before the backward passes (labels only), and the
    metrics collective: slots in float64, so K = 1 and the payload is R x len(values).
    """
    world_size = dist.get_world_size(group)
    slots = encode_slots(values, dist.get_rank(group), world_size, torch.float64)
    dist.all_reduce(slots, op=dist.ReduceOp.SUM, group=group)
    return decode_slots(slots, len(values), world_size)
