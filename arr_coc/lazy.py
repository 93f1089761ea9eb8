"""`cached`: a property computed on first use and kept on the instance, without a lock.

`functools.cached_property` takes an RLock on every first read (Python 3.11), which `torch.compile` cannot
trace, so a compiled pass over the texture or the grid would break its graph there. The core's objects are
built and read by one thread (a batch's geometry, its texture's intermediates), so no lock is needed: the
value lands in the instance's `__dict__` and later reads never reach the descriptor again.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class cached(Generic[T]):  # noqa: N801 - reads like the decorator it replaces
    def __init__(self, fn: Callable[[Any], T]):
        self.fn = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = self.fn(obj)
        obj.__dict__[self.name] = value   # frozen dataclasses too: the instance dict is written directly
        return value


__all__ = ["cached"]
