"""``tokengate keys``: create, list, change, rotate, disable and revoke API keys in ``tokengate.yaml``, and
apply the change to the running edges at once (no restart; streams in flight continue).

- ``secret``  a new key (``tg-`` + 43 URL-safe characters, 256 bits) and its SHA-256
  digest, the only thing the file stores
- ``edit``    the round-trip edit of the file (comments, order and layout kept), validated
  and compiled before an atomic write that keeps the file's owner, group and mode
- ``reload``  the edges a file belongs to, their ``edge.json`` written again and their
  nginx reloaded (SIGHUP), waited for
- ``usage``   ``keys list``'s table (the entries are ``tokengate.ledger.admin``'s, what
  the ledger's admin view serves)
- ``cli``     the argparse subcommands (``add_parser``)
"""

from tokengate.keys.cli import (
    KEYS_HELP,
    add_parser,
    create,
    disable,
    enable,
    list_,
    revoke,
    rotate,
    set_,
)
from tokengate.keys.edit import edit, parse_budget, parse_models, shown
from tokengate.keys.reload import (
    NGINX_PID,
    RELOAD_TIMEOUT_S,
    EdgeTarget,
    apply,
    apply_to,
    edge_of,
    find_edges,
    installed_root,
    reload_edge,
)
from tokengate.keys.secret import KEY_PREFIX, digest, new_key

__all__ = ["KEYS_HELP", "KEY_PREFIX", "NGINX_PID", "RELOAD_TIMEOUT_S", "EdgeTarget",
           "add_parser", "apply", "apply_to", "create", "digest", "disable", "edge_of", "edit",
           "enable", "find_edges",
           "installed_root", "list_", "new_key", "parse_budget", "parse_models",
           "reload_edge", "revoke", "rotate", "set_", "shown"]
