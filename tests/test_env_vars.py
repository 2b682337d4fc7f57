"""Every ``FSDP_COMPOSE_*`` variable the library reads rejects a value it does not
understand, naming the variable and the accepted values, instead of silently
falling back to the default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fsdp_compose import _env

_ROOT = Path(__file__).resolve().parent.parent


def test_flag_and_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
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
    for path in sorted((_ROOT / "fsdp_compose").rglob("*.py")):
        if path.name == "_env.py":
            continue
        for line in path.read_text().splitlines():
            assert not re.search(r"os\.(environ|getenv).*FSDP_COMPOSE_", line), (
                f"{path.name} reads an FSDP_COMPOSE_ variable without validation: {line.strip()}"
            )
        names = set(re.findall(r"FSDP_COMPOSE_[A-Z_]+", path.read_text()))
        assert names <= {"FSDP_COMPOSE_DEBUG_COLLECTIVES", "FSDP_COMPOSE_DEBUG_TIMEOUT"}, (
            path.name,
            names,
        )


def test_invalid_values_read_at_use(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_compose import debug
    from fsdp_compose import _env

    monkeypatch.setenv("FSDP_COMPOSE_DEBUG_TIMEOUT", "5s")
    with pytest.raises(ValueError, match="FSDP_COMPOSE_DEBUG_TIMEOUT='5s'"):
        debug.CollectiveChecks()
    monkeypatch.setenv("FSDP_COMPOSE_DEBUG_COLLECTIVES", "yes please")
    with pytest.raises(ValueError, match="FSDP_COMPOSE_DEBUG_COLLECTIVES='yes please'"):
        _env.debug_collectives()
