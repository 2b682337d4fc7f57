"""Every ``FSDP_COMPOSE_*`` variable the library reads rejects a value it does not
understand, naming the variable and the accepted values, instead of silently
falling back to the default."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_compose import _env

_ROOT = Path(__file__).resolve().parent.parent


def test_flag_choice_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, expected in [
        ("1", True),
        ("TRUE", True),
        ("on", True),
        ("0", False),
        ("no", False),
        ("", True),
    ]:
        monkeypatch.setenv("FSDP_COMPOSE_X", value)
        assert _env.flag("FSDP_COMPOSE_X", True) is expected
    monkeypatch.setenv("FSDP_COMPOSE_X", "ture")
    with pytest.raises(ValueError, match=r"FSDP_COMPOSE_X='ture' is not valid: use 1 or 0"):
        _env.flag("FSDP_COMPOSE_X", False)
    monkeypatch.setenv("FSDP_COMPOSE_X", "native")
    assert _env.choice("FSDP_COMPOSE_X", ("a", "native"), "a") == "native"
    monkeypatch.setenv("FSDP_COMPOSE_X", "Native")
    with pytest.raises(
        ValueError, match=r"'Native' is not valid: use one of a, native \(default a\)"
    ):
        _env.choice("FSDP_COMPOSE_X", ("a", "native"), "a")
    monkeypatch.delenv("FSDP_COMPOSE_X")
    assert _env.seconds("FSDP_COMPOSE_X") is None
    for bad in ("soon", "-1", "0", "nan", "inf"):
        monkeypatch.setenv("FSDP_COMPOSE_X", bad)
        with pytest.raises(ValueError, match="a positive number of seconds"):
            _env.seconds("FSDP_COMPOSE_X")
    monkeypatch.setenv("FSDP_COMPOSE_X", "2.5")
    assert _env.seconds("FSDP_COMPOSE_X") == 2.5


def test_every_variable_read_is_validated() -> None:
    """The library reads FSDP_COMPOSE_* variables only through ``_env``."""
    for path in sorted((_ROOT / "fsdp_compose").glob("*.py")):
        if path.name == "_env.py":
            continue
        for line in path.read_text().splitlines():
            assert not re.search(r"os\.(environ|getenv).*FSDP_COMPOSE_", line), (
                f"{path.name} reads an FSDP_COMPOSE_ variable without validation: {line.strip()}"
            )


_IMPORT_CHECK = """
import importlib, os, sys
for name, value in [("FSDP_COMPOSE_DEBUG_COLLECTIVES", "yes please"), ("FSDP_COMPOSE_GLOO_ALL_GATHER", "broadcasts")]:
    os.environ[name] = value
    try:
        importlib.import_module("fsdp_compose")
        print(name, "accepted")
    except ValueError as exc:
        print(exc)
    del os.environ[name]
    for module in [m for m in sys.modules if m.startswith("fsdp_compose")]:
        del sys.modules[module]
"""


def test_invalid_values_read_at_import_fail_the_import() -> None:
    """One child process (one torch import) imports fsdp_compose once per variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_COMPOSE_")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECK],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "FSDP_COMPOSE_DEBUG_COLLECTIVES='yes please' is not valid" in result.stdout, (
        result.stdout
    )
    assert "FSDP_COMPOSE_GLOO_ALL_GATHER='broadcasts' is not valid" in result.stdout, result.stdout


def test_invalid_values_read_at_use(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_compose import _gloo, _optim, debug

    monkeypatch.setenv("FSDP_COMPOSE_LOCAL_OPTIMIZER_STEP", "of")
    with pytest.raises(ValueError, match="FSDP_COMPOSE_LOCAL_OPTIMIZER_STEP='of'"):
        _optim.enabled()
    monkeypatch.setenv("FSDP_COMPOSE_GLOO_REDUCE_SCATTER", "alltoall")
    with pytest.raises(ValueError, match="use one of exchange, all_to_all, native"):
        _gloo._exchanges_reduce_scatter()
    monkeypatch.setenv("FSDP_COMPOSE_DEBUG_TIMEOUT", "5s")
    with pytest.raises(ValueError, match="FSDP_COMPOSE_DEBUG_TIMEOUT='5s'"):
        debug.enable_collective_checks()
    assert not debug.collective_checks_enabled()
