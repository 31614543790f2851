"""Build hook: the gRPC stubs are generated before the package is built (build_stubs.py);
everything else about the package is in pyproject.toml."""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_stubs


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        build_stubs.generate()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
