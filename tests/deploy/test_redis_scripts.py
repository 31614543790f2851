"""tokengate.redis_scripts: the package holds the eight Lua scripts the sidecars run in Redis,
``read`` returns each file byte for byte, and the modules' constants (the names callers
and tests import) are those texts.

No process, no Redis: the scripts themselves are run by the limits and ledger tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokengate import budget_store, redis_scripts
from tokengate.ledger import alerts, ledger
from tokengate.limits import budget, window

pytestmark = pytest.mark.unit

FOLDER = Path(redis_scripts.__file__).parent

# script -> the constant that holds it
CONSTANTS = {
    "budget_reserve": budget.RESERVE_LUA,
    "budget_settle": budget_store.SETTLE_LUA,
    "budget_fix": budget_store.FIX_LUA,
    "window_reserve": window.RESERVE_LUA,
    "window_settle": window.SETTLE_LUA,
    "ledger_apply": ledger.APPLY_LUA,
    "ledger_time": ledger.TIME_LUA,
    "alert_claim": alerts.CLAIM_LUA,
}


def test_the_package_holds_exactly_the_eight_scripts():
    assert sorted(p.stem for p in FOLDER.glob("*.lua")) == sorted(CONSTANTS)


@pytest.mark.parametrize("name", sorted(CONSTANTS))
def test_read_returns_the_file_byte_for_byte(name: str):
    text = redis_scripts.read(name)
    assert text.strip() != ""
    # no newline translation or stripping: the bytes are what EVALSHA's digest is of
    assert text.encode("utf-8") == (FOLDER / f"{name}.lua").read_bytes()


@pytest.mark.parametrize("name", sorted(CONSTANTS))
def test_the_module_constant_is_the_script(name: str):
    assert CONSTANTS[name] == redis_scripts.read(name)


def test_budget_store_still_exports_the_settle_script():
    assert "SETTLE_LUA" in budget_store.__all__
    assert budget.SETTLE_LUA is budget_store.SETTLE_LUA


@pytest.mark.parametrize("name", ["../budget_store", "ledger_apply.lua", ""])
def test_a_name_that_is_not_a_file_stem_is_refused(name: str):
    with pytest.raises(ValueError, match="not a script name"):
        redis_scripts.read(name)


def test_an_unknown_script_is_not_found():
    with pytest.raises(FileNotFoundError):
        redis_scripts.read("no_such_script")
