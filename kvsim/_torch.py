"""torch, imported on first use: the policy modules write ``from kvsim._torch import torch`` (and
``F`` for ``torch.nn.functional``), so that importing them (the policy registry, a policy
profile's settings, the planner) needs no torch; running a policy's algorithm does. Without
torch the first use raises ModuleNotFoundError (name ``torch``), which the CLI turns into one
line with the install command. On the first use the real module's names are copied onto the
stand-in, which then becomes a plain module, so that later look-ups cost what a module's do."""

from __future__ import annotations

import importlib
import types


class _Lazy(types.ModuleType):
    def __init__(self, name: str):
        super().__init__(name)
        self.__dict__["_real"] = None

    def _load(self):
        real = self.__dict__["_real"]
        if real is None:
            real = importlib.import_module(self.__name__)  # ModuleNotFoundError without torch
            self.__dict__.update({k: v for k, v in vars(real).items()
                                  if not k.startswith("__")})
            self.__dict__["_real"] = real
            self.__class__ = types.ModuleType  # a plain module from now on: no look-up hook
        return real

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return getattr(self._load(), name)

    def __repr__(self) -> str:
        return f"<lazy module {self.__name__!r}>"


def lazy(name: str) -> types.ModuleType:
    """Module ``name``, imported on its first use (as ``torch`` here): for a module whose import
    is heavy (VerKV's compiled loops import torch and numba) beside code that does not need it."""
    return _Lazy(name)


torch = _Lazy("torch")
F = _Lazy("torch.nn.functional")
