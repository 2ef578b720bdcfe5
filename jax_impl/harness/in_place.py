"""The multi-process rows in a ``jax.distributed`` job an outside launcher started.

``crosscheck run --coordinator HOST:PORT --num-processes P --process-id I``, once per host,
joins the job itself (`crosscheck.verification.jax_launched.LaunchedJaxJob`); its
multi-process launch then starts no worker (`jax_impl.harness.multiprocess.joined_job`):
each process of the job runs the launch's spec on its own devices (`compute_spec`, what a
started worker runs) and every rank's results are gathered on every process. The torch
counterpart is `torch_impl.harness.in_place`.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jax_impl.harness.multiprocess_worker import compute_spec


def run_spec_in_place(spec: Mapping[str, Any], world_size: int) -> list[dict[str, Any]]:
    """`spec` run by this process as one of a ``jax.distributed`` job it already joined (a
    multi-host start: ``crosscheck run --coordinator ...``), instead of launching workers.

    Every process of the job must call it with the same spec, in the same order. Each computes
    the records of its own devices' ranks (`compute_spec`); every process gets every rank's
    record back, in rank order, through two ``process_allgather`` calls (the sizes, then the
    pickled records padded to the largest). The gradients and params are replicated, so only
    rank 0's record keeps them (what the harness reads); the others carry their per-rank
    metrics.
    """
    if jax.device_count() != world_size:
        raise ValueError(
            f"the joined JAX job has {jax.device_count()} devices; this launch is for "
            f"world size {world_size}"
        )
    if bool(spec.get("x64", False)) != bool(jax.config.jax_enable_x64):
        raise ValueError(
            f"the joined JAX job has x64 {'on' if jax.config.jax_enable_x64 else 'off'}; "
            f"this launch's dtypes {spec['dtypes']} need it "
            f"{'on' if spec.get('x64') else 'off'}"
        )
    records = compute_spec(spec)
    for record in records:
        if int(record["rank"]) != 0:  # replicated: rank 0's copy is the one read
            for key in [k for k in record if "/grads." in k or "/params." in k]:
                del record[key]
    payload = np.frombuffer(pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = multihost_utils.process_allgather(np.asarray([payload.size], dtype=np.int32))
    sizes = np.asarray(sizes).reshape(-1)
    padded = np.zeros(int(sizes.max()), dtype=np.uint8)
    padded[: payload.size] = payload
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    gathered = [
        record
        for process, size in enumerate(sizes)
        for record in pickle.loads(every[process, : int(size)].tobytes())
    ]
    return sorted(gathered, key=lambda record: int(record["rank"]))
