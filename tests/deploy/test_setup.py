"""``make setup`` (scripts/setup.sh) and the check of a checkout's layered virtualenv
(scripts/check_venv.py): a checkout runs its own code and registers vLLM's plugin entry
point once, and leaves what other checkouts installed in the shared virtualenv alone."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from tokengate_dev import devstack

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit

ROOT = devstack.ROOT
CHECK = ROOT / "scripts" / "check_venv.py"


def check_with_shared(shared: Path | None) -> subprocess.CompletedProcess[str]:
    """check_venv.py as setup runs it, with ``shared`` added after this venv's
    site-packages the way tokengate-shared.pth adds the shared virtualenv's."""
    code = ("import runpy, sys\n"
            f"sys.path.append({str(shared)!r})\n" if shared is not None else "import runpy, sys\n")
    code += f"sys.argv = ['check_venv.py', {str(ROOT)!r}]\n" \
            f"runpy.run_path({str(CHECK)!r}, run_name='__main__')\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)


def shared_copy(tmp_path: Path, with_package: bool) -> Path:
    """A shared site-packages holding another checkout's tokengate-vllm: its metadata
    (entry points included), and with ``with_package`` a regular copy of the package
    (an editable install leaves the metadata only)."""
    site = tmp_path / "shared-site-packages"
    mine = Path(sysconfig.get_paths()["purelib"])
    dist = next(mine.glob("tokengate_vllm-*.dist-info"))
    shutil.copytree(dist, site / dist.name)
    if with_package:
        (site / "tokengate_vllm").mkdir()
        (site / "tokengate_vllm" / "__init__.py").write_text('"""another checkout"""\n')
    return site


def test_the_checkouts_venv_runs_its_own_code_and_one_plugin_entry_point() -> None:
    r = check_with_shared(None)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")


def test_another_checkouts_plugin_in_the_shared_venv_registers_no_second_entry_point(
        tmp_path: Path) -> None:
    # what setup no longer uninstalls: an older setup's or another checkout's install of
    # tokengate-vllm in the shared venv; this checkout's distribution is found first
    r = check_with_shared(shared_copy(tmp_path, with_package=False))
    assert (r.returncode, r.stderr) == (0, "")


def test_a_shared_copy_that_would_be_imported_instead_stops_setup_with_what_to_do(
        tmp_path: Path) -> None:
    site = shared_copy(tmp_path, with_package=True)
    r = check_with_shared(site)
    assert r.returncode == 1
    assert r.stderr.splitlines()[0] == (
        f"setup: tokengate_vllm is imported from {site}/tokengate_vllm/__init__.py, not "
        f"from {ROOT}")
    assert "it is left as it is: another checkout may use it" in r.stderr
    assert (site / "tokengate_vllm" / "__init__.py").exists()


def test_setup_changes_nothing_in_the_shared_venv_once_it_is_built() -> None:
    # after the shared venv is complete, setup only reads it: no pip run of its own, no
    # removal (one checkout's setup broke another's plugin by uninstalling it there)
    text = (ROOT / "scripts" / "setup.sh").read_text()
    after = text.split('touch "$VENV/.complete"', 1)[1]
    commands = [line.strip() for line in after.splitlines()
                if line.strip() and not line.strip().startswith("#")]
    writes = [c for c in commands if ("$VENV/bin/pip" in c or "$VENV/bin/python\" -m pip" in c
                                      or "rm -rf \"$VENV\"" in c)]
    assert writes == []
