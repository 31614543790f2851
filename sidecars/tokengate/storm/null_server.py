"""The fast upstream as a context manager (null server, bench, tests).

``FastUpstream`` starts ``devstack.fast_upstream_service`` (nginx + ``vllm_like.lua``,
the same command ``tokenstorm upstream`` runs) on a free loopback port and stops it on
exit. With ``ttft_ms = itl_ms = 0`` it is the *null server* TokenStorm measures its
own ceiling against: it does almost no work per request.
"""

from __future__ import annotations

import socket
from types import TracebackType
from typing import Self

from tokengate_dev import devstack

from tokengate.storm import upstream


def free_port() -> int:
    """A free TCP port on loopback (ephemeral range)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FastUpstream:
    """``with FastUpstream(opts) as up: up.url`` runs the fast upstream meanwhile."""

    def __init__(self, opts: upstream.UpstreamOptions | None = None, port: int | None = None,
                 name: str = "fast-upstream") -> None:
        self.opts = opts or upstream.UpstreamOptions()
        self.port = port or free_port()
        o = self.opts
        self.service = devstack.fast_upstream_service(
            self.port, model=o.model, max_model_len=o.max_model_len, ttft_ms=o.ttft_ms,
            itl_ms=o.itl_ms, workers=o.workers, name=f"{name}-{self.port}")

    @property
    def url(self) -> str:
        """Base URL (…/v1)."""
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> Self:
        """Start and wait for ``/health``; raises ``devstack.ServiceError``."""
        self.service.start()
        return self

    def stop(self) -> None:
        self.service.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
