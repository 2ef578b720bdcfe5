"""The implementations the harness can run, and the framework each belongs to.

Each framework's runner module is imported only when one of its implementations is asked for:
crosscheck itself needs neither JAX nor torch. A runner module provides
``why_unsupported(case) -> str`` ('' when it runs the case, else one sentence saying why not,
the same sentence for every case skipped for the same reason: the run lists skips grouped by
it), ``supports(case) -> bool`` (``not why_unsupported(case)``) and
``jobs(cases, settings, on_done) -> list[Job]`` (`crosscheck.launch.schedule`); running all of its
jobs reports every case it was given through ``on_done(case, output_or_error)``, exactly once.
`crosscheck.run.matrix.run_matrix` fails a case that never comes back.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from crosscheck.contract.cases import Case

#: implementation name -> framework
IMPLEMENTATIONS: dict[str, str] = {
    "jax-pmap": "jax",
    "jax-shard_map": "jax",
    "jax-jit": "jax",
    "jax-multiprocess": "jax",
    "torch-ddp": "torch",
    "torch-fsdp2": "torch",
}

_MODULES = {"jax": "crosscheck.run.jax_runner", "torch": "crosscheck.run.torch_runner"}


def framework_of(impl: str) -> str:
    try:
        return IMPLEMENTATIONS[impl]
    except KeyError:
        raise ValueError(
            f"unknown implementation {impl!r}; known: oracle, {', '.join(IMPLEMENTATIONS)}"
        ) from None


#: What each framework's extra installs that its implementations import.
_EXTRA_MODULES = {"jax": ("jax", "flax", "optax", "orbax"), "torch": ("torch",)}


@functools.cache
def not_installed(framework: str) -> str:
    """'' when `framework` ("torch" or "jax") can be imported here, else one sentence saying
    how to install it: crosscheck itself needs neither, and a run skips (or, asked for by
    name, refuses) what is not installed instead of failing inside a worker."""
    missing = [name for name in _EXTRA_MODULES[framework] if importlib.util.find_spec(name) is None]
    if missing:
        what = framework if missing[0] == framework else f"{framework}'s {missing[0]}"
        return f"{what} is not installed here (pip install 'gradweight[{framework}]')"
    return ""


def runner_for(framework: str) -> ModuleType:
    """The runner module of a framework, imported now (it imports the framework)."""
    return importlib.import_module(_MODULES[framework])


def why_unsupported(case: Case) -> str:
    """'' when the runner of `case.impl` runs `case`, else why it does not (one sentence)."""
    framework = framework_of(case.impl)
    return not_installed(framework) or runner_for(framework).why_unsupported(case)
