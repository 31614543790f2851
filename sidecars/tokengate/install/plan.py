"""The plan of ``tokengate install``: every check first, then the list of changes in
order, each a printed line and what does it; nothing changes before the whole plan is
known."""

from __future__ import annotations

import grp
import importlib.util
import os
import pwd
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import tokengate
from tokengate import config as tg_config
from tokengate.install import files
from tokengate.install.config_text import (
    NEEDED,
    Needed,
    add_needed,
    check_paths,
    deploy_config_text,
    header,
    host_config_text,
    vllm_env_text,
)
from tokengate.install.host import (
    GROUP,
    HIDDEN,
    HOST_CONFIG,
    HOST_EDGE_LISTEN,
    HOST_REDIS_URL,
    TEMPLATES,
    UNIT_BIN_DIR,
    UNIT_VLLM_PYTHON,
    UNITS,
    USER,
    VLLM_UNIT,
    InstallError,
    hidden,
    named,
    script_interpreter,
    unseen_interpreter,
)
from tokengate.tools import compile_config, nginx_conf


@dataclass(frozen=True)
class Options:
    """What ``tokengate install`` was asked to do."""

    prefix: Path                # the root folder of the install (/ on a host)
    source: Path                # a checkout: lua/, nginx/, systemd/, tokengate.yaml
    config: Path | None         # the configuration to install when none is there
    bin_dir: Path               # the folder of tokengate-counter, -ledger, -limits, -console
    vllm_python: Path           # the interpreter of the host's vLLM
    dry_run: bool = False
    # the model of a configuration made for the host (no --config)
    model: str | None = None
    model_dir: Path | None = None
    max_model_len: int | None = None
    upstreams: tuple[str, ...] = ()
    redis_url: str = HOST_REDIS_URL
    edge_listen: str = HOST_EDGE_LISTEN
    # False: the host runs its vLLM itself (no tokengate-vllm@.service, no example.env);
    # True: write them; None (neither --vllm-python nor --no-vllm-unit): as the last
    # install chose, i.e. written when the unit is there already or on a first install
    vllm_unit: bool | None = True

    @property
    def on_host(self) -> bool:
        return self.prefix.resolve() == Path("/")

    def at(self, path: str) -> Path:
        """``path`` (absolute, as on a host) under the prefix."""
        return self.prefix / path.lstrip("/")


@dataclass
class Plan:
    """The changes, in order, each a printed line and what does it."""

    dry_run: bool
    steps: list[tuple[str, Callable[[], None]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    next_steps: str = ""   # what the operator does next (printed after an install on a host)

    def add(self, what: str, do: Callable[[], None]) -> None:
        self.steps.append((what, do))

    def run(self) -> None:
        for what, do in self.steps:
            print(("would " if self.dry_run else "") + what, flush=True)
            if not self.dry_run:
                do()


def default_vllm_python() -> Path:
    """This interpreter when it can import vllm, else ``/opt/vllm/bin/python``."""
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    return Path(UNIT_VLLM_PYTHON)


def plan(opts: Options) -> Plan:
    """Check everything and list the changes; raises ``InstallError`` (nothing changed)."""
    problems: list[str] = []
    warnings: list[str] = []
    src = opts.source.resolve()
    lua_src = src / "lua" / "tokengate"
    tpl_src = src / "nginx"
    unit_src = src / "systemd"
    for need in (lua_src, *(tpl_src / t for t in TEMPLATES), *(unit_src / u for u in UNITS),
                 unit_src / HOST_CONFIG):
        if not need.exists():
            problems.append(f"{need}: missing (run install from a tokengate checkout, "
                            f"or give --source)")
    for exe in ("tokengate-counter", "tokengate-ledger", "tokengate-limits",
                "tokengate-console"):
        if not os.access(opts.bin_dir / exe, os.X_OK):
            problems.append(f"{opts.bin_dir / exe}: not found (--bin-dir: the bin folder of "
                            "the virtualenv the services run from)")
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        problems.append(f"group {GROUP} does not exist (nginx's workers' group on Debian)")
    if problems:
        raise InstallError(problems)

    paths = nginx_conf.debian_paths(opts.prefix.resolve())
    target = opts.at("/etc/tokengate/tokengate.yaml")
    unit_path = opts.at(f"/etc/systemd/system/{VLLM_UNIT}")
    if opts.vllm_unit is None:
        # a run again keeps the first one's choice (the deploy docs say to run install
        # again after each edit, without repeating its options)
        opts = replace(opts, vllm_unit=not target.exists() or unit_path.exists())
    elif not opts.vllm_unit and unit_path.exists():
        warnings.append(f"{unit_path}: written by an earlier install and left in place "
                        "(install removes no unit a replica may run from): delete it once "
                        "no tokengate-vllm@PORT runs")
    kept: str | None = None   # the existing configuration with what this release needs
    added: list[Needed] = []
    try:
        if target.exists():
            kept, added, needs = add_needed(tg_config.read_text(target), opts.prefix, target)
            problems += needs
            cfg = tg_config.loads(kept, target.resolve())
            config_text = None
        elif opts.config is not None:
            source_config = opts.config.resolve()
            tg_config.load(source_config)  # the source itself is valid (duplicate keys too)
            config_text, _, needs = add_needed(header(source_config) + deploy_config_text(
                tg_config.read_text(source_config), source_config.parent, paths),
                opts.prefix, target)
            problems += needs
            cfg = tg_config.loads(config_text, target)
        else:
            asked = [flag for flag, given in (
                ("--model", opts.model), ("--model-dir", opts.model_dir),
                ("--max-model-len", opts.max_model_len), ("--upstream", opts.upstreams))
                if not given]
            if asked:
                why = (f"{target} does not exist: give {', '.join(asked)} (the served model "
                       "name, its directory, vLLM's --max-model-len, each vLLM's host:port, "
                       "--upstream once per replica), or --config FILE")
                raise InstallError([why])
            assert opts.model and opts.model_dir and opts.max_model_len
            template = unit_src / HOST_CONFIG
            config_text = header(template) + deploy_config_text(host_config_text(
                template.read_text(), opts.model, opts.model_dir, opts.max_model_len,
                opts.upstreams, opts.at("/var/lib/tokengate/engine"), opts.redis_url,
                opts.edge_listen), template.parent, paths)
            cfg = tg_config.loads(config_text, target)
        compile_config.compile_config(cfg)  # resolves upstreams, reads tokenizer files
    except tg_config.ConfigError as e:
        raise InstallError(e.errors) from None
    except OSError as e:
        raise InstallError([str(e)]) from None
    problems += check_paths(cfg, paths, target)

    vllm_python = [("--vllm-python", opts.vllm_python)] if opts.vllm_unit else []
    must_see = [("--bin-dir", opts.bin_dir), ("the tokengate package",
                                            Path(tokengate.__file__).parent),
              *vllm_python,
              *((f"models.{n}.dir", m.dir) for n, m in cfg.models.items())]
    for what, path in must_see:
        if hidden(path):
            line = (f"{what} {named(path)} is below {', '.join(map(str, HIDDEN))}, which "
                    "the units hide (ProtectHome=yes): use a virtualenv or folder such as "
                    "/opt/tokengate")
            (problems if opts.on_host else warnings).append(line)
    for what, python in (("--bin-dir", script_interpreter(opts.bin_dir / "tokengate-counter")),
                         *vllm_python):
        if python is None or any(what == w and hidden(p) for w, p in must_see):
            continue  # no interpreter named, or its path itself was refused above
        unseen = unseen_interpreter(what, python)
        if unseen is not None:
            (problems if opts.on_host else warnings).append(unseen)
    if opts.vllm_unit and not opts.vllm_python.exists():
        warnings.append(f"{opts.vllm_python}: not found; {VLLM_UNIT} will not start until "
                        "--vllm-python names the interpreter of your vLLM (a host that runs "
                        f"its vLLM itself: --no-vllm-unit, and no {VLLM_UNIT} is written)")
    if problems:
        raise InstallError(problems)

    try:
        pwd.getpwnam(USER)
        user_exists = True
    except KeyError:
        user_exists = False
    stand_in = not opts.on_host
    todo = Plan(opts.dry_run, next_steps=next_steps(cfg, vllm_unit=bool(opts.vllm_unit)))
    todo.notes += warnings
    if not user_exists:
        if opts.on_host:
            argv = ["useradd", "--system", "--gid", GROUP, "--home-dir", "/var/lib/tokengate",
                    "--no-create-home", "--shell", "/usr/sbin/nologin",
                    "--comment", "tokengate sidecars", USER]
            todo.add(f"create the system user {USER} (group {GROUP}): {' '.join(argv)}",
                     lambda: files.run(argv))
        else:
            todo.notes.append(f"user {USER} does not exist here: root owns what it would own "
                              "under this prefix")

    share = opts.at("/usr/share/tokengate")
    root_owned = ("root", "root")
    for path, mode, owner in (
            (opts.at("/etc/tokengate"), 0o750, ("root", GROUP)),
            *(((opts.at("/etc/tokengate/vllm"), 0o750, ("root", GROUP)),)
              if opts.vllm_unit else ()),
            (opts.at("/var/lib/tokengate"), 0o750, (USER, GROUP)),
            # the folders of NEEDED settings, where the configuration puts them
            *((folder, *row.folder) for row in NEEDED
              if row.folder is not None and (folder := row.configured(cfg)) is not None),
            (opts.at("/var/lib/tokengate/usage"), 0o750, ("root", GROUP)),
            # the vLLM plugin's engine records (tokengate-vllm@.service writes, the ledger reads)
            (opts.at("/var/lib/tokengate/engine"), 0o750, (USER, GROUP)),
            (opts.at("/var/log/tokengate"), 0o750, ("root", GROUP)),
            # what tmpfiles.d makes at boot; made now so that nginx can reload at once
            (opts.at("/run/tokengate"), 0o750, (USER, GROUP)),
            (share, 0o755, root_owned), (share / "lua" / "tokengate", 0o755, root_owned),
            (share / "nginx", 0o755, root_owned)):
        # a run again finds them: their mode and owner are set again
        todo.add(f"{'set' if path.is_dir() else 'create'} {path} ({mode:o} "
                 f"{owner[0]}:{owner[1]})", files.bind(files.make_dir, path, mode, owner, stand_in))

    lua_dst = share / "lua" / "tokengate"
    # the modules by their path below tokengate/ (stages/read.lua, apis/chat.lua, ...)
    sources = sorted(q.relative_to(lua_src) for q in lua_src.rglob("*.lua"))
    stale = sorted({q.relative_to(lua_dst) for q in lua_dst.rglob("*.lua")} - set(sources))

    def copy_lua() -> None:
        for name in sources:
            files.write(lua_dst / name, (lua_src / name).read_bytes(), 0o644, None, stand_in)
        for name in stale:
            (lua_dst / name).unlink()
    todo.add(f"copy {len(sources)} Lua modules to {lua_dst}"
          + (f", remove {', '.join(map(str, stale))}" if stale else ""), copy_lua)

    def file(dst: Path, data: bytes, mode: int = 0o644,
             owner: tuple[str, str] | None = None) -> None:
        todo.add(f"write {dst}", lambda: files.write(dst, data, mode, owner, stand_in))

    for t in TEMPLATES:
        file(share / "nginx" / t, (tpl_src / t).read_bytes())
    for u in UNITS:
        if u == VLLM_UNIT and not opts.vllm_unit:
            continue
        text = (unit_src / u).read_text()
        text = text.replace(UNIT_BIN_DIR + "/", f"{opts.bin_dir.absolute()}/")
        text = text.replace(UNIT_VLLM_PYTHON, str(opts.vllm_python.absolute()))
        file(opts.at(f"/etc/systemd/system/{u}"), text.encode())
    file(opts.at("/etc/systemd/system/nginx.service.d/tokengate.conf"),
         (unit_src / "nginx.service.d" / "tokengate.conf").read_bytes())
    file(opts.at("/etc/tmpfiles.d/tokengate.conf"), (unit_src / "tokengate.tmpfiles").read_bytes())
    example = opts.at("/etc/tokengate/vllm/example.env")
    if opts.vllm_unit and not example.exists():
        file(example, vllm_env_text((unit_src / "vllm.env.example").read_text(),
                                    cfg).encode())

    if added:
        assert kept is not None
        # an earlier release's file: what this one needs added, the rest as it was
        todo.add("add " + ", ".join(f"{row.name} ({row.since} needs it)" for row in added)
                 + f" to {target}, 640 root:{GROUP}",
                 files.bind(files.write, target, kept.encode(), 0o640, ("root", GROUP), stand_in))
    elif config_text is None:
        # What an earlier release or an edit left (a `keys create` of 0.1.0 re-owned it
        # root:root 0600, and every unit then failed at start with Permission denied):
        # the services read it as tokengate:www-data, so its owner and mode are set again.
        have = target.stat()
        repair = oct(have.st_mode & 0o777) != "0o640" or (
            os.geteuid() == 0 and (have.st_uid, have.st_gid) != files.ids("root", GROUP, stand_in))
        todo.add(f"keep {target} (it exists)" + (
            f"; set 640 root:{GROUP} again (it was {have.st_mode & 0o777:o} "
            f"{files.owner_name(have.st_uid, have.st_gid)}: the units could not read it)"
            if repair else ""),
            files.bind(files.fix_mode, target, 0o640, ("root", GROUP), stand_in))
    else:
        file(target, config_text.encode(), 0o640, ("root", GROUP))
        made = opts.config or f"{unit_src / HOST_CONFIG}, for this host"
        todo.notes.append(f"{target}: from {made}; check redis.url and the ports, create "
                          "keys with `tokengate keys create`")
    edge_json = paths["edge_json"]

    def compile_edge() -> None:
        compile_config.write(target, edge_json)
        os.chmod(edge_json, 0o640)
        files.chown(edge_json, "root", GROUP, stand_in)
    todo.add(f"compile {edge_json} from {target}", compile_edge)

    templates = tpl_src
    file(opts.at("/etc/nginx/conf.d/tokengate.conf"),
         nginx_conf.render_debian(templates, paths, cfg.edge).encode())
    file(opts.at("/etc/nginx/snippets/tokengate-location.conf"),
         nginx_conf.render_debian_location(templates, paths, cfg.edge,
                                           cfg.access_log.file is not None).encode())
    if not opts.at("/etc/nginx/nginx.conf").exists():
        todo.notes.append(f"{opts.at('/etc/nginx/nginx.conf')}: not found; install nginx "
                       "(apt install nginx libnginx-mod-http-lua libnginx-mod-http-ndk "
                       "lua-resty-core lua-resty-lrucache lua-cjson lua-nginx-dns)")
    if opts.on_host and Path("/run/systemd/system").is_dir():
        todo.add("reload systemd's unit files (systemctl daemon-reload; no service is "
                 "started or stopped)",
                 lambda: files.run(["systemctl", "daemon-reload"]))
    return todo


def next_steps(cfg: tg_config.Config, vllm_unit: bool = True) -> str:
    """What is left after an install, for this configuration: one ``tokengate-vllm@PORT``
    per loopback upstream (a replica on another host is started there; none without
    ``vllm_unit``: the host runs its vLLM itself, and ``tokengate doctor`` checks it),
    ``tokengate-limits`` only with ``global_limits.enabled``."""
    sidecars = "tokengate-counter tokengate-ledger"
    if cfg.global_limits.enabled:
        sidecars += " tokengate-limits"
    lines = ["Next (install changed no running service):",
             "  edit /etc/tokengate/tokengate.yaml, then run tokengate install again (edge.json)",
             "  add `include snippets/tokengate-location.conf;` to a server { } block of nginx",
             f"  systemctl enable --now {sidecars}"]
    if not vllm_unit:
        lines.append("  tokengate doctor   (once the host's own vLLM serves: it checks the "
                     "flags and the tokengate plugin that billing needs)")
    for name, model in cfg.models.items():
        for upstream in model.upstreams if vllm_unit else []:
            port = upstream.rpartition(":")[2]
            if not tg_config._is_loopback(upstream):
                lines.append(f"  {name} at {upstream}: a replica on another host; start it "
                             f"there (tokengate-vllm@{port})")
                continue
            lines.append(f"  {name} at {upstream}: cp /etc/tokengate/vllm/example.env "
                         f"/etc/tokengate/vllm/{port}.env, check it, then")
            lines.append(f"      systemctl enable --now tokengate-vllm@{port}   (skip this "
                         "if the host's own vLLM serves that port: give it the unit's "
                         "flags and the plugin)")
    lines.append("  nginx -t && systemctl reload nginx")
    lines.append("  operator console (optional): systemctl enable --now tokengate-console "
                 "tokengate-console-apply.path, then tokengate console passwd NAME; it "
                 f"serves http://{cfg.ledger.console.listen}/")
    return "\n".join(lines)
