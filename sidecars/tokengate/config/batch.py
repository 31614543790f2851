"""The ``batch`` section: the Batch API (``tokengate-batch``): where it listens and keeps
files, the key it sends lines through the edge as, its bounds and its quota."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from tokengate.config.types import (
    LoopbackHostPort,
    NonEmpty,
    OptionalPath,
    Positive,
    RelPath,
    Sha256,
    _Schema,
)


class BatchConfig(_Schema):
    """OpenAI's Batch API on spare capacity (``tokengate.batch``, the ``tokengate-batch``
    process): ``/v1/files`` and ``/v1/batches`` answered by the service behind the edge;
    every line checked and counted at creation by the edge as an online request of its
    endpoint, then sent through the edge by the service (the holder of the secret whose
    digest is ``worker_sha256``, which is no API key) acting for the batch's key, at
    ``priority``: make it the lowest of ``edge.admission.priorities``."""

    enabled: bool = Field(
        default=False,
        description="true: the edge forwards /v1/files and /v1/batches to the service "
                    "(else 404) and `make run` starts it.")
    listen: LoopbackHostPort = Field(
        default="127.0.0.1:8086",
        description="host:port of the service (HTTP, loopback: it trusts the key id the "
                    "edge forwards, so any local user could act for any key there) when "
                    "unix_socket is null.")
    unix_socket: OptionalPath = Field(
        default=None,
        description="Unix socket of the service (mode 0660, its group nginx's workers'): "
                    "it serves there only, no TCP, and the edge forwards there. Set it "
                    "wherever other local users run (the installed unit: "
                    "/run/tokengate/batch.sock).")
    edge_url: str = Field(
        default="http://127.0.0.1:8080",
        description="Where the service sends lines (the edge's API listener).")
    worker_sha256: Sha256 | None = Field(
        default=None,
        description="Hex SHA-256 digest of the secret the service sends lines with (in "
                    "worker_secret_file); the edge lets only its holder act for a batch's "
                    "key. Required when enabled.")
    worker_secret_file: RelPath = Field(
        default=Path("var/batch/worker.key"), validate_default=True,
        description="File holding that secret (one line), readable by the service only.")
    priority: NonEmpty = Field(
        default="low",
        description="The lines' admission priority: a name in edge.admission.priorities "
                    "(the lowest, so that lines run only where interactive traffic leaves "
                    "room).")
    files_dir: RelPath = Field(
        default=Path("var/batch/files"), validate_default=True,
        description="Folder of the files' bytes (inputs, outputs, errors); nothing "
                    "outside it is read or written.")
    max_file_bytes: Positive = Field(
        default=200 * 1024 * 1024,
        description="Largest upload, bytes (OpenAI: 200 MB); larger: 413.")
    max_lines: Positive = Field(
        default=50_000,
        description="Most requests in one batch's input file (OpenAI: 50,000).")
    max_line_bytes: Positive = Field(
        default=4 * 1024 * 1024,
        description="Largest line of an input file, bytes (never above the edge's "
                    "edge.max_body_bytes, which refuses the line anyway).")
    quota_tokens: Positive = Field(
        default=20_000_000,
        description="Enqueued tokens per key: the prompt tokens plus the completion limits "
                    "of its batches that have not ended; a batch that does not fit fails "
                    "with token_limit_exceeded.")
    key_quota_tokens: dict[str, Positive] = Field(
        default={},
        description="quota_tokens of single keys, by key id.")
    retention_days: Positive = Field(
        default=30,
        description="A batch that ended, its output and error files are deleted this "
                    "long after it ended, days; uploads this long after they were made.")
    max_in_flight: Positive = Field(
        default=64,
        description="Most lines the service has at the edge at once (the ramp's ceiling).")
    expiry_s: Positive = Field(
        default=86_400,
        description="completion_window in seconds (OpenAI's `24h`): a batch still "
                    "running then expires with what ran.")

    @property
    def address(self) -> str:
        """Where the service serves: ``unix:<unix_socket>``, else ``listen``
        (``host:port``)."""
        return f"unix:{self.unix_socket}" if self.unix_socket else self.listen
