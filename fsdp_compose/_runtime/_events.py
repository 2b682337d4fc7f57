"""The runtime's one event interface: what one root's units and collectives do.

[Note: runtime events]
Each root's tree of units shares one :class:`Events` object (held by its
``ScheduleSettings``, then by its scheduler). Tools subscribe an :class:`Observer`
to it (``FSDPModule.register_observer``): the trace, the debug checks, the checks
fsdp_compose adds to FSDP2's (``fsdp_compose._checks``, which the public
``fully_shard`` passes to every call) and the tests' collective logs all see the same
calls, in program order. Nothing is module-global: two roots have two observer lists and two
step counters. With no observer, an event costs one truthiness check of a tuple.
An observer may raise from ``on_collective("issue", ...)`` to refuse the collective
before any data moves (the debug checks raise a mismatch this way, on every rank);
from ``on_annotate`` to refuse a ``fully_shard`` call before it changes anything.

[Note: observer values]
Observers get values, never the runtime's objects: a :class:`UnitInfo` (frozen)
describes a unit as the user's model names it, so an observer survives any change to
how units, buffers or sharded parameters are built, cannot change what it observes,
and keeps no model alive. Each unit keeps one description, built when first asked for
and again after a change (its settings, its dtypes; at the root's lazy init, its name
and FQNs). An event that carries values of its own (parameter data versions, an
extension unit's all-gather inputs, the parameters without a gradient) hands out a copy
with them filled in, made only where an observer receives that event
(``Observer.unit_events``). With no observer of unit events, an event costs one
truthiness check: the runtime's call sites test ``Events.on_unit`` before anything
else. Observers keep their own state, keyed by :attr:`UnitInfo.id`.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

import torch
import torch.distributed as dist
import torch.nn as nn

if TYPE_CHECKING:
    from ._mesh import MeshInfo
    from ._policies import MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "Annotation",
    "CollectiveEvent",
    "CollectiveInfo",
    "CollectiveKind",
    "Events",
    "GatherInput",
    "Observer",
    "ParamInfo",
    "UnitEvent",
    "UnitInfo",
    "UnitOptionsInfo",
]

#: The units' collectives (``all_gather``, ``reduce_scatter``, HSDP's ``all_reduce``),
#: and those the tools issue through the runtime (see [Note: tools' collectives]):
#: an all-reduce with an op, an all-to-all with split sizes, object gathers and
#: broadcasts, and a set of point-to-point sends and receives (``send_recv``).
CollectiveKind = Literal[
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "all_gather_object",
    "broadcast_object",
    "send_recv",
]
#: ``issue``: about to be launched; ``complete``: the backend finished it (from its
#: thread where the work has a future, else at the wait); ``wait_begin``/``wait_end``.
CollectiveEvent = Literal["issue", "complete", "wait_begin", "wait_end"]
#: A unit's lazy init, forward and backward spans, a gather finished (``gathered``) or
#: about to be freed (``resharding``), the scheduler's prefetch decisions, and an
#: extension unit's all-gather inputs packed, before the collective (``packed``).
UnitEvent = Literal[
    "lazy_init",
    "packed",
    "forward_begin",
    "forward_end",
    "backward_begin",
    "backward_end",
    "gathered",
    "resharding",
    "prefetch",
    "prefetch_deferred",
]


@dataclass(frozen=True)
class CollectiveInfo:
    """One collective as this rank issues it: enough to count, size and
    cross-check collectives. ``seq`` numbers the collectives of one root's tree.

    A tool's collective (``label`` names its operation, e.g. ``muon.exchange``)
    sets ``op`` for an all-reduce that is not a sum, and ``total_numel`` where the
    sizes differ between the ranks of the group (an all-to-all's splits, a gather
    to one rank): a size every rank of the group reports the same. On an
    accelerator, ``duration_s`` (on ``complete``: how long the collective ran on
    the device, from the point its stream could start it) and ``waited_s`` (on
    ``wait_end``: how long the waiting stream stalled for it) come from device
    events, reported once the device has passed them; ``None`` elsewhere, where the
    observer's clock at the event is the time."""

    kind: CollectiveKind
    label: str  # the unit's name (its module's FQN), or the tool's operation
    group: dist.ProcessGroup
    input_numel: int
    output_numel: int
    dtype: torch.dtype
    step: int
    seq: int
    custom: bool = False  # issued through a user's Comm (set_custom_all_gather, ...)
    op: str = ""  # a tool's all-reduce: "max", "min", ...; "" for a sum
    total_numel: int | None = None  # the same on every rank where input_numel differs
    duration_s: float | None = None
    waited_s: float | None = None

    @property
    def group_size(self) -> int:
        return self.group.size()

    @property
    def agreed_numel(self) -> int:
        """The collective's size as every rank of the group reports it."""
        return self.input_numel if self.total_numel is None else self.total_numel

    @property
    def input_bytes(self) -> int:
        return self.input_numel * self.dtype.itemsize

    @property
    def output_bytes(self) -> int:
        return self.output_numel * self.dtype.itemsize


@dataclass(frozen=True)
class Annotation:
    """One ``fully_shard`` call as the runtime resolved it, before it changes anything:
    ``managed``, the modules whose parameters it manages; ``owners``, each parameter it
    will shard with the (module, name) pairs that hold it. The modules and parameters
    are the user's own; the containers are copies (changing them changes nothing)."""

    modules: tuple[nn.Module, ...]
    managed: tuple[nn.Module, ...]
    ignored: frozenset[nn.Parameter]
    owners: Mapping[nn.Parameter, tuple[tuple[nn.Module, str], ...]]
    mesh_info: MeshInfo  # a frozen value: the call's groups, sizes and device
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy | Mapping[str, OffloadPolicy]  # as the call passed it
    shard_placement_fn: Any


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of a unit: its name under the root, its unsharded ``shape``, its
    ``dtype`` (before mixed precision) and whether it ``requires_grad``."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class UnitOptionsInfo:
    """A unit's settings (``fully_shard``'s arguments and ``FSDPModule.set_*``), as plain
    values. ``param_dtype``/``reduce_dtype`` are its ``MixedPrecisionPolicy``'s;
    ``custom_all_gather``/``custom_reduce_scatter``: a user's ``Comm`` replaces the
    default one."""

    reshard_after_forward: bool | int
    reshard_after_backward: bool
    requires_gradient_sync: bool
    requires_all_reduce: bool
    gradient_divide_factor: float | None
    reduce_scatter_unused_params: bool
    force_sum_reduction: bool
    unshard_in_backward: bool
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    offload: bool
    custom_all_gather: bool
    custom_reduce_scatter: bool


@dataclass(frozen=True)
class GatherInput:
    """What an extension (tensor-subclass) parameter's ``fsdp_pre_all_gather`` returned
    on this rank: the ``sizes`` and ``dtypes`` of its all-gather inputs."""

    fqn: str
    sizes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]


@dataclass(frozen=True)
class UnitInfo:
    """One unit (the parameters of one ``fully_shard`` call) as observers see it; see
    [Note: observer values].

    ``id`` is the unit's, unique in the process and the same for the unit's life (key
    an observer's state by it); ``name`` is its module's FQN under the root. The groups
    are the ones it all-gathers and reduce-scatters in (``replicate_group``: HSDP's
    all-reduce, else None), with their ranks in the default group.

    The last four fields are an event's own values, None for the other events:

    * ``sharded_versions``: at ``forward_begin`` and ``backward_begin``, the version
      counters of the sharded parameters' data (an in-place change, an optimizer step,
      bumps them);
    * ``unsharded_version``: at ``gathered`` and ``resharding``, the version counter of
      the unsharded parameters' storage (None where they alias the shards, or for an
      extension unit);
    * ``all_gather_inputs``: at ``packed``, each parameter's all-gather inputs;
    * ``without_grad``: at ``backward_end``, the FQNs of the trainable parameters that
      got no gradient on this rank.
    """

    id: int
    name: str
    params: tuple[ParamInfo, ...]
    options: UnitOptionsInfo
    device: torch.device
    shard_group: dist.ProcessGroup
    shard_ranks: tuple[int, ...]
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    replicate_ranks: tuple[int, ...]
    sharded_versions: tuple[int, ...] | None = None
    unsharded_version: int | None = None
    all_gather_inputs: tuple[GatherInput, ...] | None = None
    without_grad: tuple[str, ...] | None = None

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(p.fqn for p in self.params)

    def with_values(self, **values: Any) -> UnitInfo:
        """A copy with an event's ``values`` (the fields after ``replicate_ranks``)."""
        # Copied field by field rather than through dataclasses.replace, whose __init__
        # costs several times more: the runtime makes one per event an observer receives.
        copy = object.__new__(UnitInfo)
        copy.__dict__.update(self.__dict__, **values)
        return copy


class Observer:
    """Subscribes to one root's runtime events (see [Note: runtime events]).
    Every method does nothing here: override the ones you need.

    Attributes:
        unit_events (FrozenSet[str]): the unit events :meth:`on_unit` receives (every
            one by default; read when the observer is subscribed); an event's values
            are computed only where some observer receives it.
    """

    unit_events: ClassVar[frozenset[UnitEvent]] = frozenset(get_args(UnitEvent))

    def on_annotate(self, call: Annotation) -> None:
        """A ``fully_shard`` call given this observer (the runtime's ``observers=``, as
        fsdp_compose's checks are) is about to change its modules; raising refuses it."""

    def on_root_init(self, units: Sequence[UnitInfo]) -> None:
        """The root's lazy init named and initialized its tree's ``units``."""

    def on_step(self, step: int) -> None:
        """A forward pass of the root began: ``step`` counts them from 1."""

    def on_unit(self, event: UnitEvent, info: UnitInfo) -> None:
        """The unit ``info`` describes (``info.name`` is its module's FQN) did ``event``;
        ``info`` carries the event's own values where it has some."""

    def on_memory(
        self, event: Literal["alloc", "free"], info: UnitInfo, nbytes: int, total: int
    ) -> None:
        """The unit ``info`` describes began or stopped holding ``nbytes`` of unsharded
        parameters; ``total``: what the root's units hold now."""

    def on_collective(self, event: CollectiveEvent, info: CollectiveInfo) -> None:
        """A collective of the root's units, or one a tool issued for the root's
        parameters, was issued, completed or waited for."""


_EVENT_METHODS = ("on_annotate", "on_root_init", "on_step", "on_unit", "on_memory", "on_collective")


class Events:
    """One root's observers, in subscription order, and its step count. Each kind of
    event goes only to the observers that override its method (no cost elsewhere)."""

    __slots__ = ("_deferred", "_seq", "_unit_observers", "observers", "step", *_EVENT_METHODS)

    def __init__(self, observers: Iterable[Observer] = ()) -> None:
        self.observers: list[Observer] = []
        self.on_annotate: tuple[Observer, ...] = ()
        self.on_root_init: tuple[Observer, ...] = ()
        self.on_step: tuple[Observer, ...] = ()
        self.on_unit: tuple[Observer, ...] = ()  # those receiving some unit event
        self._unit_observers: dict[str, tuple[Observer, ...]] = {}  # per unit event
        self.on_memory: tuple[Observer, ...] = ()
        self.on_collective: tuple[Observer, ...] = ()  # read on the hot path
        self.step = 0  # forward passes of the root begun so far
        self._seq = itertools.count()
        # Collective events waiting for the device (see [Note: device times]).
        self._deferred: collections.deque[Callable[[bool], bool]] = collections.deque()
        for observer in observers:
            self.add(observer)

    def add(self, observer: Observer) -> None:
        if not isinstance(observer, Observer):
            raise TypeError(
                f"an fsdp_compose observer must subclass fsdp_compose.Observer, got "
                f"{type(observer).__name__}"
            )
        if observer not in self.observers:
            self.observers.append(observer)
            self._split()

    def remove(self, observer: Observer) -> None:
        if observer in self.observers:
            self.report_deferred(block=True)  # what it observed, before it leaves
            self.observers.remove(observer)
            self._split()

    def _split(self) -> None:
        for name in _EVENT_METHODS:
            default = getattr(Observer, name)
            chosen = tuple(o for o in self.observers if getattr(type(o), name) is not default)
            setattr(self, name, chosen)
        self.on_unit = tuple(o for o in self.on_unit if o.unit_events)
        self._unit_observers = {
            event: tuple(o for o in self.on_unit if event in o.unit_events)
            for event in get_args(UnitEvent)
        }

    def adopt(self, other: Events) -> None:
        """Takes over ``other``'s observers (a subtree annotated earlier)."""
        for observer in other.observers:
            self.add(observer)

    def annotate(self, call: Annotation) -> None:
        for observer in self.on_annotate:
            observer.on_annotate(call)

    def root_init(self, units: Sequence[UnitInfo]) -> None:
        for observer in self.on_root_init:
            observer.on_root_init(units)

    def begin_step(self) -> None:
        self.step += 1
        for observer in self.on_step:
            observer.on_step(self.step)

    # The runtime calls these only where ``self.on_unit``/``self.on_memory`` is not
    # empty ([Note: observer values]).
    def unit(self, event: UnitEvent, describe: Callable[[UnitEvent], UnitInfo]) -> None:
        """Hands ``describe(event)`` (the unit's :class:`UnitInfo` with ``event``'s
        values) to the observers receiving ``event``, building it only if there are some."""
        observers = self._unit_observers[event]
        if observers:
            info = describe(event)
            for observer in observers:
                observer.on_unit(event, info)

    def memory(
        self, event: Literal["alloc", "free"], info: UnitInfo, nbytes: int, total: int
    ) -> None:
        for observer in self.on_memory:
            observer.on_memory(event, info, nbytes, total)

    def collective(self, event: CollectiveEvent, info: CollectiveInfo) -> None:
        for observer in self.on_collective:
            observer.on_collective(event, info)

    def next_seq(self) -> int:
        return next(self._seq)

    def defer(self, report: Callable[[bool], bool]) -> None:
        """Queues ``report(block)``, which reports collective events once the device
        has passed them: it returns whether it did (with ``block``: waits for it)."""
        self._deferred.append(report)

    def report_deferred(self, block: bool = False) -> None:
        """Reports the queued collective events the device has passed, in order
        (``block``: all of them, waiting for the device)."""
        while self._deferred and self._deferred[0](block):
            self._deferred.popleft()
