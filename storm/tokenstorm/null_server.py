"""The fast upstream as a context manager (null server, bench, tests).

``FastUpstream`` starts nginx + ``vllm_like.lua`` (the same command ``tokenstorm
upstream`` runs) on a free loopback port and stops it on exit. With
``ttft_ms = itl_ms = 0`` it is the *null server* TokenStorm measures its own ceiling
against: it does almost no work per request.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Self

from tokenstorm import upstream
from tokenstorm.process import Service, free_port, http_ready

__all__ = ["FastUpstream", "LocalServer", "free_port", "upstream_service"]


def upstream_service(opts: upstream.UpstreamOptions, port: int, state_dir: Path,
                     name: str = "fast-upstream", host: str = "127.0.0.1") -> Service:
    """The fast upstream on host:port as a ``Service``: its nginx configuration
    rendered into ``<state_dir>/run/<name>``, its log ``<state_dir>/log/<name>.log``;
    ready when ``/health`` answers."""
    conf = upstream.render(opts, state_dir / "run" / name, port, host)
    return Service(name, upstream.argv(conf), http_ready(f"http://{host}:{port}/health"),
                   start_timeout_s=20.0, log_dir=state_dir / "log")


class LocalServer:
    """A TokenStorm server process on a loopback port as a context manager
    (``with server: server.url``): the subclass builds ``service`` in ``state_dir``;
    ``start`` starts it and waits until it is ready, ``stop`` stops it and removes
    ``state_dir`` when it was a fresh temporary folder (none given)."""

    service: Service

    def __init__(self, port: int | None, state_dir: Path | None, host: str,
                 temp_prefix: str) -> None:
        self.port = port or free_port()
        self.host = host
        self._temp: Path | None = None
        if state_dir is None:
            state_dir = self._temp = Path(tempfile.mkdtemp(prefix=temp_prefix))
        self.state_dir = state_dir

    @property
    def url(self) -> str:
        """Base URL (…/v1)."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def address(self) -> str:
        """host:port, as a model's ``upstreams`` names it."""
        return f"{self.host}:{self.port}"

    def start(self) -> Self:
        """Start and wait until ready; raises ``tokenstorm.process.ServiceError``."""
        try:
            self.service.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.service.stop()
        if self._temp is not None:
            shutil.rmtree(self._temp, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class FastUpstream(LocalServer):
    """``with FastUpstream(opts) as up: up.url`` runs the fast upstream meanwhile.

    ``state_dir`` receives its rendered configuration and log; by default a fresh
    temporary folder, removed by ``stop``.
    """

    def __init__(self, opts: upstream.UpstreamOptions | None = None, port: int | None = None,
                 name: str = "fast-upstream", state_dir: Path | None = None,
                 host: str = "127.0.0.1") -> None:
        self.opts = opts or upstream.UpstreamOptions()
        super().__init__(port, state_dir, host, "tokenstorm-")
        self.service = upstream_service(self.opts, self.port, self.state_dir,
                                        name=f"{name}-{self.port}", host=host)
