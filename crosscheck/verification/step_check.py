"""Whether a ``--step`` can run, found before any process of the harness starts.

`check_step` refuses, with `StepSetupError` (a ValueError), a ``MODULE:FUNCTION`` that names
no importable module or a module without that callable, a plain source file with a syntax
error, a function whose parameters cannot take the framework's call, and a step module that
starts a verification when imported: the user's set-up is wrong, and no case is run or
reported. The user's module is never imported into this process: a plain source file is read,
anything else is imported in one short, bounded subprocess. (The calling script itself is never
imported again by a rank or a worker: a verification called from its top level, with no
``__main__`` guard, runs once.)
"""

from __future__ import annotations

import ast
import difflib
import importlib.machinery
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any

from crosscheck.launch.processes import stop_groups
from crosscheck.launch.worker_processes import start_worker


def step_name(step: str | Callable) -> str:
    """'module:function' for a step given by name or as an importable function."""
    if isinstance(step, str):
        module, sep, function = step.partition(":")
        if not sep or not module or not function:
            raise ValueError(f"a step is named MODULE:FUNCTION, got {step!r}")
        return step
    module = getattr(step, "__module__", None)
    qualname = getattr(step, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        raise ValueError(
            f"the step {step!r} must be a module-level function of an importable module "
            "(it runs in fresh processes, which import it by name)"
        )
    return f"{module}:{qualname}"


class StepSetupError(ValueError):
    """The step cannot run as given: no such module, no such attribute, not callable, a syntax
    error, a signature the framework's call cannot bind, or a verification started at import.

    Raised by `verify` (through `check_step`) before any runner
    starts: the user's set-up is wrong, and no case is run or reported.
    """


#: The calls that start a verification. Made at a step module's import, outside an ``if
#: __name__ == "__main__":`` guard, one runs again in every process that imports the module to
#: run the step: every torch rank and JAX worker.
VERIFY_CALLS = frozenset({"verify", "assert_weighting"})


def _is_main_guard(node: ast.stmt) -> bool:
    """An ``if`` whose test reads ``__name__`` (``if __name__ == "__main__":``, either way
    round, or within a longer condition). Any such test counts as a guard: a check that
    mistook a real guard for none would refuse a correct module."""
    return isinstance(node, ast.If) and any(
        isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(node.test)
    )


def _guarded_at(tree: ast.Module, line: int) -> bool:
    """Whether `line` lies inside an ``if`` that tests ``__name__`` (`_is_main_guard`), at any
    depth: under ``try:``, ``with``, another ``if`` as well as at the top level."""
    return any(
        _is_main_guard(node) and node.lineno <= line <= (node.end_lineno or node.lineno)
        for node in ast.walk(tree)
    )


def _verify_call_line(tree: ast.Module) -> int | None:
    """The first line of a call to crosscheck's `verify` or `assert_weighting` that runs when
    the module is imported: outside every function and lambda (a class body runs at import)
    and outside any ``if`` that tests ``__name__``. Only calls through a name the module bound
    to crosscheck (``import crosscheck [as cc]``, ``from crosscheck import verify [as v]``)
    count: another library's ``verify`` is not ours."""
    modules, functions = set(), set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "crosscheck"}
        elif isinstance(node, ast.ImportFrom) and node.module == "crosscheck":
            functions |= {a.asname or a.name for a in node.names if a.name in VERIFY_CALLS}
    deferred = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    pending = [n for n in tree.body if not isinstance(n, deferred)]
    lines = []
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id in functions) or (
                isinstance(f, ast.Attribute)
                and f.attr in VERIFY_CALLS
                and isinstance(f.value, ast.Name)
                and f.value.id in modules
            ):
                lines.append(node.lineno)
        pending.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, deferred))
    unguarded = [line for line in lines if not _guarded_at(tree, line)]
    return min(unguarded) if unguarded else None


#: The one subprocess that imports the step's module to look for the function may take this
#: long (importing torch or JAX is most of it); past it the check gives up and the runners,
#: which bound their own waits, report whatever the import does.
STEP_CHECK_TIMEOUT_S = 60.0
_CHECK_POLL_S = 0.02
#: How long the check waits for its killed group to be gone.
_CHECK_KILL_WAIT_S = 5.0
_ROOT = str(Path(__file__).resolve().parents[2])

#: Run as ``python -c`` in the caller's directory: import the module, find the attribute,
#: write what was found as JSON, and leave at once (os._exit: threads the module started must
#: not keep the check alive).
_CHECK_SOURCE = """
import importlib, json, os, sys
module_name, attribute, cwd, out, parent_path = sys.argv[1:6]
sys.path[:0] = [p for p in [cwd, *json.loads(parent_path)] if p not in sys.path]
def report(kind, detail=None):
    with open(out, "w") as f:
        json.dump({"kind": kind, "detail": detail}, f)
    os._exit(0)
try:
    value = importlib.import_module(module_name)
except ModuleNotFoundError as error:
    missing = error.name or ""
    if missing and (module_name == missing or module_name.startswith(missing + ".")):
        report("no-module", missing)
    report("import-failed", f"{type(error).__name__}: {error}")
except BaseException as error:
    report("import-failed", f"{type(error).__name__}: {error}")
origin = getattr(value, "__file__", None) or module_name
for part in attribute.split("."):
    try:
        found = hasattr(value, part)
    except BaseException as error:
        report("import-failed", f"{type(error).__name__}: {error}")
    if not found:
        names = sorted(n for n in dir(value) if not n.startswith("_")
                       and callable(getattr(value, n, None)))
        report("no-attribute", [part, origin, names])
    value = getattr(value, part)
if not callable(value):
    report("not-callable", [origin, f"{type(value).__name__} {value!r:.80}"])
import inspect
try:
    context = inspect.signature(value).parameters.get("context")
except (TypeError, ValueError):
    report("ok", None)
keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
report("ok", context is not None and context.kind in keyword)
"""


def _spec_without_importing(module: str, cwd: str) -> ModuleSpec | None:
    """The module's spec, found as the runners' import would (`cwd` first), importing nothing.

    A dotted name's packages are walked by their search locations, not imported (importing a
    package runs its ``__init__``). None when the top-level name is found nowhere; a spec
    whose name is a parent's when the walk cannot go further (a module that is not a
    package, a package that builds its path at import): only importing it can tell.
    """
    parts = module.split(".")
    spec = importlib.machinery.PathFinder.find_spec(parts[0], [cwd])
    if spec is None:
        try:  # the interpreter's own path, meta-path finders (editable installs) included
            spec = importlib.util.find_spec(parts[0])
        except (ImportError, ValueError):
            spec = None
    if spec is None:
        return None
    for index in range(1, len(parts)):
        locations = spec.submodule_search_locations
        if not locations:
            return spec
        child = importlib.machinery.PathFinder.find_spec(".".join(parts[: index + 1]), locations)
        if child is None:
            return spec
        spec = child
    return spec


def _top_level(tree: ast.Module, name: str) -> ast.stmt | None:
    """The function or class `name` the module defines at top level, if any."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return next((n for n in tree.body if isinstance(n, kinds) and n.name == name), None)


#: The call each framework's harness makes (crosscheck.verification.protocol), as positional
#: placeholders: torch ``step(model, microbatches)``, JAX ``step(params, apply_fn, batch,
#: mesh)``; both add ``optimizer=`` for a step that declares it.
PROTOCOL_ARGUMENTS = {
    "torch": ("model", "microbatches"),
    "jax": ("params", "apply_fn", "batch", "mesh"),
}


def _declares(signature: inspect.Signature, name: str) -> bool:
    """Whether a step declares a parameter `name` that can be passed by keyword (a bare
    ``**kwargs`` does not count: the step must ask for it, to be held to the convention that
    goes with it)."""
    parameter = signature.parameters.get(name)
    return parameter is not None and parameter.kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    )


def takes_optimizer(signature: inspect.Signature) -> bool:
    """Whether a step asks for an ``optimizer`` (`_declares`). The runners read their steps
    by this rule too."""
    return _declares(signature, "optimizer")


def takes_context(signature: inspect.Signature) -> bool:
    """Whether a step is context-parallel: it declares a ``context`` parameter (`_declares`;
    crosscheck.verification.protocol, "Context parallel"). The runners read it alike."""
    return _declares(signature, "context")


def _binds(signature: inspect.Signature, framework: str) -> str:
    """'' when the framework's harness can call a function of `signature`, else why not."""
    arguments = PROTOCOL_ARGUMENTS[framework]
    keywords = {
        name: None
        for name, declared in (
            ("optimizer", takes_optimizer(signature)),
            ("context", takes_context(signature)),
        )
        if declared
    }
    try:
        signature.bind(*arguments, **keywords)
    except TypeError as error:
        return str(error)
    return ""


def _stub_signature(function: ast.FunctionDef | ast.AsyncFunctionDef) -> inspect.Signature:
    """The signature of a plain function read from its source: the same parameters with no
    annotations, defaults or body, so that nothing of the user's runs."""
    arguments = ast.arguments(
        posonlyargs=[ast.arg(a.arg) for a in function.args.posonlyargs],
        args=[ast.arg(a.arg) for a in function.args.args],
        vararg=function.args.vararg and ast.arg(function.args.vararg.arg),
        kwonlyargs=[ast.arg(a.arg) for a in function.args.kwonlyargs],
        kw_defaults=[None if d is None else ast.Constant(None) for d in function.args.kw_defaults],
        kwarg=function.args.kwarg and ast.arg(function.args.kwarg.arg),
        defaults=[ast.Constant(None) for _ in function.args.defaults],
    )
    stub = ast.FunctionDef(function.name, arguments, [ast.Pass()], [], None, type_params=[])
    namespace: dict[str, Any] = {}
    exec(compile(ast.fix_missing_locations(ast.Module([stub], [])), "<step>", "exec"), namespace)
    return inspect.signature(namespace[function.name])


def _plain_function(node: ast.stmt) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """`node` when it is an undecorated function, whose signature its source tells; a
    decorated function, or a class, may take anything: None."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.decorator_list:
        return node
    return None


def _signature_problem(function: ast.FunctionDef | ast.AsyncFunctionDef, framework: str) -> str:
    """Why the harness of `framework` cannot call the plain function `function` (read from its
    source, never run), or ''."""
    signature = _stub_signature(function)
    why = _binds(signature, framework)
    if not why:
        return ""
    expected = ", ".join(PROTOCOL_ARGUMENTS[framework])
    text = f"{function.name}{signature} cannot take {framework}'s ({expected}[, optimizer]): {why}"
    other = next(f for f in PROTOCOL_ARGUMENTS if f != framework)
    if not _binds(signature, other):
        text += (
            f"; it takes {other}'s ({', '.join(PROTOCOL_ARGUMENTS[other])}): --framework {other}?"
        )
    return text


def _import_check(
    module: str, function: str, cwd: str, framework: str, timeout_s: float
) -> dict[str, Any] | None:
    """What importing `module` and looking up `function` finds, in one short subprocess (the
    user's module may import torch or JAX, or do anything at import: never in this process).
    None when the check could not tell (it timed out or died)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, _ROOT, env.get("PYTHONPATH", "")) if p)
    if framework == "jax":  # as the JAX worker has them, for a module that reads them at import
        env.setdefault("JAX_PLATFORMS", "cpu")
        env["JAX_ENABLE_X64"] = "1"
    with tempfile.TemporaryDirectory(prefix="gradweight-step-check-") as tmp:
        out = Path(tmp) / "found.json"
        argv = [module, function, cwd, str(out), json.dumps([p for p in sys.path if p])]
        # A worker of the process layer: its own group (whatever the import starts goes with
        # it), registered, so that an interrupt stops it like any other.
        leader = start_worker(
            [sys.executable, "-c", _CHECK_SOURCE, *argv],
            stdout=Path(tmp) / "check.out",
            stderr=Path(tmp) / "check.err",
            env=env,
            cwd=cwd,
        )
        deadline = time.monotonic() + timeout_s
        try:
            while leader.poll() is None and time.monotonic() < deadline:
                time.sleep(_CHECK_POLL_S)
        finally:
            # Kill the group even when the leader has exited: the import may have started
            # processes of its own.
            stop_groups([leader], wait_s=_CHECK_KILL_WAIT_S)
        try:
            return json.loads(out.read_text())
        except (OSError, ValueError):
            return None


def check_step(
    step: str,
    framework: str = "torch",
    *,
    cwd: str | None = None,
    timeout_s: float = STEP_CHECK_TIMEOUT_S,
    option: str = "--step",
) -> bool | None:
    """Raise `StepSetupError` if ``MODULE:FUNCTION`` names no importable module, or a module
    without that callable, as the runners would import it from `cwd` (default: the current
    directory, first on the path).

    The module is never imported into this process. A top-level module that exists nowhere
    is refused at once; a plain source file that defines the function at top level passes
    without running anything; anything else is imported in one short subprocess (bounded by
    `timeout_s`). A plain source file is also refused for a syntax error, a signature the
    framework's call cannot bind (for ``--step``) and a verification its import would start;
    otherwise only a missing module, a missing attribute or a non-callable one is refused:
    a module that raises at import, or a check that cannot finish, is left to the runners,
    which report it per case in their own environment. `option` names what is checked in
    the message (``--model`` and ``--forward`` name callables too).

    Returns whether the callable declares a ``context`` parameter (`takes_context`: a
    context-parallel step), or None where that cannot be told without running the user's
    code (a decorated function or a class in a plain source file, a check that did not
    finish).
    """
    module, _, function = step_name(step).partition(":")
    cwd = os.getcwd() if cwd is None else cwd
    spec = _spec_without_importing(module, cwd)
    if spec is None:
        top = module.split(".")[0]
        raise StepSetupError(
            f"{option} {step}: no module named {top!r} in {cwd} (the current directory) or on "
            "the Python path"
        )
    origin = spec.origin if spec.name == module and spec.has_location else None
    if origin and origin.endswith(".py"):
        # A plain source file is read, not run: a syntax error, and a function whose
        # parameters cannot take the framework's call, are found here, before any process.
        try:
            tree = ast.parse(Path(origin).read_bytes(), filename=origin)
        except SyntaxError as error:
            raise StepSetupError(
                f"{option} {step}: {origin}:{error.lineno}: SyntaxError: {error.msg}"
            ) from None
        except (OSError, ValueError):
            tree = None
        line = None if tree is None else _verify_call_line(tree)
        if line is not None:
            raise StepSetupError(
                f"{option} {step}: {origin}:{line}: the module starts a verification when it "
                "is imported, and every process that runs the step imports it: put the call "
                'under `if __name__ == "__main__":`'
            )
        found = None if tree is None else _top_level(tree, function)
        if found is not None:
            plain = _plain_function(found)
            if plain is None:
                return None
            problem = _signature_problem(plain, framework) if option == "--step" else ""
            if problem:
                raise StepSetupError(f"{option} {step}: {problem}")
            return takes_context(_stub_signature(plain))
    found = _import_check(module, function, cwd, framework, timeout_s)
    kind = None if found is None else found.get("kind")
    detail = None if found is None else found.get("detail")
    if kind == "no-module":
        raise StepSetupError(
            f"{option} {step}: no module named {detail!r} in {cwd} (the current directory) or "
            "on the Python path"
        )
    if kind == "no-attribute":
        part, where, names = detail
        close = difflib.get_close_matches(part, names, n=3)
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        if close:
            hint = f"; did you mean {' or '.join(close)}?"
        else:
            hint = f"; its callables: {shown}" if names else "; it defines no public callable"
        raise StepSetupError(f"{option} {step}: {module} ({where}) has no attribute {part!r}{hint}")
    if kind == "not-callable":
        where, what = detail
        raise StepSetupError(
            f"{option} {step}: {module}:{function} ({where}) is not callable: it is {what}"
        )
    return detail if kind == "ok" and isinstance(detail, bool) else None
