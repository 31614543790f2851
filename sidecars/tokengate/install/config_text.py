"""The configuration files an install writes, as text: settings set in an operator's
YAML with every comment kept, the settings a release needs that an earlier file lacks
(``NEEDED``), the file made for a host, and a vLLM replica's environment file."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tokengate import config as tg_config
from tokengate.install.host import GROUP, HOST_EDGE_LISTEN, HOST_REDIS_URL, USER, InstallError

_PLAIN = re.compile(r"[A-Za-z0-9_./@+-]+")


def _scalar(value: str) -> str:
    return value if _PLAIN.fullmatch(value) else json.dumps(value)


def _get(node: yaml.Node, key: str) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode) and k.value == key:
                return v
    return None


def _is_off(node: yaml.Node) -> bool:
    """A plain false / null / empty scalar: the setting is off (access_log.file: false)."""
    return isinstance(node, yaml.ScalarNode) and node.style is None and \
        node.value.lower() in ("", "~", "null", "false", "no", "off")


def _block(node: yaml.Node) -> bool:
    """A mapping install can edit: block style, with at least one key (its first key's
    column is where a new key goes)."""
    return isinstance(node, yaml.MappingNode) and not node.flow_style and bool(node.value)


def _set(text: str, keys: tuple[str, ...], value: str, mode: str = "set",
         keep_off: bool = False) -> tuple[str, str | None]:
    """``text`` with the setting at ``keys`` (block mappings from the top level down,
    e.g. ``("ledger", "console", "changes_dir")``) given ``value`` (a scalar), every
    comment and all other text kept, and a problem line or None. ``mode``: ``set`` adds
    a missing setting and replaces one that is there, ``replace`` only replaces, ``add``
    only adds. A missing setting goes first in its mapping, with the mappings it needs;
    a missing top-level section at the end of the file. A setting replaced keeps the rest
    of its line, a comment naming the old path naming the new one; ``keep_off`` leaves a
    setting that is off (``false``, null). The problem: a mapping on the way written in
    a form install cannot edit (flow style, empty), or a value that is not a scalar."""
    root = yaml.compose(text)
    if not isinstance(root, yaml.MappingNode):
        return text, "(top level): expected a mapping of sections"
    dotted = ".".join(keys)
    node: yaml.Node = root
    for depth, key in enumerate(keys):
        child = _get(node, key)
        if child is None:
            if mode == "replace":
                return text, None
            lines = [f"{key}:" for key in keys[depth:]]
            lines[-1] += f" {_scalar(value)}"
            if node is root:
                out = text if text.endswith("\n") or not text else text + "\n"
                return out + "\n" + "".join(f"{'  ' * i}{line}\n"
                                             for i, line in enumerate(lines)), None
            first = node.value[0][0].start_mark
            at = first.index - first.column
            new = "".join(f"{' ' * (first.column + 2 * i)}{line}\n"
                          for i, line in enumerate(lines))
            return text[:at] + new + text[at:], None
        if depth == len(keys) - 1:
            if mode == "add" or (keep_off and _is_off(child)):
                return text, None
            if not isinstance(child, yaml.ScalarNode):
                return text, f"{dotted}: expected a path"
            end = text.find("\n", child.end_mark.index)
            end = len(text) if end < 0 else end
            rest = text[child.end_mark.index:end]
            if "/" in child.value:  # a path, not a word a comment may also use
                rest = rest.replace(child.value, value)
            return text[:child.start_mark.index] + _scalar(value) + rest + text[end:], None
        if not _block(child):
            where = ".".join(keys[:depth + 1])
            return text, (f"{where}: write it as a block mapping (`{key}:` then indented "
                          f"keys) so that install can set {dotted}")
        node = child
    raise AssertionError("unreachable: keys is not empty")


@dataclass(frozen=True)
class Needed:
    """A setting that a release needs in an installed configuration, which a file made
    by an earlier release (or from a ``--config`` file of the operator's) may lack.
    ``tokengate install`` adds it with ``value`` (a path as on a host, moved below
    ``--prefix``) where it is missing, and refuses, naming the file and the key, a file
    where it is off (null, false) or cannot be edited. ``folder``: the value is a
    folder install makes with this mode and owner. The next release that needs a
    setting adds a row to ``NEEDED``."""

    since: str                         # the release from which the units need it
    keys: tuple[str, ...]              # where: ("ledger", "console", "changes_dir")
    value: str                         # on a host (below --prefix under one)
    why: str                           # what fails without it
    folder: tuple[int, tuple[str, str]] | None = None

    @property
    def name(self) -> str:
        return ".".join(self.keys)

    def configured(self, cfg: tg_config.Config) -> Path | None:
        """Its value in ``cfg`` (a path: every row's value is one), None when off."""
        value: Any = cfg
        for key in self.keys:
            value = getattr(value, key)
        return None if value is None else Path(value)


NEEDED = (
    Needed("0.1.0", ("ledger", "console", "changes_dir"), "/var/lib/tokengate/console",
           "the console (tokengate-console) runs as the tokengate user, which can neither "
           "write /etc/tokengate nor signal nginx: it queues each key change there for "
           "root's tokengate-console-apply.path, and without it every change made in the "
           "console fails with Permission denied",
           folder=(0o750, (USER, GROUP))),
)


def add_needed(text: str, root: Path, where: Path) -> tuple[str, list[Needed], list[str]]:
    """``text`` (the configuration ``where``, installed below ``root``) with every
    ``NEEDED`` setting it lacks added, comments and all other text kept; the rows
    added; and one problem line per row it cannot apply (the setting is off, or a
    mapping on its way is written in a form install cannot edit), naming the file and
    the key."""
    added: list[Needed] = []
    problems: list[str] = []
    try:
        yaml.compose(text)
    except yaml.YAMLError:
        return text, added, problems  # not YAML: the loader names the line
    for row in NEEDED:
        value = str(root / row.value.lstrip("/"))
        node: yaml.Node | None = yaml.compose(text)
        for key in row.keys:
            node = _get(node, key) if node is not None else None
        if node is not None and _is_off(node):
            problems.append(f"{where}: {row.name} is {node.value or 'empty'}: set it to "
                            f"{value} (tokengate {row.since} needs it: {row.why})")
            continue
        if node is not None:
            continue
        text, problem = _set(text, row.keys, value, "add")
        if problem is not None:
            problems.append(f"{where}: {problem} (tokengate {row.since} needs it: {row.why})")
        else:
            added.append(row)
    return text, added, problems


def deploy_config_text(text: str, base: Path, paths: dict[str, Path]) -> str:
    """The configuration ``text`` (from a file in ``base``) as installed: the paths the
    drop-in fixes set (ledger.usage_file, edge.usage_file where given, access_log.file
    and global_limits.unix_socket unless off) and relative model dirs made absolute,
    every comment and all other text kept. Raises ``InstallError`` for a section written
    in a form it cannot edit (flow style, empty)."""
    if not isinstance(yaml.compose(text), yaml.MappingNode):
        raise InstallError(["(top level): expected a mapping of sections"])
    problems: list[str] = []
    for keys, value, mode, keep_off in (
            (("ledger", "usage_file"), paths["usage_file"], "set", False),
            (("edge", "usage_file"), paths["usage_file"], "replace", False),
            (("access_log", "file"), paths["access_log"], "set", True),
            (("global_limits", "unix_socket"), paths["limits_socket"], "set", True)):
        text, problem = _set(text, keys, str(value), mode, keep_off)
        if problem is not None:
            problems.append(problem)
    models = _get(yaml.compose(text), "models")
    edits = []
    if isinstance(models, yaml.MappingNode):
        for _name, model in models.value:
            d = _get(model, "dir")
            if isinstance(d, yaml.ScalarNode) and d.value and not Path(d.value).is_absolute():
                edits.append((d.start_mark.index, d.end_mark.index,
                              _scalar(str((base / d.value).resolve()))))
    if problems:
        raise InstallError(problems)
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def header(source: Path) -> str:
    return (f"# Installed by `tokengate install` from {source}: ledger.usage_file,\n"
            "# access_log.file and global_limits.unix_socket set to the Debian drop-in's\n"
            "# paths, relative paths made absolute. Install never overwrites this file;\n"
            "# run it again after editing (it recompiles edge.json), then `nginx -s reload`.\n")


def check_paths(cfg: tg_config.Config, paths: dict[str, Path], where: Path) -> list[str]:
    """Lines for every path of ``cfg`` that disagrees with the drop-in's."""
    bad = []
    if cfg.edge.usage_file != paths["usage_file"]:
        bad.append(f"{where}: ledger.usage_file (and edge.usage_file) must be "
                   f"{paths['usage_file']}, the file the drop-in's snippet writes; it is "
                   f"{cfg.edge.usage_file}")
    if cfg.access_log.file is not None and cfg.access_log.file != paths["access_log"]:
        bad.append(f"{where}: access_log.file must be {paths['access_log']} (or false), "
                   f"the file the drop-in's snippet writes; it is {cfg.access_log.file}")
    return bad


def host_config_text(template: str, model: str, model_dir: Path, max_model_len: int,
                     upstreams: tuple[str, ...], engine_dir: Path,
                     redis_url: str = HOST_REDIS_URL,
                     edge_listen: str = HOST_EDGE_LISTEN) -> str:
    """The configuration made for a host (systemd/tokengate.host.yaml.in filled in): one
    model with its directory, context length and upstreams, the engine record file of
    each loopback upstream (``tokengate-vllm@PORT`` writes ``engine_dir``/PORT.jsonl,
    /var/lib/tokengate/engine on a host), ``redis.url`` and ``edge.listen``; the schema
    checks the values."""
    engine = [_scalar(str(engine_dir / f"{u.rpartition(':')[2]}.jsonl")) for u in upstreams
              if tg_config._is_loopback(u)]
    return (template.replace("@MODEL@", _scalar(model))
            .replace("@MODEL_DIR@", _scalar(str(model_dir.absolute())))
            .replace("@MAX_MODEL_LEN@", str(max_model_len))
            .replace("@REDIS_URL@", _scalar(redis_url))
            .replace("@EDGE_LISTEN@", _scalar(edge_listen))
            .replace("@UPSTREAMS@", "\n".join(f"      - {_scalar(u)}" for u in upstreams))
            .replace("@ENGINE_FILES@", "".join(f"\n    - {e}" for e in engine) or " []"))


def vllm_env_text(example: str, cfg: tg_config.Config) -> str:
    """``systemd/vllm.env.example`` with the first configured model's settings: its
    directory, served name and ``max_model_len`` (tokens) in the three
    ``TOKENGATE_VLLM_*`` lines, so a copy serves what ``tokengate.yaml`` expects."""
    if not cfg.models:
        return example
    name, model = next(iter(cfg.models.items()))
    values = {"TOKENGATE_VLLM_MODEL": str(model.dir),
              "TOKENGATE_VLLM_SERVED_MODEL_NAME": name,
              "TOKENGATE_VLLM_MAX_MODEL_LEN": str(model.max_model_len)}
    lines = []
    for line in example.splitlines():
        key = line.partition("=")[0]
        lines.append(f"{key}={values[key]}" if key in values else line)
    return "\n".join(lines) + "\n"
