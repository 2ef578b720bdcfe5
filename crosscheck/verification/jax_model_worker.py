"""The reference of ``verify --framework jax --model`` in its own JAX process.

Run as ``python -m crosscheck.verification.jax_model_worker JOB OUT`` by
`crosscheck.verification.model_basis` (through `crosscheck.launch.workers.run_jax_job`, x64
on): the job holds the request of `crosscheck.verification.model_basis.reference_request`, and
OUT gets what `jax_impl.harness.model_reference.compute_reference` answers.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from crosscheck.launch.workers import serve_job


def main(argv: Sequence[str]) -> int:
    from jax_impl.harness.model_reference import compute_reference

    return serve_job(argv, lambda job: compute_reference(job["request"]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
