"""A config's ``module:callable`` references: the user's own code, resolved narrowly and called guardedly.

A red-team config may name code to run (``model.name: mypkg.nets:make_model``, ``target.train_fn``,
``target.clientapp``). Importing a module runs it, so **a config that names code is code**: run configs you
would run as scripts. What guardfl adds on top is that a reference resolves only to what its field means:

- the module part is a dotted Python module name and the attribute part dotted identifiers (``':'``,
  ``'a b:c'`` are refused);
- nothing from Python's standard library or from ``builtins`` (``sys:exit``, ``os:system``, ``os:abort``,
  ``builtins:input`` are not model factories or training functions), and no C builtins (``torch:zeros``);
- a model factory is an ``nn.Module`` subclass or a Python function, and its result must be an ``nn.Module``;
  a training function is a Python function (or bound method).

Calling user code goes through :func:`calling`, which turns anything it raises, ``SystemExit`` included,
into a :class:`UserCodeError` naming the field, so ``sys.exit(0)`` deep inside a user's factory can never
end a red-team run with exit status 0.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
import sys
import types
from collections.abc import Iterator
from typing import Any

from guardfl.errors import GuardflError

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class UserCodeError(GuardflError):
    """A ``module:attribute`` reference cannot be used, or the user's code it names failed."""


def split_ref(ref: str, field: str) -> tuple[str, str]:
    """``'pkg.mod:obj.attr'`` -> (``'pkg.mod'``, ``'obj.attr'``); UserCodeError naming ``field`` otherwise."""
    if not isinstance(ref, str) or ref.count(":") != 1:
        raise UserCodeError(f"{field}: expected 'module:attribute' (got {ref!r})")
    module, attr = ref.split(":")
    if not _DOTTED.match(module) or not _DOTTED.match(attr):
        raise UserCodeError(f"{field}: expected 'module:attribute' with dotted Python names on both sides (got {ref!r})")
    return module, attr


def _standard_library(module: str) -> bool:
    top = module.split(".")[0]
    return top == "builtins" or top in sys.stdlib_module_names


def resolve(ref: str, field: str) -> Any:
    """Import the module of ``ref`` and return its attribute, refusing standard-library and C-builtin
    objects. Import errors (and anything the module's own code raises while importing) are one line."""
    module, attr = split_ref(ref, field)
    if _standard_library(module):
        raise UserCodeError(f"{field}: {ref!r} is in Python's standard library, not your code; "
                            "give 'module:callable' of your own module")
    with calling(field, f"importing {module!r}"):
        try:
            obj: Any = importlib.import_module(module)
        except ImportError as err:
            raise UserCodeError(f"{field}: cannot import {module!r}: {err} (set target.app_dir to the folder "
                                "that holds it)") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UserCodeError(f"{field}: {module!r} has no attribute {attr!r}") from None
    owner = getattr(obj, "__module__", None) or ""
    if isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType)) or (
            callable(obj) and not isinstance(obj, type) and owner and _standard_library(owner)):
        raise UserCodeError(f"{field}: {ref!r} is a built-in or standard-library function, not your code")
    return obj


def model_factory(ref: str, field: str = "model.name") -> Any:
    """A model factory: an ``nn.Module`` subclass or a Python function (its result is checked when called)."""
    from torch import nn

    obj = resolve(ref, field)
    if isinstance(obj, type):
        if not issubclass(obj, nn.Module):
            raise UserCodeError(f"{field}: {ref!r} is the class {obj.__name__}, not a torch.nn.Module subclass")
        return obj
    if not inspect.isfunction(obj):
        raise UserCodeError(f"{field}: {ref!r} is a {type(obj).__name__}; expected a torch.nn.Module subclass or a "
                            "function that returns one")
    return obj


def train_function(ref: str, field: str = "target.train_fn") -> Any:
    """A training function ``fn(model, loader)``: a Python function or bound method."""
    obj = resolve(ref, field)
    if not (inspect.isfunction(obj) or inspect.ismethod(obj)):
        raise UserCodeError(f"{field}: {ref!r} is a {type(obj).__name__}; expected a Python function fn(model, loader)")
    return obj


@contextlib.contextmanager
def calling(field: str, what: str = "") -> Iterator[None]:
    """Run user code: any exception, and ``SystemExit``, becomes one UserCodeError line naming ``field``.
    KeyboardInterrupt passes (the operator stopped the run)."""
    doing = f" while {what}" if what else ""
    try:
        yield
    except GuardflError:
        raise
    except SystemExit as err:
        raise UserCodeError(f"{field}: the code called sys.exit({err.code!r}){doing}; the run stops without "
                            "a verdict") from None
    except Exception as err:
        raise UserCodeError(f"{field}: {type(err).__name__}{doing}: {err}") from None
