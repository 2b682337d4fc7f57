"""Hooks: how forward and autograd tell the scheduler what is happening.

Each :func:`fully_shard` call attaches one :class:`UnitState` to its module(s): its
forward pre-hook gathers and wraps the inputs in :class:`_PostBackward` (whose
backward ends the unit's backward); its post-hook reshards and hooks the outputs,
whose first gradient is the unit's pre-backward. The first state to run forward
becomes the root: it names its tree's units, creates their one
:class:`~fsdp_compose._scheduler.Scheduler`, and queues each backward's finalize
(every reduction completes before ``backward()`` returns).
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.utils import _apply_to_tensors

from . import _compat, _shared
from ._events import Events, UnitInfo
from ._policies import MixedPrecisionPolicy
from ._scheduler import Scheduler, ScheduleSettings
from ._unit import ShardState, TrainingState, Unit

_STATE_ATTR = "_fsdp_compose_state"


def state_of(module: nn.Module) -> UnitState | None:
    """The fully_shard state attached to ``module``, if any."""
    return module.__dict__.get(_STATE_ATTR)


def _states(module: nn.Module) -> list[UnitState]:
    return [s for s in map(state_of, module.modules()) if s is not None]


def unit_infos(module: nn.Module) -> list[UnitInfo]:
    """What the tools may know of the units in ``module``'s tree: their values."""
    return [unit.info for state in _states(module) for unit in state.own_units]


def invalidate_unsharded(module: nn.Module) -> None:
    """The front door's one invalidation entry point: after the sharded parameters of
    ``module``'s tree were written outside the runtime (a weights load), every unit
    reshards and re-derives its buffers from them at its next use."""
    for state in _states(module):
        for unit in state.own_units + state.borrowed:
            state.reshard(unit)
            unit.invalidate()


# [Note: containers of inputs and outputs]
# Casting inputs and outputs, and moving inputs to the accelerator, go through the
# containers torch's _apply_to_tensors (FSDP2's own) rebuilds: dataclasses, dicts,
# named tuples, lists, tuples, sets. The pre-backward hooks go on the outputs that
# require grad inside tensors, named tuples, dataclasses, dicts, lists and tuples, as
# FSDP2 finds them, and so do the post-backward markers on the inputs (rebuilt around
# them). (A pytree traversal would miss dataclass activations: the next unit's
# backward would then run without its parameters.)
def _cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return tree
    return _apply_to_tensors(lambda x: x.to(dtype) if x.is_floating_point() else x, tree)


def _grad_tensors(tree: Any, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """Appends to ``found`` the tensors in ``tree`` that require grad (see the note)."""
    if isinstance(tree, torch.Tensor):
        if tree.requires_grad:
            found.append(tree)
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for field in dataclasses.fields(tree):
            _grad_tensors(getattr(tree, field.name), found)
    elif isinstance(tree, (list, tuple, dict)):
        for item in tree.values() if isinstance(tree, dict) else tree:
            _grad_tensors(item, found)
    return found


def _replace_grad_tensors(tree: Any, new: Iterator[torch.Tensor]) -> Any:
    """``tree`` with the tensors :func:`_grad_tensors` finds replaced, in its order, by
    the next of ``new``; a container is rebuilt only where something in it changed."""
    if isinstance(tree, torch.Tensor):
        return next(new) if tree.requires_grad else tree
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        changed = {}
        for field in dataclasses.fields(tree):
            old = getattr(tree, field.name)
            if (value := _replace_grad_tensors(old, new)) is not old:
                changed[field.name] = value
        return dataclasses.replace(tree, **changed) if changed else tree
    if isinstance(tree, (list, tuple, dict)):
        old_items = list(tree.values() if isinstance(tree, dict) else tree)
        items = [_replace_grad_tensors(item, new) for item in old_items]
        if all(a is b for a, b in zip(items, old_items)):
            return tree
        if isinstance(tree, dict):
            return type(tree)(zip(tree.keys(), items))
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return tree


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs whose backward marks the end of the
    unit's backward (input gradients computed: parameter gradients too)."""

    @staticmethod
    def forward(ctx: Any, state: UnitState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.state.post_backward()
        return (None, *grads)


class _PreBackward(torch.autograd.Function):
    """Identity on an output that, inside a torch.func transform, says it needs no
    gradient though the autograd outside the transform runs through it (the primal
    output of ``jvp``): its backward runs the state's pre-backward, as FSDP2's
    ``RegisterPreBackwardFunction`` does, so the units are gathered again."""

    generate_vmap_rule = True

    @staticmethod
    def forward(state: UnitState, output: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return output

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.state = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # type: ignore[override]
        ctx.state._pre_backward(grad)
        return None, grad

    @staticmethod
    def jvp(ctx: Any, _: Any, tangent: torch.Tensor | None) -> Any:  # type: ignore[override]
        # (the tangent keeps the mark, so that its backward gathers the units too)
        return None if tangent is None else _PreBackward.apply(ctx.state, tangent)


class UnitState:
    """Runtime state of one fully_shard call on ``modules``: its ``units`` (one per
    data-parallel mesh, none if it manages no parameters), ``mp_policy`` (casts), and
    ``auto_reshard_after_forward`` (the call's value was None: a root keeps its
    parameters). A compiled forward graph-breaks around its hooks."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        units: list[Unit],
        mp_policy: MixedPrecisionPolicy,
        auto_reshard_after_forward: bool,
        events: Events,
    ) -> None:
        self.modules = modules
        self.own_units = units  # one per data-parallel mesh: [Note: per-parameter meshes]
        self.unit = units[0] if units else None
        self.mp_policy = mp_policy
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.is_root: bool | None = None
        self.scheduler: Scheduler | None = None
        self.root_state: UnitState | None = None
        self.all_states: list[UnitState] = []  # root only: every state in its tree
        # One object per tree (adopt_subtree_settings), with the tree's event list.
        self.settings = ScheduleSettings(events=events)
        # Explicit prefetch lists of a call without parameters (else in unit.options).
        self.forward_prefetch: tuple[Unit, ...] = ()
        self.backward_prefetch: tuple[Unit, ...] = ()
        # Units whose parameters this call's modules share ([Note: shared parameters]).
        self.borrowed: list[Unit] = []
        self.name = type(modules[0]).__name__  # the module's FQN once the root knows it
        # Not a step state (that is the scheduler's): whether this state's pre-forward
        # opened the root's FORWARD step, so that its post-forward closes it. The first
        # fully_shard module to run forward does (the root, or a submodule run alone).
        self._began_forward = False
        self._pending_modules: set[nn.Module] = set()  # grouped units: not yet run this pass
        # Re-entrancy guards, not step states: forwards inside a method registered with
        # register_fsdp_forward_method neither gather nor free (the method's call did).
        self._in_registered_method = False
        self._nested_forwards = 0
        self._cast_inputs_to = mp_policy.param_dtype if mp_policy.cast_forward_inputs else None
        for module in modules:
            module.__dict__[_STATE_ATTR] = self
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward)

    def adopt_subtree_settings(self) -> None:
        """Makes this state's :class:`ScheduleSettings` those of the ``fully_shard``
        modules below it (adopting what was set on theirs): one per tree."""
        for module in self.modules:
            for sub in module.modules():
                state = state_of(sub)
                if state is not None and state.settings is not self.settings:
                    self.settings.adopt(state.settings)
                    state.attach(self.settings)

    def attach(self, settings: ScheduleSettings) -> None:
        """Joins the tree whose settings (and event list) are ``settings``: called by
        the state of an enclosing ``fully_shard`` call, or the root at lazy init."""
        assert self.scheduler is None or self.scheduler.training_state is TrainingState.IDLE, (
            f"{self.name!r} joins another tree in the middle of a step"
        )
        self.settings = settings
        for unit in self.own_units:
            unit.attach(settings.events)

    def set_reshard_after_forward(self, value: bool) -> None:
        """``FSDPModule.set_reshard_after_forward`` on this call's units: the user's
        value replaces the root's automatic ``False`` too."""
        self.auto_reshard_after_forward = False
        for unit in self.own_units:
            if unit.state is ShardState.PARTIALLY_SHARDED:
                self.reshard(unit)  # (a unit changes its setting only while resharded)
            unit.set_reshard_after_forward(value)

    def set_prefetch(self, which: str, units: tuple[Unit, ...]) -> None:
        """Sets the explicit prefetch list ``which`` ("forward_prefetch" or
        "backward_prefetch") of a call without parameters of its own."""
        setattr(self, which, units)

    def join_root(self, root: UnitState, scheduler: Scheduler, name: str) -> None:
        """Becomes part of ``root``'s tree (``name``: the module's FQN), driven by its
        ``scheduler``: the explicit wiring step of the root's lazy init."""
        assert self.is_root is None or self is root, f"{name!r} already belongs to a root"
        self.is_root = self is root
        self.scheduler, self.root_state, self.name = scheduler, root, name

    def reshard(self, unit: Unit) -> None:
        """Reshards ``unit`` through the scheduler (none before the first forward)."""
        if self.scheduler is not None:
            self.scheduler.memory.reshard(unit)
        else:
            unit.reshard()

    def reshard_if_between_steps(self, unit: Unit) -> None:
        """Reshards ``unit`` as :meth:`reshard` if called on the thread that runs the
        root's steps while none is in progress; elsewhere does nothing."""
        scheduler = self.scheduler
        if scheduler is None or (
            scheduler.thread == threading.get_ident()
            and scheduler.training_state is TrainingState.IDLE
        ):
            self.reshard(unit)

    # -- lazy init and root detection ------------------------------------

    def lazy_init(self) -> None:
        if self.is_root is not None:
            return
        if len(self.modules) > 1:
            raise RuntimeError(
                "a fully_shard([...]) group of several modules cannot be the root. Call "
                "fully_shard on their common parent too, and run forward through it."
            )
        root_module = self.modules[0]
        named: dict[UnitState, str] = {}  # the tree's states (module pre-order), by FQN
        for name, module in root_module.named_modules():
            state = state_of(module)
            if state is None or state in named:
                if state is not None and name:
                    for unit in state.own_units:
                        unit.name += f", {name}"  # a grouped unit's further modules
                continue
            if state is not self and state.is_root is not None:
                raise RuntimeError(
                    f"fully_shard module {name!r} already ran forward on its own (as a "
                    f"root) before its parent {type(root_module).__name__}. Run the first "
                    "forward through the outermost fully_shard module."
                )
            named[state] = name or _compat.ROOT_NAME
            for i, unit in enumerate(state.own_units):
                # A further mesh's unit is named after its mesh (the same on every rank).
                dims = unit.mesh_info.mesh.mesh_dim_names
                mesh = ",".join(dims) if dims else f"mesh of {unit.mesh_info.shard_size}"
                unit.name = (name or _compat.ROOT_NAME) + (f" [{mesh}]" if i else "")
        states = list(named)
        names = {id(p): name for name, p in root_module.named_parameters()}  # first name of each
        units = [unit for state in states for unit in state.own_units]
        for p in (p for unit in units for p in unit.params):
            p.fqn = names.get(id(p.sharded_param)) or names.get(id(p.unsharded_param), p.fqn)
        if self.auto_reshard_after_forward:
            for unit in self.own_units:
                unit.set_reshard_after_forward(False)
        # States annotated after this one (top-down) join its settings now.
        self.adopt_subtree_settings()
        shared = _shared.count_uses(units, states, root_module)
        scheduler = Scheduler(units, self.settings, shared)
        for state, name in named.items():
            state.join_root(self, scheduler, name)
        self.all_states = states
        for unit in units:
            unit.lazy_init()
        # Names and FQNs are final: the units' descriptions for observers are rebuilt.
        self.settings.events.root_init([unit.describe() for unit in units])

    def reset_iter_state(self) -> None:
        """Returns every unit of this root's tree to a clean sharded, idle state
        after an exception inside forward or backward (``FSDPModule.reset_iter_state``)."""
        if self.is_root is False:
            raise RuntimeError(
                "reset_iter_state() must be called on the root fully_shard module (the first "
                "forward's)."
            )
        if self.scheduler is None:
            return
        self.scheduler.reset()
        for state in self.all_states:
            state._pending_modules.clear()
            state._began_forward = False
            state._nested_forwards = 0

    # -- forward ---------------------------------------------------------

    @torch._disable_dynamo
    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self._in_registered_method:
            self._nested_forwards += 1
            return self._cast_inputs(args, kwargs)
        self.lazy_init()
        scheduler, unit = self.scheduler, self.unit
        assert scheduler is not None
        with _compat.profiler_label("pre_forward", self.name):
            if _compat.inside_backward():
                # Activation checkpointing recomputes this forward inside backward: the
                # parameters must be present, but this is not a new forward pass.
                for used in [*self.own_units, *self.borrowed]:
                    scheduler.memory.require(used)
                args, kwargs = self._cast_inputs(args, kwargs)
                # A unit recomputed where no pre-backward of it precedes, as by reentrant
                # checkpointing (whose first forward ran without grad, hooking nothing;
                # for a grouped unit, again for each module), is hooked as in a forward,
                # as by FSDP2: its backward inside the checkpoint's then reduces and
                # reshards it there, not at the end of backward. (It stays gathered from
                # the recomputation to that backward.) A unit whose pre-backward has run
                # (a non-reentrant checkpoint recomputes after it) is not.
                unit = self.unit
                if (
                    unit is None
                    or self.borrowed
                    or unit.training_state is TrainingState.PRE_BACKWARD
                ):
                    return args, kwargs
                for own in self.own_units:
                    own.enter(TrainingState.FORWARD)
                return self._register_post_backward(args, kwargs)
            if self._began_forward:
                raise RuntimeError(
                    f"fsdp_compose: the previous forward of {type(module).__name__} did not "
                    "finish (an exception inside forward?). Call reset_iter_state() on the root "
                    "module after catching the exception."
                )
            if scheduler.training_state is not TrainingState.FORWARD:
                with _compat.profiler_label("root_pre_forward"):
                    scheduler.begin_forward(self.is_root is not False)  # (may refuse)
                    self._began_forward = True
                    # Inputs follow the parameters to their accelerator.
                    units = (s.unit for s in (self, *self.all_states) if s.unit is not None)
                    device = next((u.mesh_info.device for u in units), torch.device("cpu"))
                    if device.type != "cpu":
                        to_device = lambda x: x.to(device, non_blocking=True)  # noqa: E731
                        args, kwargs = _apply_to_tensors(to_device, (args, kwargs))
            args, kwargs = self._cast_inputs(args, kwargs)
            if unit is None and not self.borrowed:
                if self.forward_prefetch:
                    scheduler.prefetch(self.forward_prefetch)
                return args, kwargs
            if len(self.modules) > 1:
                if self._pending_modules:  # another module of the group already gathered
                    return args, kwargs
                self._pending_modules = set(self.modules)
            if self.borrowed:
                scheduler.borrow_forward(self.borrowed)
            if unit is not None:
                scheduler.pre_forward(*self.own_units)
            elif self.forward_prefetch:
                scheduler.prefetch(self.forward_prefetch)
            if torch.is_grad_enabled():
                args, kwargs = self._register_post_backward(args, kwargs)
            return args, kwargs

    @torch._disable_dynamo
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self._nested_forwards:
            self._nested_forwards -= 1
            return self._cast_output(output)
        scheduler = self.scheduler
        assert scheduler is not None
        with _compat.profiler_label("post_forward", self.name):
            if _compat.inside_backward():
                if self.unit is not None and self.unit.training_state is TrainingState.FORWARD:
                    for own in self.own_units:  # (recomputed before its backward: hooked)
                        own.enter(TrainingState.IDLE)
                    output = self._register_pre_backward(output)
                return self._cast_output(output)
            self._pending_modules.discard(module)
            if not self._pending_modules:  # (grouped units: every module of the group ran)
                # (grouped units: the hook goes on the output of the group's last module;
                # as in FSDP2, a state without parameters hooks its output too: a root's
                # hook queues the end of backward on the outermost backward)
                output = self._register_pre_backward(output)
                for own in self.own_units:
                    scheduler.post_forward(own)
                if self.borrowed:
                    scheduler.return_forward(self.borrowed)
            if self._began_forward:
                self._began_forward = False
                output = self._complete_partial_groups(scheduler, output)
                scheduler.end_forward()
            return self._cast_output(output)

    def _complete_partial_groups(self, scheduler: Scheduler, output: Any) -> Any:
        """Ends the forward of the grouped units whose modules did not all run in the
        forward this state began, as FSDP2 does: each ends here (resharded as after a
        forward), with its pre-backward hook on this forward's output; but a group
        that began this forward itself (one of its modules run on its own, as a
        chunked loss runs the head) stays gathered through its backward."""
        for state in (self.root_state or self).all_states:
            if state._pending_modules and state.unit is not None:
                state._pending_modules.clear()
                if state is self:
                    for unit in state.own_units:
                        scheduler.keep_gathered(unit)
                    continue
                output = state._register_pre_backward(output)
                for unit in state.own_units:
                    scheduler.post_forward(unit)
        return output

    def run_registered_method(
        self,
        module: nn.Module,
        method: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Runs ``method`` (registered with ``register_fsdp_forward_method``) as one
        forward of ``module``: gathered once before, freed once after, however many
        times it calls the module's ``forward`` in between."""
        if self._in_registered_method:  # the method calls itself (or another registered one)
            return method(*args, **kwargs)
        args, kwargs = self._pre_forward(module, args, kwargs)
        self._in_registered_method = True
        try:
            output = method(*args, **kwargs)
        finally:
            self._in_registered_method = False
            self._nested_forwards = 0
        return self._post_forward(module, args, output)

    def _cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return _cast_floating((args, kwargs), self._cast_inputs_to)

    def _cast_output(self, output: Any) -> Any:
        return _cast_floating(output, self.mp_policy.output_dtype)

    # -- backward --------------------------------------------------------

    def _register_post_backward(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        # Positional tensors only (common): no walk through containers, this hook's main cost.
        fast = not kwargs and all(isinstance(a, torch.Tensor) for a in args)
        inputs = [a for a in args if a.requires_grad] if fast else _grad_tensors((args, kwargs), [])
        if not inputs:
            return args, kwargs  # finalize_backward runs this unit's post-backward
        marked = iter(_PostBackward.apply(self, *inputs))
        if fast:
            return tuple(next(marked) if a.requires_grad else a for a in args), kwargs
        return _replace_grad_tensors((args, kwargs), marked)

    def _register_pre_backward(self, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output
        for tensor in _grad_tensors(output, []):
            if tensor._base is not None:  # as FSDP2 warns
                names = ", ".join(type(m).__name__ for m in self.modules)
                warnings.warn(
                    f"fully_shard module ({names}) returned a view tensor: an in-place op on "
                    "it (x += y) drops its pre-backward hook (backward may fail or give wrong "
                    "gradients); use out-of-place ops (out = out + y) or .clone() it first.",
                    UserWarning,
                    stacklevel=2,
                )
            tensor.register_hook(self._pre_backward)
        if torch._C._are_functorch_transforms_active():  # see _PreBackward
            return _apply_to_tensors(self._mark_for_pre_backward, output)
        return output

    def _mark_for_pre_backward(self, t: torch.Tensor) -> torch.Tensor:
        unmarked = not t.requires_grad and (t.is_floating_point() or t.is_complex())
        return _PreBackward.apply(self, t) if unmarked else t

    @torch._disable_dynamo
    def _pre_backward(self, grad: torch.Tensor) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        with _compat.profiler_label("pre_backward", self.name):
            self._begin_backward(pre_backward=True)
            if self.unit is not None:
                scheduler.pre_backward(*self.own_units)
            elif self.backward_prefetch:
                scheduler.prefetch(self.backward_prefetch)
            if self.borrowed:
                scheduler.borrow_backward(self.borrowed)

    @torch._disable_dynamo
    def post_backward(self) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        # (usually after a pre-backward; else this is the first hook of the backward)
        self._begin_backward(pre_backward=False)
        if self.unit is not None:
            scheduler.post_backward(*self.own_units)  # (a span per unit: Scheduler)
        if self.borrowed:
            scheduler.return_backward(self.borrowed)

    def _begin_backward(self, *, pre_backward: bool) -> None:
        # The first hook of a backward pass queues its end: every reduction completes
        # before backward() returns, as in FSDP2 ([Note: backward without a pre-backward
        # hook] in _scheduler.py).
        assert self.scheduler is not None
        if self.scheduler.begin_backward(pre_backward=pre_backward):
            _compat.queue_end_of_backward_callback(self._finalize_backward)

    @torch._disable_dynamo
    def _finalize_backward(self) -> None:
        assert self.scheduler is not None
        with _compat.profiler_label("root_post_backward_callback"):
            self.scheduler.finalize_backward()

    def units_in_subtree(self, recurse: bool) -> list[Unit]:
        """This state's unit, and with ``recurse`` those of every state below it."""
        if not recurse:
            return list(self.own_units)
        states = [state_of(sub) for module in self.modules for sub in module.modules()]
        return [unit for s in dict.fromkeys(states) if s is not None for unit in s.own_units]
