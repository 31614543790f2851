"""``tokengate install``: put tokengate in a Debian host's places, or under a prefix.

What goes where (every path below ``--prefix``; ``/`` on a host)::

    /usr/share/tokengate/lua/tokengate/**.lua   the edge's Lua modules (mirrored)
    /usr/share/tokengate/nginx/*.in             the nginx templates (tokengate.tools.nginx_conf)
    /etc/nginx/conf.d/tokengate.conf            the drop-in, http level  } rendered for the
    /etc/nginx/snippets/tokengate-location.conf the server-level snippet } prefix and config
    /etc/tokengate/tokengate.yaml               the configuration: written once
                                                (``--config``, else made for the host from
                                                systemd/tokengate.host.yaml.in); a run
                                                again only adds the settings this release
                                                needs that it lacks (``NEEDED``)
    /etc/tokengate/edge.json                    compiled from it on every run
    /etc/tokengate/vllm/example.env             a vLLM replica's settings (tokengate-vllm@PORT)
    /etc/systemd/system/tokengate-counter.service, tokengate-ledger.service,
        tokengate-limits.service, tokengate-console.service, tokengate-batch.service,
        tokengate-vllm@.service,
        tokengate-console-apply.path and .service (root: the key changes the
        operator console queued)
                                                (not the vLLM unit nor example.env with
                                                --no-vllm-unit: the host runs its vLLM)
    /etc/systemd/system/nginx.service.d/tokengate.conf   removes a stale hop socket
    /etc/tmpfiles.d/tokengate.conf              /run/tokengate at every boot
    /var/lib/tokengate/usage/                   usage events: nginx writes, the ledger reads
    /var/lib/tokengate/engine/                  the vLLM plugin's records, one file per replica
    /var/lib/tokengate/console/                 the console's queued key changes
                                                (ledger.console.changes_dir)
    /var/log/tokengate/                         the sampled access log
    /run/tokengate/                             the sidecars' and the hop server's sockets

Owners: the services run as the system user ``tokengate`` (created at ``--prefix /``)
with nginx's workers' group ``www-data``. /run/tokengate is ``tokengate:www-data`` 0750
(only nginx's workers and the units enter it); /var/lib/tokengate/usage and
/var/log/tokengate are ``root:www-data`` 0750 (nginx's root master creates the files, its
workers reopen them, the ledger reads: no tokengate process can alter a usage record);
tokengate.yaml and edge.json are ``root:www-data`` 0640 (the config may hold a Redis
password). Under a prefix where the user ``tokengate`` does not exist, root stands in
for it.

The units name their paths with systemd specifiers (%E = /etc, %t = /run), so they are
the same for every prefix; install only replaces the executables' folders in them
(``/opt/tokengate/bin``: where this ``tokengate`` runs from; ``/opt/vllm/bin/python``:
``--vllm-python``). Everything else is written for the prefix as the root folder, so a
prefix is a working tree that nginx and the sidecars run from as they are (the tests do).

Without ``--config`` the configuration is made for the host, not for ``make run``:
Debian's redis-server (6379; ``--redis-url``), the edge's API on 0.0.0.0:80
(``--edge-listen``: the host's server { } that includes the snippet), the operator's
model and vLLM upstreams (``--model``, ``--model-dir``, ``--max-model-len``,
``--upstream``; asked for when missing), their engine records, and loopback ports of
their own for the status and metrics servers (946x), clear of vLLM's 8000 and the
demo's 8080-8084.

Install never starts, stops, reloads, enables or disables a service (nginx, Redis,
tokengate's own): it prints what to run next.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

from tokengate.install import plan
from tokengate.install.host import (
    HOST_EDGE_LISTEN,
    HOST_REDIS_URL,
    UNIT_VLLM_PYTHON,
    VLLM_UNIT,
    InstallError,
)

HELP = """\
Install tokengate on this host (Debian's places) or under --prefix: the systemd units,
the edge's Lua modules and nginx templates, the nginx drop-in and snippet, the
configuration (kept when it exists) and its compiled edge.json, the state folders.

Run it from a checkout (or give --source) with the `tokengate` of the virtualenv the
services will run from, made from a Python outside /home and /root (the units have
ProtectHome=yes; a pyenv Python under /root is hidden from them):

  /usr/bin/python3 -m venv /opt/tokengate && /opt/tokengate/bin/pip install ./sidecars
  sudo /opt/tokengate/bin/tokengate install --vllm-python /opt/vllm/bin/python \\
      --model qwen3-8b --model-dir /srv/models/Qwen3-8B --max-model-len 32768 \\
      --upstream 127.0.0.1:8100

The configuration it writes is made for the host (Debian's Redis on 6379 or
--redis-url, the edge on 0.0.0.0:80 or --edge-listen, the given model and upstreams,
ports clear of vLLM's and the demo's); --config FILE installs another instead. A host
that runs its vLLM itself gives --no-vllm-unit: no tokengate-vllm@.service; a run
again without --vllm-python or --no-vllm-unit keeps the first run's choice.

It never starts, stops, reloads, enables or disables a service (nginx, Redis, the
units); it prints the commands that do. Running it again updates everything but
/etc/tokengate/tokengate.yaml, and recompiles edge.json from it; to a configuration of
an earlier release it adds the settings this release needs (ledger.console.changes_dir),
comments and all else kept, or refuses, naming the file and the key.

EXIT STATUS
  0 installed (or, with --dry-run, nothing wrong found); 1 a problem, one line each
  on stderr, and nothing changed.
"""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register ``install`` on a ``tokengate`` subcommand parser."""
    p = sub.add_parser("install", help="install units, Lua, the nginx drop-in and the config",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=Path, default=Path("/"),
                   help="root folder of the install (default: /); every file is written "
                        "for it as the root")
    p.add_argument("--dry-run", action="store_true",
                   help="check and print what would be done; change nothing")
    p.add_argument("--source", type=Path, default=Path("."),
                   help="the checkout holding lua/, nginx/ and systemd/ (default: .)")
    p.add_argument("--config", type=Path, default=None,
                   help="configuration to install when <prefix>/etc/tokengate/tokengate.yaml "
                        "does not exist (default: one made for this host from --model, "
                        "--model-dir, --max-model-len and --upstream)")
    p.add_argument("--model", default=None,
                   help="without --config: the served model name (vLLM's "
                        "--served-model-name, what clients send as model)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="without --config: the model's directory, the files vLLM loads "
                        "(outside /home and /root)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="without --config: the model's context, vLLM's --max-model-len, "
                        "tokens")
    p.add_argument("--upstream", action="append", default=[], metavar="HOST:PORT",
                   help="without --config: a vLLM OpenAI server of the model (repeat for "
                        "each replica)")
    p.add_argument("--bin-dir", type=Path, default=Path(sysconfig.get_path("scripts")),
                   help="folder of tokengate-counter, -ledger, -limits, -console that the "
                        "units run (default: this tokengate's, %(default)s)")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="without --config: redis.url of the configuration made for the "
                        f"host (default: Debian's redis-server, {HOST_REDIS_URL})")
    p.add_argument("--edge-listen", default=None, metavar="HOST:PORT",
                   help="without --config: edge.listen of the configuration made for the "
                        "host, the listen of the server { } that includes the snippet "
                        f"(default: {HOST_EDGE_LISTEN})")
    vllm = p.add_mutually_exclusive_group()
    vllm.add_argument("--vllm-python", type=Path, default=None,
                      help=f"the Python of the host's vLLM, for {VLLM_UNIT} (default: this "
                           f"one when it imports vllm, else {UNIT_VLLM_PYTHON})")
    vllm.add_argument("--no-vllm-unit", action="store_true",
                      help=f"the host runs its vLLM itself: {VLLM_UNIT} and "
                           "/etc/tokengate/vllm/example.env are not written")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``tokengate install``: 0 done, 1 a problem (nothing changed)."""
    opts = plan.Options(prefix=args.prefix, source=args.source, config=args.config,
                        bin_dir=args.bin_dir,
                        vllm_python=args.vllm_python or plan.default_vllm_python(),
                        dry_run=args.dry_run, model=args.model, model_dir=args.model_dir,
                        max_model_len=args.max_model_len, upstreams=tuple(args.upstream),
                        redis_url=args.redis_url or HOST_REDIS_URL,
                        edge_listen=args.edge_listen or HOST_EDGE_LISTEN,
                        vllm_unit=(False if args.no_vllm_unit
                                   else True if args.vllm_python is not None else None))
    try:
        todo = plan.plan(opts)
    except InstallError as e:
        for line in e.problems:
            print(line, file=sys.stderr)
        print(f"tokengate install: {len(e.problems)} problem(s); nothing changed",
              file=sys.stderr)
        return 1
    todo.run()
    for note in todo.notes:
        print(f"note: {note}")
    if opts.on_host and not opts.dry_run:
        print(todo.next_steps)
    return 0
