"""The runtime's front door: code outside ``fsdp_compose/_runtime/`` uses only what
``_runtime/__init__.py`` exports, and asks the runtime about parameters instead of
reading or writing attributes on them (see [Note: the runtime's front door])."""

from __future__ import annotations

import ast
import gc
import os
from collections.abc import Iterator

import torch
from helpers import fake_process_group
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_compose
from fsdp_compose import _runtime as runtime
from fsdp_compose import fully_shard

PACKAGE = os.path.dirname(fsdp_compose.__file__)


def _outside_modules() -> Iterator[tuple[str, ast.Module]]:
    for root, _, files in os.walk(PACKAGE):
        if os.path.relpath(root, PACKAGE).split(os.sep)[0] == "_runtime":
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    yield os.path.relpath(path, PACKAGE), ast.parse(f.read())


def _private_runtime_imports(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            parts = module.split(".")
            names = [a.name for a in node.names]
            if "_runtime" in parts and parts[-1] != "_runtime":  # _runtime._x
                found.append(ast.unparse(node))
            elif parts[-1] == "_runtime" and any(n.startswith("_") for n in names):
                found.append(ast.unparse(node))  # from ._runtime import _x
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if "_runtime._" in a.name]
    return found


def test_nothing_outside_the_runtime_imports_its_private_modules() -> None:
    offenders = {
        path: found
        for path, tree in _outside_modules()
        if (found := _private_runtime_imports(tree))
    }
    assert not offenders, offenders


def test_the_front_door_exports_what_it_lists() -> None:
    for name in runtime.__all__:
        assert hasattr(runtime, name), name
    public = set(fsdp_compose.__all__)
    # the public API's runtime names come through the front door
    for name in ("FSDPModule", "MixedPrecisionPolicy", "Observer", "UnshardHandle"):
        assert name in public and getattr(fsdp_compose, name) is getattr(runtime, name)


def _attributes(t: torch.Tensor | None) -> list[str]:
    return [] if t is None else [k for k in vars(t) if "fsdp_compose" in k]


def test_no_attribute_is_set_on_a_users_tensors_and_queries_answer() -> None:
    with fake_process_group(2, 0):
        mesh = init_device_mesh("cpu", (2,))
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8, bias=False))
        originals = list(model.parameters())
        ignored = model[0].bias
        # the call returns its own module, whatever it recorded on the way
        assert fully_shard(model[0], mesh=mesh, ignored_params={ignored}) is model[0]
        fully_shard(model[1], mesh=mesh)
        fully_shard(model, mesh=mesh)
        model(torch.randn(2, 8)).sum().backward()
        unsharded = [
            p.unsharded_param for unit in model._fsdp_state().scheduler.units for p in unit.params
        ]
        for t in [*originals, *model.parameters(), *unsharded]:
            assert not _attributes(t), _attributes(t)
            assert t is None or not _attributes(t.grad)
        weight = model[1].weight
        # the label of the call (its modules, as errors name them) and the name under the root
        assert runtime.owner_of(weight) == "Linear" and runtime.fqn_of(weight) == "1.weight"
        assert runtime.owner_of(model[0].weight) == "Linear"
        assert runtime.is_ignored(ignored) and runtime.ignored_by(ignored) == "Linear"
        assert runtime.owner_of(ignored) is None and runtime.fqn_of(ignored) is None
        assert runtime.replaced_by(originals[0]) == "Linear"
        assert runtime.owner_of(originals[0]) is None
        assert runtime.owner_of(torch.zeros(1)) is None and runtime.owner_of("x") is None


def test_records_do_not_keep_a_model_alive() -> None:
    with fake_process_group(2, 0):
        mesh = init_device_mesh("cpu", (2,))
        model = nn.Linear(8, 8)
        fully_shard(model, mesh=mesh)
        probe = torch.utils.weak.WeakIdRef(model.weight)  # type: ignore[attr-defined]
        del model
        gc.collect()
        assert probe() is None
