"""The suite's own machinery: the xdist group that keeps the vLLM tests on one worker."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_vllm_group_runs_on_one_worker_under_loadgroup(tmp_path: Path) -> None:
    # what make test does (-n 2 --dist loadgroup), on tests grouped by tests.conftest's
    # xdist_group: pytest 9.2 ignores the name xdist 3.8 sets, which spread the group
    (tmp_path / "conftest.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.conftest import xdist_group\n\n"
        "def pytest_collection_modifyitems(config, items):\n"
        "    for item in items:\n"
        "        if item.name.startswith('test_grouped'):\n"
        "            xdist_group(config, item, 'vllm')\n")
    (tmp_path / "test_some.py").write_text(
        "import time\n"
        "import pytest\n\n"
        "@pytest.mark.parametrize('i', range(8))\n"
        "def test_grouped(i):\n    time.sleep(0.05)\n\n"
        "@pytest.mark.parametrize('i', range(8))\n"
        "def test_free(i):\n    time.sleep(0.05)\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2",
                        "--dist", "loadgroup", "-v", str(tmp_path)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    ran = re.findall(r"\[(gw\d)\] .*PASSED .*::test_grouped\[\d\]@vllm", r.stdout)
    assert len(ran) == 8 and len(set(ran)) == 1, r.stdout
