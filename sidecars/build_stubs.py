"""Generates the gRPC stubs of ``tokengate.v1`` from ``../proto`` (never edited by hand).

Run by the package build (``setup.py``: ``pip install ./sidecars`` from a checkout) and
by ``make setup``; regenerates a stub only when its ``.proto`` is newer. Needs
``grpcio-tools`` (a build requirement of this package). Usage: ``python build_stubs.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO_ROOT = HERE.parent / "proto"
OUT = HERE                       # stubs land in tokengate/v1/ (import path tokengate.v1)


def stale() -> list[Path]:
    """The ``.proto`` files whose ``*_pb2.py`` is missing or older."""
    out = []
    for proto in sorted((PROTO_ROOT / "tokengate" / "v1").glob("*.proto")):
        stub = OUT / "tokengate" / "v1" / f"{proto.stem}_pb2.py"
        if not stub.exists() or stub.stat().st_mtime < proto.stat().st_mtime:
            out.append(proto)
    return out


def generate() -> None:
    """Regenerate the stale stubs; a checkout without ``proto/`` (an unpacked sdist that
    carries the stubs) is left as it is. Raises ``RuntimeError`` when protoc fails."""
    if not PROTO_ROOT.is_dir():
        return
    todo = stale()
    if not todo:
        return
    from grpc_tools import protoc

    for proto in todo:
        rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={OUT}",
                          f"--pyi_out={OUT}", f"--grpc_python_out={OUT}", str(proto)])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit {rc})")


if __name__ == "__main__":
    generate()
    sys.exit(0)
