"""The host checks of ``tokengate doctor``, for an installed layout
(``/etc/tokengate/tokengate.yaml``, units in ``/etc/systemd/system``): what the services
run by systemd can read, and what the running ones say they follow.

    readable              each sidecar unit's own user and groups can read the
                          configuration and what it follows (``unit_access``)
    kv_events_connected   the running counter is connected to the KV-event publisher of
                          each replica of ``routing.kv_events`` (``counter_kv_events``)
    engine_file_followed  the running ledger follows each of
                          ``ledger.engine_usage_files`` (``ledger_engine_files``)
    redis_persistence     the Redis of ``redis.url`` keeps its data across a restart, on
                          any layout (``redis_persistence``)
"""

from __future__ import annotations

import time
from pathlib import Path

from tokengate import config as tg_config
from tokengate.doctor import fetch
from tokengate.doctor.check import Check
from tokengate.doctor.engine_records import ledger_follows


def run(cfg: tg_config.Config) -> list[Check]:
    """Every host check, in the module's order."""
    return [*unit_access(cfg), *counter_kv_events(cfg), *ledger_engine_files(cfg),
            redis_persistence(cfg)]


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
            from tokengate.install.files import owner_name
            return f"{p} ({st.st_mode & 0o777:o} {owner_name(st.st_uid, st.st_gid)})"
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
        body = fetch.request("GET", f"http://{listen}/metrics", timeout_s=timeout_s).raw
    except fetch.Unreachable as e:
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
        status, follows = ledger_follows(listen, timeout_s)
    except fetch.Unreachable as e:
        return [Check("ledger", str(f), what, "FAIL", f"the ledger's metrics port {listen} "
                      f"does not answer ({e}): is tokengate-ledger running? (systemctl "
                      "status tokengate-ledger)") for f in files]
    if status != 200:
        return [Check("ledger", str(f), what, "FAIL", f"the running ledger answers GET "
                      f"/status on {listen} with {status}: it is an earlier release "
                      "(systemctl restart tokengate-ledger)") for f in files]
    followed = {p.resolve() for p in follows}
    return [Check("ledger", str(f), what, "OK", "the running ledger follows it")
            if Path(f).resolve() in followed else
            Check("ledger", str(f), what, "FAIL", (
                "the running ledger does not follow it: its replica's requests are billed "
                "with the edge's numbers (systemctl restart tokengate-ledger; it follows "
                f"{', '.join(sorted(map(str, followed))) or 'no engine file'})"))
            for f in files]

