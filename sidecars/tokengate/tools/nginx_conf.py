"""Render the nginx edge's configuration from the templates of the ``nginx/`` folder.

The templates and the edge's Lua modules are found where they are told to be (an
install puts them under ``/usr/share/tokengate/``, the defaults here; the development
stack passes the checkout's ``nginx/`` and ``lua/``): nothing is looked up relative to
this file.

Two outputs:

* an **instance**: a complete, runnable nginx configuration in one folder (the prefix):
  ``nginx.conf`` (from ``<templates>/nginx.conf.in``), ``tokengate-http.conf`` (from
  ``<templates>/tokengate-http.conf.in``), ``edge.json`` (the compiled tokengate.yaml, see
  ``tokengate.tools.compile_config``), the hop socket, pid file and temporary files.
  ``make run`` and the tests start such instances (``tokengate_dev.devstack.nginx_service``).
* the **Debian drop-in**: ``nginx/debian/tokengate.conf``, the http-level part with
  Debian paths, and ``nginx/debian/tokengate-location.conf``, the server-level snippet,
  for an existing nginx: what an operator installs.

Both outputs render the server-level snippet from ``tokengate-location.conf.in`` with the
usage file's and the sampled access log's literal paths: nginx then keeps the files open
(no open per line), and rotation is a rename plus ``nginx -s reopen``.

Usage::

    python -m tokengate.tools.nginx_conf instance --templates nginx --lua-dir lua \
        --prefix var/run/nginx --listen 127.0.0.1:8080
    python -m tokengate.tools.nginx_conf debian --templates nginx
        # rewrites nginx/debian/tokengate.conf and nginx/debian/tokengate-location.conf
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tokengate import config as tg_config
from tokengate.tools import compile_config

# Where an install puts the templates (the checkout's nginx/) and the Lua modules.
SHARE_DIR = Path("/usr/share/tokengate")

# Where the Debian drop-in expects things (the steps are in the drop-in's header; the
# systemd units of systemd/ and `tokengate install` use the same places).
DEBIAN_PATHS: dict[str, Path] = {
    "lua_dir": SHARE_DIR / "lua",
    "edge_json": Path("/etc/tokengate/edge.json"),
    "counter_socket": Path("/run/tokengate/counter.sock"),
    "limits_socket": Path("/run/tokengate/limits.sock"),
    # nginx chmods its unix listen sockets to 0666 itself, so what keeps other local users
    # from the hop (Settle, Reserve) is the folder: /run/tokengate is 0750, group
    # www-data (systemd/tokengate.tmpfiles). The root master binds there; the www-data
    # workers connect through the group. Loopback TCP would admit every local user.
    "hop_socket": Path("/run/tokengate/hop.sock"),
    # ledger.usage_file and access_log.file of /etc/tokengate/tokengate.yaml
    "usage_file": Path("/var/lib/tokengate/usage/usage.jsonl"),
    "access_log": Path("/var/log/tokengate/access.sampled.log"),
}


def debian_paths(root: Path = Path("/")) -> dict[str, Path]:
    """``DEBIAN_PATHS`` under another root folder (an install prefix): every path moved
    below ``root``; ``/`` gives them as they are."""
    return {k: root / v.relative_to("/") for k, v in DEBIAN_PATHS.items()}


def _fill(template: str, values: dict[str, str]) -> str:
    out = template
    for name, value in values.items():
        out = out.replace(f"@{name}@", value)
    left = re.search(r"@[A-Z_]+@", out)
    if left:
        raise ValueError(f"template placeholder {left.group(0)} has no value")
    return out


def counter_sockets(counter_socket: Path, workers: int) -> list[Path]:
    """The counter's per-worker sockets: ``PATH.0 .. PATH.<workers-1>``."""
    return [counter_socket.with_name(f"{counter_socket.name}.{i}") for i in range(workers)]


def limits_servers(unix_socket: Path | None, workers: int, listen: str) -> list[str]:
    """The global-limit sidecar's addresses for nginx's upstream: ``unix:<path>.<i>`` per
    worker when it serves a unix socket, else its TCP ``listen`` address."""
    if unix_socket is None:
        return [listen]
    return [f"unix:{s}" for s in counter_sockets(unix_socket, workers)]


def debian_conf(templates: Path) -> Path:
    """Where the committed Debian drop-in (http level) lives among the templates."""
    return templates / "debian" / "tokengate.conf"


def debian_location_conf(templates: Path) -> Path:
    """Where the committed Debian server-level snippet lives among the templates."""
    return templates / "debian" / "tokengate-location.conf"


def render_location(templates: Path, usage_file: Path, access_log: Path | None,
                    client_body_timeout_s: int) -> str:
    """The server-level snippet (``<templates>/tokengate-location.conf.in``): the usage
    events go to ``usage_file``, the sampled access log to ``access_log`` (None: off);
    ``client_body_timeout_s``: edge.client_body_timeout_s, seconds."""
    access = (f"    access_log {access_log} tokengate_access if=$tg_access_line;"
              if access_log else "    # (access_log.file is off)")
    return _fill((templates / "tokengate-location.conf.in").read_text(), {
        "USAGE_FILE": str(usage_file), "ACCESS_LOG": access,
        "CLIENT_BODY_TIMEOUT_S": str(client_body_timeout_s),
    })


def render_http(templates: Path, lua_dir: Path, edge_json: Path, counter_socket: Path,
                counter_workers: int, hop_address: str, limits: list[str],
                limits_timeout_ms: int, status_listen: str) -> str:
    """The http-level part (``<templates>/tokengate-http.conf.in``) for the given paths.

    counter_socket, counter_workers: the counter's --unix-socket and --workers (the edge
    calls its sockets directly). hop_address: where the loopback-hop server listens,
    ``unix:<path>`` or ``host:port``. limits: the global-limit sidecar's addresses
    (``limits_servers``); timeouts in ms. status_listen: the status server's loopback
    ``host:port`` (edge.status_listen).
    """
    sockets = " ".join(f"unix:{s}" for s in counter_sockets(counter_socket, counter_workers))
    return _fill((templates / "tokengate-http.conf.in").read_text(), {
        "LUA_DIR": str(lua_dir), "EDGE_JSON": str(edge_json), "COUNTER_SOCKETS": sockets,
        "HOP_ADDRESS": hop_address,
        "LIMITS_SERVERS": "\n".join(f"    server {a} max_fails=0;" for a in limits),
        "LIMITS_TIMEOUT_MS": str(limits_timeout_ms), "STATUS_LISTEN": status_listen,
        "STATUS_HOSTS": status_hosts(status_listen),
    })


def status_hosts(status_listen: str) -> str:
    """The status server's ``server_name``s: its own address and the loopback names
    (nginx matches the Host header without its port)."""
    host = status_listen.rpartition(":")[0]
    names = dict.fromkeys([host, "127.0.0.1", "localhost", "[::1]"])
    return " ".join(names)


@dataclass(frozen=True)
class EdgeInstance:
    """One runnable edge: where it lives and what it talks to."""

    prefix: Path                   # folder of the rendered config, pid, temp files, hop socket
    listen: str                    # host:port of the API
    counter_socket: Path           # the counter's --unix-socket PATH (workers use PATH.<i>)
    templates: Path                # the folder of nginx.conf.in, tokengate-*.conf(.in)
    lua_dir: Path                  # the edge's Lua modules (the folder holding tokengate/)
    counter_workers: int = 2
    workers: int = 2               # nginx worker processes
    limits_workers: int = 1        # tokengate-limits --workers (sockets <unix_socket>.<i>)
    status_listen: str | None = None  # host:port of the status server; None: edge.status_listen

    @property
    def conf(self) -> Path:
        return self.prefix / "nginx.conf"

    @property
    def edge_json(self) -> Path:
        return self.prefix / "edge.json"

    @property
    def hop_socket(self) -> Path:
        return self.prefix / "hop.sock"

    @property
    def location_conf(self) -> Path:
        return self.prefix / "tokengate-location.conf"

    def remove_stale_hop_socket(self) -> None:
        """Removes the hop socket unless the nginx of ``prefix/nginx.pid`` still runs: a
        killed nginx leaves its socket behind, and the next one could not bind it."""
        if not _alive(self.prefix / "nginx.pid"):
            self.hop_socket.unlink(missing_ok=True)


def _alive(pid_file: Path) -> bool:
    """Whether the process named by an nginx pid file still runs."""
    try:
        os.kill(int(pid_file.read_text().strip()), 0)
    except (OSError, ValueError):
        return False
    return True


def write_instance(config_path: Path | None, inst: EdgeInstance) -> Path:
    """Compile ``config_path`` and render ``inst`` into its prefix; returns nginx.conf.

    Also creates the temp folders and the folders of the usage file and the sampled
    access log. The global-limit sidecar's addresses come from the configuration
    (``global_limits``). Raises ``ConfigError``.
    """
    doc = compile_config.write(config_path, inst.edge_json)
    inst.remove_stale_hop_socket()
    for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (inst.prefix / "tmp" / sub).mkdir(parents=True, exist_ok=True)
    usage_file = Path(doc["edge"]["usage_file"])
    access_log = Path(doc["access_log"]["file"]) if doc["access_log"]["file"] else None
    usage_file.parent.mkdir(parents=True, exist_ok=True)
    if access_log:
        access_log.parent.mkdir(parents=True, exist_ok=True)
    inst.location_conf.write_text(render_location(inst.templates, usage_file, access_log,
                                                  doc["edge"]["client_body_timeout_s"]))
    gl = doc["global_limits"]
    sock = Path(gl["unix_socket"]) if gl["unix_socket"] else None
    http = render_http(inst.templates, inst.lua_dir, inst.edge_json, inst.counter_socket,
                       inst.counter_workers, f"unix:{inst.hop_socket}",
                       limits_servers(sock, inst.limits_workers, gl["listen"]),
                       doc["edge"]["global_limits_timeout_ms"],
                       inst.status_listen or doc["edge"]["status_listen"])
    (inst.prefix / "tokengate-http.conf").write_text(http)
    # A root master would run workers as nobody, who cannot use the project's sockets
    # and files; run them as the invoking user instead.
    user = "user root;" if os.geteuid() == 0 else ""
    main = _fill((inst.templates / "nginx.conf.in").read_text(), {
        "PREFIX": str(inst.prefix), "LISTEN": inst.listen, "WORKERS": str(inst.workers),
        "USER": user, "LOCATION_CONF": str(inst.location_conf),
    })
    inst.conf.write_text(main)
    return inst.conf


def render_debian(templates: Path, paths: dict[str, Path] = DEBIAN_PATHS,
                  edge: compile_config.EdgeConfig | None = None) -> str:
    """The Debian drop-in's http-level part (committed as nginx/debian/tokengate.conf),
    from the templates in ``templates``. ``paths``: ``DEBIAN_PATHS`` or ``debian_paths
    (prefix)``; ``edge``: the configuration's edge section (timeouts, status_listen),
    default the schema's defaults (the committed file)."""
    p = paths
    run = p["hop_socket"].parent
    header = (
        "# Debian drop-in for an existing nginx (apt install nginx libnginx-mod-http-lua\n"
        "# libnginx-mod-http-ndk lua-resty-core lua-resty-lrucache lua-cjson lua-nginx-dns).\n"
        "# `tokengate install` puts it in conf.d/, the snippet tokengate-location.conf in\n"
        f"# snippets/, the Lua modules in {p['lua_dir']}, compiles {p['edge_json']}\n"
        "# and installs the sidecars' systemd units (docs/operators/deploy.md). Then:\n"
        "#   add `include snippets/tokengate-location.conf;` to a server { } block\n"
        "#   systemctl enable --now tokengate-counter tokengate-ledger\n"
        "#   nginx -t && systemctl reload nginx\n"
        f"# The sidecars' sockets and the hop server's below are in {run} (mode 0750,\n"
        "# group www-data, made at boot by /etc/tmpfiles.d/tokengate.conf): only nginx's\n"
        "# workers and the tokengate units reach them. tokengate.yaml's ledger.usage_file\n"
        f"# is {p['usage_file']} and access_log.file\n"
        f"# {p['access_log']} (the snippet's literal paths).\n"
        "# After editing tokengate.yaml: `tokengate install` again (recompiles edge.json,\n"
        "# keeps the file), then `nginx -s reload`.\n")
    d = edge or compile_config.EdgeConfig()
    return header + render_http(templates, p["lua_dir"], p["edge_json"],
                                p["counter_socket"], 2,
                                f"unix:{p['hop_socket']}",
                                limits_servers(p["limits_socket"], 2, ""),
                                d.global_limits_timeout_ms, d.status_listen)


def render_debian_location(templates: Path, paths: dict[str, Path] = DEBIAN_PATHS,
                           edge: compile_config.EdgeConfig | None = None,
                           access_log: bool = True) -> str:
    """The Debian server-level snippet (committed as nginx/debian/tokengate-location.conf):
    the drop-in's literal paths (``paths`` as in ``render_debian``), the timeouts of
    ``edge`` (default the schema's); ``access_log``: False when access_log.file is off."""
    return render_location(templates, paths["usage_file"],
                           paths["access_log"] if access_log else None,
                           (edge or compile_config.EdgeConfig()).client_body_timeout_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tokengate.tools.nginx_conf",
                                     description=__doc__.split("Usage::")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    i = sub.add_parser("instance", help="render a runnable instance into a folder")
    tg_config.add_config_option(i)
    i.add_argument("--prefix", type=Path, required=True)
    i.add_argument("--listen", default="127.0.0.1:8080")
    i.add_argument("--templates", type=Path, default=SHARE_DIR / "nginx",
                   help="folder of the nginx templates (default: %(default)s)")
    i.add_argument("--lua-dir", type=Path, default=DEBIAN_PATHS["lua_dir"],
                   help="folder of the edge's Lua modules (default: %(default)s)")
    i.add_argument("--counter-socket", type=Path, default=DEBIAN_PATHS["counter_socket"])
    i.add_argument("--counter-workers", type=int, default=2)
    i.add_argument("--workers", type=int, default=2)
    i.add_argument("--limits-workers", type=int, default=1)
    i.add_argument("--status-listen", default=None,
                   help="host:port of the status server (default: edge.status_listen)")
    d = sub.add_parser("debian", help="rewrite nginx/debian/ (the drop-in and its snippet)")
    d.add_argument("--templates", type=Path, required=True,
                   help="the checkout's nginx/ folder")
    d.add_argument("--out", type=Path, default=None,
                   help="folder of tokengate.conf and tokengate-location.conf "
                        "(default: <templates>/debian)")
    args = parser.parse_args(argv)
    if args.command == "instance":
        conf = write_instance(args.config, EdgeInstance(
            prefix=args.prefix.resolve(), listen=args.listen,
            counter_socket=args.counter_socket.resolve(),
            templates=args.templates.resolve(), lua_dir=args.lua_dir.resolve(),
            counter_workers=args.counter_workers, workers=args.workers,
            limits_workers=args.limits_workers, status_listen=args.status_listen))
        print(f"nginx -p {args.prefix.resolve()} -c {conf}")
    else:
        out = args.out or debian_conf(args.templates).parent
        out.mkdir(parents=True, exist_ok=True)
        for path, text in ((out / "tokengate.conf", render_debian(args.templates)),
                           (out / "tokengate-location.conf",
                            render_debian_location(args.templates))):
            path.write_text(text)
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
