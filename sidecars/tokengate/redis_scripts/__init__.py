"""The Lua scripts the sidecars run in Redis, one ``<name>.lua`` file each, shipped as
package data:

- ``budget_reserve.lua``, ``budget_settle.lua``: a key's budgets
  (``tokengate.limits.budget``, ``tokengate.budget_store``); ``budget_fix.lua``: the
  ledger's changes of a key's settled counters to its bill (``tokengate.ledger.budgets``);
- ``window_reserve.lua``, ``window_settle.lua``: the sliding RPM/TPM windows
  (``tokengate.limits.window``);
- ``ledger_apply.lua``, ``ledger_time.lua``: a batch of the usage ledger and Redis's clock
  (``tokengate.ledger.ledger``);
- ``alert_claim.lua``: a budget alert claimed once and queued for delivery
  (``tokengate.ledger.alerts``).

The module that runs a script documents what it does and its KEYS, ARGV and reply, beside
its constant (``budget_store.SETTLE_LUA = read("budget_settle")``). A file is the script
exactly as Redis hashes it for ``EVALSHA``: a change of one byte, a newline at either end
included, is a new script to every Redis that cached the old one.
"""

from __future__ import annotations

from importlib import resources

__all__ = ["read"]


def read(name: str) -> str:
    """The text of the script ``<name>.lua`` of this package (``name`` without the
    suffix, e.g. ``"ledger_apply"``), byte for byte as stored (UTF-8, no newline
    translation).

    Raises ``ValueError`` when ``name`` is not a plain file stem (a path, a suffix) and
    ``FileNotFoundError`` when the package has no such script.
    """
    if not name.isidentifier():
        raise ValueError(f"not a script name: {name!r}")
    return resources.files(__name__).joinpath(f"{name}.lua").read_bytes().decode("utf-8")
