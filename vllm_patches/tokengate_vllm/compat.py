"""Which vLLM the plugin runs in, and whether it may act there.

The plugin reads vLLM internals that vLLM does not promise to keep (``StatLoggerBase``
says so about ``IterationStats``; the scheduler's waiting queue and the frontend's
``OutputProcessor`` are not public at all), so it acts only on the releases it was
tested with, ``TESTED`` (``major.minor``, any patch level). Elsewhere it logs one
warning per part and stays inactive: vLLM then runs exactly as without the plugin.
``TOKENGATE_VLLM_ENABLE`` (``auto`` default; ``1`` forces it on, ``0`` turns it off)
overrides that.
"""

from __future__ import annotations

import logging
import os
import re
from functools import cache

# A child of vLLM's "vllm" logger: printed by vLLM's handler, in vLLM's format.
log = logging.getLogger("vllm.tokengate")

TESTED: tuple[tuple[int, int], ...] = ((0, 32),)
ENABLE_ENV = "TOKENGATE_VLLM_ENABLE"

_VERSION = re.compile(r"(\d+)\.(\d+)")


def vllm_version() -> str | None:
    """The running vLLM's version string (``vllm.__version__``, e.g. ``"0.32.0"``), or
    None when vLLM is not importable."""
    try:
        from vllm import __version__
    except ImportError:
        return None
    return str(__version__)


def parse_version(version: str | None) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string such as ``0.32.0``, ``0.32.1rc2+cpu``,
    ``0.33.0.dev12+g1234``; None when it does not start with two numbers."""
    m = _VERSION.match(version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def decide(version: str | None, setting: str | None) -> tuple[bool, bool, str]:
    """Whether the plugin acts on vLLM ``version`` given ``TOKENGATE_VLLM_ENABLE``
    (``setting``: None, ``auto``, ``1``/``on``/``true``, ``0``/``off``/``false``), whether
    that deserves a warning (inactive on an untested version, forced on one), and why
    (one sentence for the log)."""
    s = (setting or "auto").strip().lower()
    tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED)
    ok = parse_version(version) in TESTED
    if s in ("0", "off", "false", "no"):
        return False, False, f"tokengate plugin off ({ENABLE_ENV}={setting})"
    if s in ("1", "on", "true", "yes"):
        return True, not ok, (f"tokengate plugin forced on ({ENABLE_ENV}={setting}) in vLLM "
                              f"{version}" + ("" if ok else ", a version it was not tested "
                                              f"with (tested: {tested})"))
    if s != "auto":
        log.warning("%s=%r is not one of auto, 1, 0: using auto", ENABLE_ENV, setting)
    if ok:
        return True, False, f"tokengate plugin active in vLLM {version}"
    return False, True, (f"tokengate plugin inactive: vLLM {version} is not a version it "
                         f"was tested with ({tested}); {ENABLE_ENV}=1 forces it on")


@cache
def active(part: str) -> bool:
    """Whether ``part`` (``"engine usage records"``, ``"token-weighted scheduler"``) acts
    in this process; logs the decision once per part and process (a warning when the
    plugin stays inactive or is forced on an untested version)."""
    on, warn, why = decide(vllm_version(), os.environ.get(ENABLE_ENV))
    log.log(logging.WARNING if warn else logging.INFO, "%s: %s", part, why)
    return on
