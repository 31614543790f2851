"""``tokengate doctor``: is every upstream the vLLM that the counter mirrors?

The checks are ``tokengate.counter.upstream_check``'s (health, model, version,
prompt_tokens_details, usage, tool_parser, engine_records, the count probes and, for
prefix routing, prefix_cache and kv_events; its
docstring says what each one asks of vLLM); this is the command that runs all of them,
the engine records' check included, and prints one line per check.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tokengate import config as tg_config
from tokengate.counter.upstream_check import (
    ENGINE_WAIT_S,
    PROBES,
    Check,
    Status,
    check_upstream,
    run,
    summary,
    version_verified,
    wait_healthy,
)

__all__ = ["DOCTOR_HELP", "ENGINE_WAIT_S", "PROBES", "Check", "Status", "add_parser",
           "check_upstream", "doctor_command", "run", "summary", "version_verified",
           "wait_healthy"]


DOCTOR_HELP = """\
Check every upstream of every model against what the counter and billing rely on:
/health; /v1/models serves the configured name and max_model_len; /version is a vLLM
release the counter was verified against (0.32.x); --enable-prompt-tokens-details is on
(usage.prompt_tokens_details present) and usage.prompt_tokens equals the counter's
count; the tool-call parser is on (a request with tools gets 200); the tokengate vLLM
plugin is loaded and writes where the ledger reads (that chat request's engine record
appears in one of ledger.engine_usage_files within --engine-wait-s); and for a fixed set
of bodies (system prompt, tools, multi-turn with a tool call, CJK, a completions prompt)
the counter's count equals vLLM's own POST /tokenize answer. For a model routed by the
prefix cache (routing.policy: prefix): vLLM's vllm:cache_config_info on /metrics says
prefix caching is on with the block size and hash algorithm of models.<name>.routing, and
each replica of routing.kv_events publishes, on that endpoint, the blocks of a probe
prompt with the counter's block hashes (which also checks routing.hash_seed). The counter
runs in this process from the configuration's model directories. Requests go straight to each
upstream (never through the edge); each generates at most one token.

Then the host: for an installed layout (/etc/tokengate/tokengate.yaml, units in
/etc/systemd/system), readable, each sidecar unit's own user and groups can read the
configuration and what it follows (the counter the models' files, the ledger the usage
and engine files' folders); the running services' own view, asked on their metrics
ports: kv_events_connected, the running counter is connected to the KV-event publisher
of each replica that routing.kv_events names (not only the doctor), and
engine_file_followed, the running ledger follows each of ledger.engine_usage_files;
and redis_persistence, the Redis of redis.url keeps its data across a restart
(appendonly yes; RDB snapshots alone are a warning, neither a failure: the bill, the
budgets' spend and the ledger's checkpoints live there).

OUTPUT
  One line per check per upstream, as it completes:
    <OK|WARN|FAIL|SKIP> <model> <host:port> <check>: <what was seen; what to change>
  then the host's, as "<STATUS> unit <unit> readable: ...", "<STATUS> counter
  <replica host:port> kv_events_connected: ...", "<STATUS> ledger <engine file>
  engine_file_followed: ..." and "<STATUS> redis <host:port> redis_persistence: ...",
  and a summary line on stderr.

EXIT STATUS
  0 every check passed (warnings allowed); 1 a check failed; 2 the configuration
  cannot be read or is invalid.
"""


def redis_persistence(cfg: tg_config.Config, timeout_s: float = 5.0) -> Check:
    """The ``redis_persistence`` host check: the Redis of ``redis.url`` keeps its data
    across a restart (``appendonly yes``, or RDB ``save`` points). Without either, a
    Redis restart loses the bill, the budgets' spend and the ledger's checkpoints: the
    ledger then rebuilds counters from the usage files with the edge's numbers, and a key
    refused at its budget is admitted again (seen in an operator's trial). FAIL names the
    settings to change; WARN when Redis answers but refuses CONFIG GET (a renamed
    command: check it by hand); FAIL when Redis does not answer."""
    from redis.exceptions import RedisError, ResponseError

    from tokengate import redis_client

    where = cfg.redis.url.split("@")[-1].split("://")[-1].split("/")[0] or "redis"
    what = "redis_persistence"
    try:
        client = redis_client.connect(cfg.redis, timeout_s=timeout_s)
        aof = str(client.config_get("appendonly").get("appendonly", ""))
        save = str(client.config_get("save").get("save", ""))
    except ResponseError as e:
        return Check("redis", where, what, "WARN", f"CONFIG GET refused ({e}): check that "
                     "appendonly is yes (appendfsync everysec) by hand")
    except RedisError as e:
        return Check("redis", where, what, "FAIL", f"Redis does not answer: {e}")
    if aof == "yes":
        return Check("redis", where, what, "OK", "appendonly yes: the bill, budgets and "
                     "checkpoints survive a restart")
    if save.strip():
        return Check("redis", where, what, "WARN", f"snapshots only (save {save!r}, "
                     "appendonly no): a crash loses what changed since the last one; set "
                     "appendonly yes and appendfsync everysec")
    return Check("redis", where, what, "FAIL", "no persistence (appendonly no, save ''): a "
                 "restart loses the bill, the budgets' spend and the ledger's checkpoints; "
                 "set appendonly yes and appendfsync everysec in redis.conf (docs/operators/"
                 "redis-durability.md)")


# What each sidecar unit reads, by the configuration it is given: every unit the
# configuration; the counter the models' files; the ledger the usage file's folder (it
# lists it for rotated files) and the engine files' folders; the console the usage
# file's folder (the request log, rotated files too).
SIDECAR_UNITS = ("tokengate-counter.service", "tokengate-ledger.service",
                 "tokengate-limits.service", "tokengate-console.service")


def _unit_identity(unit: Path) -> tuple[str, str, list[str]]:
    """(User=, Group=, SupplementaryGroups=) of a unit file (the last assignment of
    each, as systemd reads single-valued settings; root:root when absent)."""
    user, group, extra = "root", "", []
    for raw in unit.read_text().splitlines():
        line = raw.strip()
        key, _, value = line.partition("=")
        if key == "User":
            user = value.strip()
        elif key == "Group":
            group = value.strip()
        elif key == "SupplementaryGroups":
            extra = value.split() if value.strip() else []
    return user, group, extra


def _denied(path: Path, uid: int, gids: set[int], directory: bool) -> str | None:
    """Why ``uid`` with ``gids`` cannot read ``path`` (and, for a directory, list it):
    the first folder on the way it cannot enter, or the file's own mode; None when it
    can. By the permission bits (ACLs are not read); root reads everything."""
    if uid == 0:
        return None
    path = path.absolute()
    chain = [*reversed(path.parents), path]
    for i, p in enumerate(chain):
        try:
            st = p.stat()
        except OSError as e:
            return f"{p}: {e.strerror}"
        last = i == len(chain) - 1
        need = (4 | (1 if directory else 0)) if last else 1
        bits = (st.st_mode >> 6) & 7 if st.st_uid == uid else \
            (st.st_mode >> 3) & 7 if st.st_gid in gids else st.st_mode & 7
        if bits & need != need:
            from tokengate.install import _owner_name
            return f"{p} ({st.st_mode & 0o777:o} {_owner_name(st.st_uid, st.st_gid)})"
    return None


def installed_units(cfg: tg_config.Config) -> Path | None:
    """The unit folder of the installed layout whose configuration ``cfg`` is
    (``<root>/etc/tokengate/tokengate.yaml`` -> ``<root>/etc/systemd/system``), or None
    for any other file (``make run``'s, a checkout's)."""
    path = cfg.path.absolute()
    if path.parts[-3:] != ("etc", "tokengate", "tokengate.yaml"):
        return None
    return path.parents[2] / "etc" / "systemd" / "system"


def unit_access(cfg: tg_config.Config) -> list[Check]:
    """The ``readable`` host checks of an installed layout (the configuration is
    ``<root>/etc/tokengate/tokengate.yaml`` and the units are in
    ``<root>/etc/systemd/system``): for each sidecar unit installed there, whether its
    own user and groups can read what it needs (``SIDECAR_UNITS``). An upgrade once left
    tokengate.yaml root:root 0600: every unit exited with Permission denied while the
    doctor said OK. SKIP when the unit's user does not exist on this machine; no check
    outside an installed layout."""
    import grp
    import pwd

    path = cfg.path.absolute()
    units = installed_units(cfg)
    if units is None:
        return []
    needs: dict[str, list[tuple[Path, bool]]] = {
        "tokengate-counter.service": [(m.dir, True) for m in cfg.models.values()],
        "tokengate-ledger.service": [(cfg.ledger.usage_file.parent, True),
                                     *((Path(f).parent, True)
                                       for f in cfg.ledger.engine_usage_files)],
        "tokengate-limits.service": [],
        "tokengate-console.service": [(cfg.ledger.usage_file.parent, True)]}
    checks = []
    for name in SIDECAR_UNITS:
        unit = units / name
        if not unit.is_file():
            continue
        user, group, extra = _unit_identity(unit)
        try:
            pw = pwd.getpwnam(user)
            gids = {pw.pw_gid, *(grp.getgrnam(g).gr_gid for g in [group, *extra] if g)}
            gids |= {g.gr_gid for g in grp.getgrall() if user in g.gr_mem}
        except KeyError as e:
            checks.append(Check("unit", name, "readable", "SKIP",
                                f"not checked: {e.args[0]} (user {user}, group "
                                f"{group or '-'}) is not known on this machine"))
            continue
        who = f"user {user} (group {group or pw.pw_gid})"
        bad = [why for p, is_dir in [(path, False), *needs[name]]
               if (why := _denied(p, pw.pw_uid, gids, is_dir)) is not None]
        if bad:
            checks.append(Check("unit", name, "readable", "FAIL",
                                f"{who} cannot read {'; '.join(bad)}: the unit exits at "
                                "start; run `tokengate install` again (it sets the owners "
                                "and modes back)"))
        else:
            checks.append(Check("unit", name, "readable", "OK",
                                f"{who} reads the configuration"
                                + (" and what it follows" if needs[name] else "")))
    return checks


def _ask(listen: str, path: str, timeout_s: float) -> tuple[int, bytes]:
    """(HTTP status, body) of ``GET http://<listen><path>``, a service's own loopback
    port (its Host header the port's address, which the ledger's admin view requires).
    Raises ``OSError`` when nothing answers."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://{listen}{path}", headers={"Host": listen})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def counter_kv_events(cfg: tg_config.Config, timeout_s: float = 5.0) -> list[Check]:
    """The ``kv_events_connected`` host checks of an installed layout whose
    ``tokengate-counter.service`` is there: for each replica whose KV events a model
    follows (``routing.kv_events`` of a model routed by the prefix cache), whether the
    running counter is connected to that replica's publisher, as the counter itself
    says on ``metrics.counter_listen`` (``tokengate_counter_kv_index_live`` and
    ``tokengate_counter_kv_last_event_timestamp_seconds``, by model and upstream). The
    upstream check ``kv_events`` subscribes from the doctor's own process: a counter
    whose unit could not reach the publisher (``PrivateNetwork=yes`` once) routed by the
    edge's approximate guess while that check passed. FAIL names the replica; WARN when
    ``metrics.counter_listen`` is null (the counter cannot be asked)."""
    units = installed_units(cfg)
    follows = [(name, upstream, endpoint) for name, m in cfg.models.items()
               for upstream, endpoint in m.kv_events.items()]
    if units is None or not (units / "tokengate-counter.service").is_file() or not follows:
        return []
    what = "kv_events_connected"
    listen = cfg.metrics.counter_listen
    if listen is None:
        return [Check("counter", upstream, what, "WARN", "metrics.counter_listen is null: the "
                      f"running counter cannot be asked whether it follows {endpoint}")
                for _name, upstream, endpoint in follows]
    try:
        _status, body = _ask(listen, "/metrics", timeout_s)
    except OSError as e:
        return [Check("counter", upstream, what, "FAIL", f"the counter's metrics on {listen} "
                      f"do not answer ({e}): tokengate-counter is not running (systemctl "
                      "status tokengate-counter), or its unit has a network of its own "
                      f"(PrivateNetwork=yes), from which it reaches neither {endpoint} nor "
                      "this port") for _name, upstream, endpoint in follows]
    from prometheus_client.parser import text_string_to_metric_families

    live: dict[tuple[str, str], float] = {}
    last: dict[tuple[str, str], float] = {}
    wanted = {"tokengate_counter_kv_index_live": live,
              "tokengate_counter_kv_last_event_timestamp_seconds": last}
    for family in text_string_to_metric_families(body.decode(errors="replace")):
        into = wanted.get(family.name)
        if into is None:
            continue
        for sample in family.samples:
            into[(sample.labels.get("model", ""), sample.labels.get("upstream", ""))] = \
                sample.value
    now = time.time()
    checks = []
    for name, upstream, endpoint in follows:
        up = live.get((name, upstream))
        if up is None:
            checks.append(Check("counter", upstream, what, "FAIL", (
                f"the running counter does not follow {endpoint} ({name}'s replica): it runs "
                "another configuration or an earlier release (systemctl reload "
                "tokengate-counter; after an upgrade, restart it)")))
        elif up < 1:
            checks.append(Check("counter", upstream, what, "FAIL", (
                f"the running counter is not connected to {endpoint}, the KV-event publisher "
                f"of {name}'s replica {upstream}: its prefix hits are the edge's approximate "
                "guess (is the replica up with --kv-events-config, and can the counter's "
                "unit reach that address?)")))
        else:
            seen = last.get((name, upstream), 0.0)
            when = f"its last event {max(0.0, now - seen):.0f} s ago" if seen > 0 else \
                "no event since it connected (an idle replica sends none)"
            checks.append(Check("counter", upstream, what, "OK",
                                f"the running counter is connected to {endpoint}; {when}"))
    return checks


def ledger_engine_files(cfg: tg_config.Config, timeout_s: float = 5.0) -> list[Check]:
    """The ``engine_file_followed`` host checks of an installed layout whose
    ``tokengate-ledger.service`` is there: each file of ``ledger.engine_usage_files`` is
    one the running ledger follows (``engine_files`` of its ``GET /status`` on
    ``metrics.ledger_listen``). A replica added by configuration was once billed with
    the edge's numbers because the running ledger never read its records. FAIL names the
    file; WARN when ``metrics.ledger_listen`` is null (the ledger cannot be asked)."""
    units = installed_units(cfg)
    files = list(cfg.ledger.engine_usage_files)
    if units is None or not (units / "tokengate-ledger.service").is_file() or not files:
        return []
    what = "engine_file_followed"
    listen = cfg.metrics.ledger_listen
    if listen is None:
        return [Check("ledger", str(f), what, "WARN", "metrics.ledger_listen is null: the "
                      "running ledger cannot be asked whether it follows this file")
                for f in files]
    try:
        status, body = _ask(listen, "/status", timeout_s)
    except OSError as e:
        return [Check("ledger", str(f), what, "FAIL", f"the ledger's metrics port {listen} "
                      f"does not answer ({e}): is tokengate-ledger running? (systemctl "
                      "status tokengate-ledger)") for f in files]
    if status != 200:
        return [Check("ledger", str(f), what, "FAIL", f"the running ledger answers GET "
                      f"/status on {listen} with {status}: it is an earlier release "
                      "(systemctl restart tokengate-ledger)") for f in files]
    followed = {Path(p).resolve() for p in json.loads(body).get("engine_files") or []}
    return [Check("ledger", str(f), what, "OK", "the running ledger follows it")
            if Path(f).resolve() in followed else
            Check("ledger", str(f), what, "FAIL", (
                "the running ledger does not follow it: its replica's requests are billed "
                "with the edge's numbers (systemctl restart tokengate-ledger; it follows "
                f"{', '.join(sorted(map(str, followed))) or 'no engine file'})"))
            for f in files]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``tokengate doctor`` on the ``tokengate`` command's subparsers."""
    p = sub.add_parser("doctor", help="check that every upstream is the vLLM the counter "
                                      "mirrors", description=DOCTOR_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=None,
                   help=f"tokengate.yaml ({tg_config.LOOKUP_HELP})")
    p.add_argument("--allow-unverified-vllm", action="store_true",
                   help="a vLLM release the counter was not verified against is a warning, "
                        "not a failure (the count checks still run and must pass)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="per request to an upstream, s (default: %(default)s)")
    p.add_argument("--engine-wait-s", type=float, default=ENGINE_WAIT_S,
                   help="how long a probe's engine record may take to appear in "
                        "ledger.engine_usage_files, s (default: %(default)s)")
    p.add_argument("--wait-s", type=float, default=0.0,
                   help="first wait up to this long for every upstream's /health, s "
                        "(default: %(default)s: no wait)")
    p.set_defaults(func=doctor_command)


def doctor_command(args: argparse.Namespace) -> int:
    """``tokengate doctor``: 0 all passed, 1 a check failed, 2 bad configuration."""
    try:
        cfg = tg_config.load(args.config)
    except tg_config.ConfigError as e:
        for line in e.errors:
            print(line, file=sys.stderr)
        return 2
    except OSError as e:
        print(f"tokengate doctor: {e}", file=sys.stderr)
        return 2

    def out(line: str) -> None:
        print(line, flush=True)

    if args.wait_s > 0:
        wait_healthy(cfg, args.wait_s, out)
    checks = run(cfg, allow_unverified=args.allow_unverified_vllm, timeout_s=args.timeout_s,
                 out=out, engine_records=True, engine_wait_s=args.engine_wait_s)
    host = [*unit_access(cfg), *counter_kv_events(cfg), *ledger_engine_files(cfg),
            redis_persistence(cfg)]
    for c in host:
        out(c.line())
    failed = any(c.status == "FAIL" for c in checks + host)
    print(f"tokengate doctor: {summary(checks)}; host: "
          + ", ".join(f"{c.name} {c.status}" for c in host), file=sys.stderr)
    return 1 if failed else 0
