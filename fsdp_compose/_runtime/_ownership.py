"""Which ``fully_shard`` call owns a tensor: the runtime's answers for the tools.

[Note: parameter records]
Nothing is written on a user's tensor. ``fully_shard`` records three kinds of
parameters in maps that this module owns and alone writes:

- the sharded ``DTensor`` parameters it registers, each with the
  :class:`ShardedParam` that owns it (so that a query sees the name the root's lazy
  init gives it);
- the ``ignored_params`` it left plain on purpose (reduced by the user, not
  forgotten), with the module attribute that holds each;
- the original parameters it replaced by sharded ones (an optimizer built before
  ``fully_shard`` holds these, and the checks name the call that replaced them).

The maps never keep a model alive. A parameter still registered on a module is
not referenced at all, not even weakly: ``torch.utils.swap_tensors`` (how
``nn.Module._apply`` converts ``DTensor`` parameters) refuses a tensor with weak
references. Its entry is keyed by ``id()`` and holds its owner weakly (the
``ShardedParam``, or the module); a query checks that the owner still holds that very
object, so a reused ``id`` never answers. A swap keeps the Python object, so a record
survives it; a parameter replaced by assignment is recorded again when its unit adopts
it. An original parameter is out of every module once replaced, so it is keyed weakly.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from ._sharded_param import ShardedParam
    from ._unit import Unit

__all__ = ["fqn_of", "ignored_by", "is_ignored", "owner_of", "replaced_by"]

_sharded: dict[int, weakref.ref[ShardedParam]] = {}  # id(DTensor) -> its owner
_ignored: dict[int, tuple[weakref.ref[nn.Module], str, str]] = {}  # -> (module, name, label)
_replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()  # original parameter -> unit label
# ShardedParam -> the unit that holds it (weakly: the unit holds its ShardedParams).
_units: weakref.WeakKeyDictionary[ShardedParam, weakref.ref[Unit]] = weakref.WeakKeyDictionary()


def _drop_when_dead(table: dict[int, Any], key: int) -> Callable[[weakref.ref[Any]], None]:
    def drop(ref: weakref.ref[Any]) -> None:
        entry = table.get(key)
        if entry is ref or (isinstance(entry, tuple) and entry[0] is ref):
            del table[key]

    return drop


def record_sharded(param: torch.Tensor, owner: ShardedParam) -> None:
    _sharded[id(param)] = weakref.ref(owner, _drop_when_dead(_sharded, id(param)))


def record_ignored(param: torch.Tensor, module: nn.Module, name: str, unit_label: str) -> None:
    ref = weakref.ref(module, _drop_when_dead(_ignored, id(param)))
    _ignored[id(param)] = (ref, name, unit_label)


def record_replaced(param: torch.Tensor, unit_label: str) -> None:
    _replaced[param] = unit_label


def record_unit(owner: ShardedParam, unit: Unit) -> None:
    _units[owner] = weakref.ref(unit)


def unit_of(param: object) -> Unit | None:
    """The unit that holds ``param`` as one of its sharded ``DTensor`` parameters."""
    owner = _owner(param)
    ref = None if owner is None else _units.get(owner)
    return None if ref is None else ref()


def _owner(param: object) -> ShardedParam | None:
    ref = _sharded.get(id(param))
    owner = None if ref is None else ref()
    return owner if owner is not None and owner.sharded_param is param else None


def owner_of(param: object) -> str | None:
    """The label of the ``fully_shard`` call (its modules' names) whose unit holds
    ``param`` as one of its sharded ``DTensor`` parameters; ``None`` for any other
    object (an original parameter ``fully_shard`` replaced, a TP-only ``DTensor``)."""
    owner = _owner(param)
    return None if owner is None else owner.unit_label


def fqn_of(param: object) -> str | None:
    """The name of a sharded parameter: under its root once the root's lazy init
    ran (the first forward), before that under the module ``fully_shard`` was given;
    ``None`` for a tensor no unit holds."""
    owner = _owner(param)
    return None if owner is None else owner.fqn


def replaced_by(param: object) -> str | None:
    """The label of the ``fully_shard`` call that replaced ``param`` (an original,
    unsharded parameter) by a sharded one, else ``None``."""
    return _replaced.get(param) if isinstance(param, torch.Tensor) else None


def ignored_by(param: object) -> str | None:
    """The label of the ``fully_shard`` call that left ``param`` plain because it
    was in ``ignored_params``, else ``None``."""
    entry = _ignored.get(id(param))
    module = None if entry is None else entry[0]()
    if module is None or module._parameters.get(entry[1]) is not param:  # type: ignore[index]
        return None
    return entry[2]  # type: ignore[index]


def is_ignored(param: object) -> bool:
    """Whether a ``fully_shard`` call left ``param`` plain through ``ignored_params``."""
    return ignored_by(param) is not None
