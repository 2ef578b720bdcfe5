r"""The intended gradient and the group basis of a user's own JAX model (``verify --model``).

A model factory ``MODULE:FACTORY`` returns ``(apply_fn, params)``: a Flax module's ``apply``
with its variables, or any function of (params, inputs), and the same params every call.
Here, in one process with x64 on, at those params cast to float64 (floating leaves), the
per-token loss of the global batch [N, T] is

.. math::  l_t = \operatorname{logsumexp}(z_t) - z_{t, y_t}, \qquad
           z = \text{forward}(\text{apply\_fn}, \text{params}, \text{batch}),

0 where the target is -100; ``forward`` defaults to ``apply_fn(params, batch["inputs"])``.
Rows must be independent (no batch statistics), so a row may be evaluated alone:

* the intended gradient :math:`\nabla \sum_t w_t l_t` (w_t = a_t / D, the intended scheme's
  effective weights): one ``jax.grad`` over the whole batch;
* the group basis :math:`b_g = \nabla \sum_{t \in g} u_t l_t` for every (row, segment) group
  g: one ``jax.grad`` per group, vmapped over the groups, each on its own row.

Parameters are named by their pytree path (``jax.tree_util.keystr``); flattened vectors follow
the names in sorted order (``crosscheck.diagnosis.group_basis.GroupBasis``).
"""

from __future__ import annotations

import importlib
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

IGNORE_INDEX = -100
Forward = Callable[[Callable[..., Any], Any, dict[str, jax.Array]], jax.Array]


class ModelSetupError(ValueError):
    """The model factory or forward cannot be used: missing, wrong type, or not repeatable."""


def load_callable(spec: str, cwd: str, what: str) -> Callable[..., Any]:
    """``MODULE:NAME`` imported with `cwd` first on sys.path; ModelSetupError says why not."""
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ModelSetupError(f"cannot import the {what} {spec!r}: {error!r}") from None
    found = getattr(module, name, None)
    if not callable(found):
        raise ModelSetupError(f"the {what} {spec!r}: {module_name} has no callable {name!r}")
    return found


def named_leaves(tree: Any) -> dict[str, Any]:
    """{pytree path: leaf}, in sorted path order."""
    pairs = jax.tree_util.tree_flatten_with_path(tree)[0]
    return dict(sorted((jax.tree_util.keystr(path), leaf) for path, leaf in pairs))


def with_dtype(params: Any, dtype: Any) -> Any:
    """A fresh copy of `params` with every floating leaf cast to `dtype` (integer leaves kept):
    fresh, so that a step that donates its params leaves the next job's intact."""

    def cast(leaf: Any) -> Any:
        floating = jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating)
        return jnp.array(leaf, dtype=dtype if floating else None, copy=True)

    return jax.tree_util.tree_map(cast, params)


def fresh_model(factory: Callable[[], Any], spec: str) -> tuple[Callable[..., Any], Any]:
    """``factory()`` checked to be ``(apply_fn, params)``; ModelSetupError otherwise."""
    made = factory()
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])):
        raise ModelSetupError(
            f"the model factory {spec!r} must return (apply_fn, params), got {type(made).__name__}"
        )
    return made


def check_repeatable(factory: Callable[[], Any], spec: str) -> None:
    """ModelSetupError unless two calls of `factory` give the same params (structure and
    values): the step and the reference must start from the same weights."""
    first = named_leaves(fresh_model(factory, spec)[1])
    second = named_leaves(fresh_model(factory, spec)[1])
    if list(first) != list(second):
        raise ModelSetupError(f"two calls of the model factory {spec!r} gave different params")
    for name, value in first.items():
        if not np.array_equal(np.asarray(value), np.asarray(second[name])):
            raise ModelSetupError(
                f"two calls of the model factory {spec!r} gave different values of {name}: it "
                "must return the same params every call (a fixed PRNGKey)"
            )


def default_forward(
    apply_fn: Callable[..., Any], params: Any, microbatch: dict[str, jax.Array]
) -> jax.Array:
    """``apply_fn(params, inputs)``; its first element when it returns ``(logits, aux_loss)``
    (a model that adds its own auxiliary loss, `default_aux_loss`)."""
    out = apply_fn(params, microbatch["inputs"])
    return out[0] if isinstance(out, tuple) else out


def default_aux_loss(
    apply_fn: Callable[..., Any], params: Any, microbatch: dict[str, jax.Array]
) -> jax.Array:
    """The model's own auxiliary loss of one forward: the second element of ``apply_fn(params,
    inputs) = (logits, aux_loss)`` (a MoE model's router load-balancing loss)."""
    out = apply_fn(params, microbatch["inputs"])
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(
            f"apply_fn(params, inputs) returned a {type(out).__name__}: a moe_lb term with "
            "--model needs a model whose apply_fn returns (logits, aux_loss), its own router loss"
        )
    return out[1]


def aux_gradients(
    apply_fn: Callable[..., Any],
    params: Any,
    batch: Mapping[str, np.ndarray],
    slices: list[tuple[int, int]],
) -> list[np.ndarray]:
    r""":math:`\nabla A(\text{rows } [a, b))` for every slice, A the model's own auxiliary loss of
    one forward over those rows (`default_aux_loss`), flattened over the leaves in sorted path
    order. One compiled gradient per slice length (a layout's microbatches are equal slices)."""
    grad = jax.jit(jax.grad(lambda p, rows: default_aux_loss(apply_fn, p, rows)))
    arrays = _arrays(batch)
    out = []
    for start, stop in slices:
        grads = grad(params, {key: value[start:stop] for key, value in arrays.items()})
        leaves = named_leaves(grads).values()
        out.append(np.concatenate([np.asarray(leaf, np.float64).reshape(-1) for leaf in leaves]))
    return out


def token_losses(
    apply_fn: Callable[..., Any], params: Any, forward: Forward, microbatch: dict[str, jax.Array]
) -> jax.Array:
    """l_t [B, T] in the logits' dtype; 0 where the target is -100."""
    logits = forward(apply_fn, params, microbatch)
    targets = microbatch["targets"]
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"the forward returned logits of shape {logits.shape}; expected {targets.shape} + "
            "(vocab,)"
        )
    valid = targets != IGNORE_INDEX
    picked = jnp.take_along_axis(logits, jnp.where(valid, targets, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(valid, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0)


def _arrays(batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """The batch as the step gets it: int32 ids, float64 weights (x64 is on)."""
    return {
        key: jnp.asarray(value, dtype=jnp.float64 if value.dtype.kind == "f" else jnp.int32)
        for key, value in batch.items()
    }


def intended_gradients(
    apply_fn: Callable[..., Any],
    params: Any,
    forward: Forward,
    weightings: list[tuple[Mapping[str, np.ndarray], np.ndarray]],
) -> list[dict[str, np.ndarray]]:
    """grad of sum_t w_t l_t over each (global batch, weights w_t) of `weightings`, float64
    numpy per named leaf.

    One compiled gradient, the batch and the weights its arguments, so it compiles once per
    batch shape: run op by op, a Flax model's backward over a whole batch took over 6 s here
    (each weighting), compiled well under one."""

    def objective(p: Any, arrays: Mapping[str, jax.Array], weights: jax.Array) -> jax.Array:
        return jnp.sum(weights * token_losses(apply_fn, p, forward, arrays))

    grad = jax.jit(jax.grad(objective))
    out = []
    for batch, weights in weightings:
        grads = grad(params, _arrays(batch), jnp.asarray(weights))
        out.append(
            {n: np.asarray(leaf, dtype=np.float64) for n, leaf in named_leaves(grads).items()}
        )
    return out


def group_basis(
    apply_fn: Callable[..., Any],
    params: Any,
    forward: Forward,
    batch: Mapping[str, np.ndarray],
    group_of: np.ndarray,
    units: np.ndarray,
) -> tuple[np.ndarray, tuple[tuple[str, tuple[int, ...]], ...]]:
    """(B [K, P], the leaf shapes in sorted path order): b_g for every group of `group_of`
    [N, T] (-1: no group), each on its own row, vmapped over the groups."""
    shapes = tuple((name, tuple(np.shape(leaf))) for name, leaf in named_leaves(params).items())
    num_groups = int(group_of.max(initial=-1)) + 1
    if num_groups == 0:
        return np.zeros((0, sum(int(np.prod(s)) for _, s in shapes))), shapes
    row_of = np.array([np.argwhere(group_of == g)[0, 0] for g in range(num_groups)])
    masks = np.where(group_of[row_of] == np.arange(num_groups)[:, None], units[row_of], 0.0)
    rows = {key: value[:, None] for key, value in _arrays(batch).items()}  # [N, 1, T] each

    def one_group(row: jax.Array, mask: jax.Array) -> Any:
        microbatch = {key: value[row] for key, value in rows.items()}
        return jax.grad(
            lambda p: jnp.sum(mask * token_losses(apply_fn, p, forward, microbatch)[0])
        )(params)

    grads = jax.jit(jax.vmap(one_group))(jnp.asarray(row_of), jnp.asarray(masks))
    leaves = named_leaves(grads)
    matrix = np.concatenate(
        [np.asarray(leaf, dtype=np.float64).reshape(num_groups, -1) for leaf in leaves.values()],
        axis=1,
    )
    return matrix, shapes


def compute_reference(request: dict[str, Any]) -> dict[str, Any]:
    """The reference of ``crosscheck verify --model`` (see the module docstring and
    ``torch_impl.harness.model_reference.compute_reference``: the same request and answer)."""
    try:
        factory = load_callable(request["model"], request["cwd"], "model factory")
        forward = (
            load_callable(request["forward"], request["cwd"], "forward")
            if request["forward"]
            else default_forward
        )
        check_repeatable(factory, request["model"])
        apply_fn, params = fresh_model(factory, request["model"])
    except ModelSetupError as error:
        return {"setup_error": str(error)}
    except Exception as error:
        return {"setup_error": f"calling the model factory {request['model']!r} raised {error!r}"}
    try:
        params = with_dtype(params, jnp.float64)
        bases = {
            name: group_basis(apply_fn, params, forward, batch, group_of, units)
            for name, (batch, group_of, units) in request["fixtures"].items()
        }
        intended = intended_gradients(
            apply_fn,
            params,
            forward,
            [(request["fixtures"][name][0], weights) for name, weights in request["weightings"]],
        )
        # A moe_lb term's reference: the model's own router loss per microbatch slice.
        aux = {
            name: aux_gradients(apply_fn, params, request["fixtures"][name][0], slices)
            for name, slices in request.get("aux_slices", {}).items()
        }
    except Exception as error:
        frames = "".join(traceback.format_exception(error)[-6:])
        return {"error": f"the model's reference gradient raised {error!r}\n{frames}"}
    return {"bases": bases, "intended": intended, **({"aux": aux} if aux else {})}
