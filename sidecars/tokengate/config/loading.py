"""Finding, reading, validating and writing ``tokengate.yaml``: ``discover`` (which
file), ``read_text`` (its UTF-8 text, else ``NotText``), ``load``/``loads``/``parse``
(YAML to ``Config``), ``ConfigError`` and ``errors_of`` (one line per problem, each
naming its key), ``write_atomic`` and ``check_model_dirs`` (the models' files, for what
reads them)."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tokengate.config.schema import Config
from tokengate.config.types import _Rules

CONFIG_ENV = "TOKENGATE_CONFIG"
SYSTEM_CONFIG = Path("/etc/tokengate/tokengate.yaml")


class ConfigError(ValueError):
    """The configuration is invalid. ``errors``: one message per problem, each
    ``<dotted.path>: <what is wrong>``; ``str()`` joins them with newlines."""

    def __init__(self, errors: str | list[str]) -> None:
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def errors_of(err: ValidationError) -> list[str]:
    """pydantic's errors as ``<dotted.path>: <message>`` lines, in the file's order."""
    out = []
    for e in err.errors(include_url=False):
        loc = ".".join(str(p) for p in e["loc"])
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, _Rules):
            out += [f"{loc + '.' if loc else ''}{p}: {m}" for p, m in cause.problems]
            continue
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required"
        elif isinstance(cause, ValueError):
            msg = str(cause)
        else:
            msg = f"{e['msg'][:1].lower()}{e['msg'][1:]}, got {_short(e['input'])}"
        out.append(f"{loc or '(top level)'}: {msg}")
    return out


class _Loader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML keeps the last
    silently, which hides an edit as well as a typo does) and reads every plain
    scalar key as its text. Every mapping of the file is keyed by names (models, keys,
    priorities), and PyYAML reads YAML 1.1, where a key ``yes``, ``no``, ``on`` or
    ``off`` is a boolean, ``1_000`` an integer and ``null`` nothing: a key id the
    rules allow was refused ("input should be a valid string, got True")."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.style is None \
                    and key_node.tag != "tag:yaml.org,2002:str" \
                    and not key_node.tag.startswith("tag:yaml.org,2002:merge"):
                key_node.tag = "tag:yaml.org,2002:str"
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                again = key in seen
                seen.add(key)
            except TypeError:  # unhashable: the base class says so
                continue
            if again:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
        return super().construct_mapping(node, deep)


def _installed() -> bool:
    """Whether ``SYSTEM_CONFIG`` is there. A folder this user may not enter
    (/etc/tokengate is 0750 root:www-data) counts as there: reading it then fails with
    a clear error instead of a checkout's file being used in its place."""
    try:
        os.stat(SYSTEM_CONFIG)
    except PermissionError:
        return True
    except OSError:
        return False
    return True


# The lookup discover() makes, for the --config help of every command.
LOOKUP_HELP = ("default: $TOKENGATE_CONFIG, else the installed "
               "/etc/tokengate/tokengate.yaml, else ./tokengate.yaml")


def discover(given: str | os.PathLike[str] | None = None) -> tuple[Path, str]:
    """The configuration a command acts on, and why that one: ``given`` (``--config``),
    else ``$TOKENGATE_CONFIG``, else the installed ``/etc/tokengate/tokengate.yaml``
    when it exists (a host with an install: a checkout's file is used only when asked
    for), else ``./tokengate.yaml`` of the current directory (``make run``), else the
    installed path (which then does not load: ``OSError`` naming it).

    Returns (path, reason), the reason a phrase for the line a command prints about
    it. ``SYSTEM_CONFIG`` is read at each call (tests point it at a folder of theirs)."""
    if given is not None:
        return Path(given), "given"
    env = os.environ.get(CONFIG_ENV)
    if env:
        return Path(env), f"from ${CONFIG_ENV}"
    if _installed():
        return SYSTEM_CONFIG, "the installed configuration; --config FILE for another"
    local = Path("tokengate.yaml")
    if local.is_file():
        return local, f"./tokengate.yaml: no {SYSTEM_CONFIG} on this host"
    return SYSTEM_CONFIG, f"no ./tokengate.yaml and no ${CONFIG_ENV}"


def default_path() -> Path:
    """The file ``load()`` reads without an argument (``discover()``'s choice)."""
    return discover()[0]


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Replace the file ``path`` with ``data`` in one rename in its folder, so a reader
    (nginx reloading, a sidecar's SIGHUP) sees the old file or the new one, never half.

    The new file keeps the replaced one's owner, group and mode: on an install
    tokengate.yaml and edge.json are ``root:www-data 0640`` and the services read them
    through that group, so a file written by root with root's group would lock them
    out. A file that did not exist gets 0666 less the umask, as ``open()`` gives. A
    symbolic link is followed (its target is replaced). Raises ``OSError``, also when
    the owner cannot be kept (only root may give a file away): nothing is replaced."""
    target = Path(os.path.realpath(path))
    try:
        old: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        old = None
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        if old is None:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        else:
            mine = os.stat(tmp)
            if (mine.st_uid, mine.st_gid) != (old.st_uid, old.st_gid):
                try:
                    os.chown(tmp, old.st_uid, old.st_gid)
                except PermissionError as e:
                    raise PermissionError(
                        e.errno, f"cannot keep its owner and group (uid {old.st_uid}, gid "
                        f"{old.st_gid}): run as root or as its owner; not changed",
                        str(target)) from None
            os.chmod(tmp, stat.S_IMODE(old.st_mode))  # after chown, which clears set-id bits
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def parse(raw: Any, path: Path) -> Config:
    """Validate ``raw`` (the YAML's data) as the file ``path`` (relative paths resolve
    against its folder). Raises ``ConfigError``."""
    if not isinstance(raw, dict):
        raise ConfigError(f"(top level): expected a mapping of sections, got {_short(raw)}")
    path = path.resolve()
    try:
        return Config.model_validate(raw, context={"base": path.parent, "path": path})
    except ValidationError as e:
        raise ConfigError(errors_of(e)) from None


def loads(text: str, path: Path) -> Config:
    """Validate ``text``, the YAML of the file ``path`` (which need not exist yet: the
    ``tokengate keys`` commands check an edit before writing it). Raises ``ConfigError``."""
    try:
        raw = yaml.load(text, Loader=_Loader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"(yaml):{where}: {problem}") from None
    return parse(raw, path)


class NotText(OSError):
    """The configuration file is not UTF-8 text (YAML's encoding, and the only one
    tokengate writes): a file that cannot be read as a configuration at all. ``str()``
    is one line naming the file and the offset of its first byte that is not UTF-8."""


def read_text(path: str | os.PathLike[str]) -> str:
    """The text of the configuration file ``path``, decoded as UTF-8 whatever the
    locale. Raises ``OSError``: ``NotText`` for bytes that are not UTF-8 (one line:
    ``<path>: not UTF-8 text: byte 0xe2 at offset 1 ...``), not ``UnicodeDecodeError``,
    so that every command refuses such a file as one it cannot read."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NotText(f"{path}: not UTF-8 text: byte 0x{data[e.start]:02x} at offset "
                      f"{e.start} ({e.reason}); tokengate.yaml must be UTF-8") from None


def load(path: str | os.PathLike[str] | None = None) -> Config:
    """Read and validate the configuration file (``default_path()`` when ``path`` is None).

    Raises ``ConfigError`` (one line per problem, each naming its key) or ``OSError``
    (``NotText`` for a file that is not UTF-8).
    """
    p = Path(path if path is not None else default_path()).resolve()
    return loads(read_text(p), p)


def add_config_option(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` on ``parser``: the tokengate.yaml that the command or service
    reads (a Path; None when not given: found as ``LOOKUP_HELP`` says)."""
    parser.add_argument("--config", type=Path, default=None,
                        help=f"tokengate.yaml ({LOOKUP_HELP})")


def load_for_command(path: str | os.PathLike[str] | None, command: str) -> Config | None:
    """``load(path)`` for a command that says why it cannot run: None when the
    configuration does not load, with one line, ``<command>: <why>``, said on stderr
    (the command then ends with exit status 2)."""
    try:
        return load(path)
    except (ConfigError, OSError) as e:
        print(f"{command}: {e}", file=sys.stderr)
        return None


def load_or_exit(parser: argparse.ArgumentParser,
                 path: str | os.PathLike[str] | None = None) -> Config:
    """``load(path)`` for a service's entry point: a configuration that does not load
    ends the process with exit status 2 and one line, ``<prog>: <why>``, on stderr."""
    cfg = load_for_command(path, parser.prog)
    if cfg is None:
        parser.exit(2)
    return cfg


# config.json keys that bound a model's context, as vLLM 0.32 reads them
# (vllm/transformers_utils/model_arch_config_convertor.py, derive_max_model_len_and_key):
# the smallest present one wins, then model_max_length overrides.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                 "model_max_length", "max_target_positions", "max_sequence_length",
                 "max_seq_length", "seq_len")
# RoPE types whose factor vLLM does not apply again (the position count is already scaled)
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn",
                   "deepseek_llama_scaling")


def derived_max_model_len(model_dir: Path) -> tuple[int, str] | None:
    """The longest ``--max-model-len`` (tokens) vLLM accepts for the model in
    ``model_dir``, and the setting that bounds it (``"max_position_embeddings=8192"``),
    read from its ``config.json`` (the text model's, ``text_config``, when nested) and
    ``tokenizer_config.json`` as vLLM 0.32 does in ``vllm/config/model.py``
    (``_get_and_verify_max_len``): the smallest context key, ``model_max_length``
    overriding, capped by the tokenizer's ``model_max_length``, times the RoPE scaling
    factor for RoPE types that are not already scaled. None when the directory has no
    readable ``config.json`` or it names no context key (vLLM then takes the value
    given). A larger value makes vLLM exit at start unless
    ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set."""
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    nested = raw.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else raw
    found = [(v, k) for k in _CONTEXT_KEYS
             if isinstance(v := text.get(k), (int, float)) and not isinstance(v, bool)]
    if not found:
        return None
    limit, key = min(found)
    if isinstance(text.get("model_max_length"), (int, float)) and text["model_max_length"]:
        limit, key = text["model_max_length"], "model_max_length"
    what = f"{key}={int(limit)}"
    try:
        tok = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tok = None
    if isinstance(tok, dict) and isinstance(tok.get("model_max_length"), (int, float)) \
            and tok["model_max_length"] < limit:
        limit = tok["model_max_length"]
        what = f"model_max_length={int(limit)} of tokenizer_config.json"
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if isinstance(rope, dict):
        kind = rope.get("rope_type") or rope.get("type") or "default"
        factor = rope.get("factor")
        if kind not in _PRESCALED_ROPE and isinstance(factor, (int, float)) and factor:
            limit, what = limit * factor, f"{what} x RoPE factor {factor}"
    return int(limit), what


def check_model_dirs(cfg: Config) -> None:
    """Raise ``ConfigError`` with one ``models.<name>.dir: ...`` line for each model
    whose directory the counter cannot load from: missing, not a directory, or without
    ``tokenizer.json`` (which only ``vocab: qwen3.6`` does without); and one
    ``models.<name>.max_model_len: ...`` line for a context above what the model's own
    files allow (``derived_max_model_len``: vLLM would exit at start). Not part of the
    schema, so that a host that only reads the file (the ledger's, the limits') needs no
    model files; what reads the files calls it (the edge's compiler: ``config check``,
    ``config apply``, ``install``, nginx's start)."""
    problems = []
    for name, m in cfg.models.items():
        where = f"models.{name}.dir"
        if not m.dir.exists():
            problems.append(f"{where}: {m.dir} does not exist (the served model's own "
                            "directory: the files vLLM loads)")
        elif not m.dir.is_dir():
            problems.append(f"{where}: {m.dir} is not a directory")
        elif m.vocab != "qwen3.6" and not (m.dir / "tokenizer.json").is_file():
            problems.append(f"{where}: {m.dir} has no tokenizer.json (the counter's "
                            "tokenizer, from the model's own files)")
        else:
            derived = derived_max_model_len(m.dir)
            if derived is not None and m.max_model_len > derived[0]:
                problems.append(
                    f"models.{name}.max_model_len: {m.max_model_len} exceeds what the model "
                    f"allows, {derived[0]} ({derived[1]}, {m.dir}/config.json): vLLM would exit "
                    "at start"
                    )
    if problems:
        raise ConfigError(problems)
