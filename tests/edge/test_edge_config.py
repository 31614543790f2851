"""The edge's configuration: the compiled form of tokengate.yaml, and the Debian drop-in
include set (up to date with its template, accepted by `nginx -t` in a Debian-shaped
configuration)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from tokengate import config as tg_config
from tokengate.config import ConfigError
from tokengate.tools import compile_config, nginx_conf
from tokengate_dev import devstack

from tests.conftest import MODEL

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit


def compiled(config_path: Path, tmp_path: Path, edit: Any = None) -> dict[str, Any]:
    raw = yaml.safe_load(config_path.read_text())
    if edit:
        edit(raw)
    path = tmp_path / "tokengate.yaml"
    path.write_text(yaml.safe_dump(raw))
    return compile_config.compile_config(tg_config.load(path))


def test_compiled_config_has_models_keys_and_special_tokens(config_path: Path,
                                                            tmp_path: Path) -> None:
    doc = compiled(config_path, tmp_path)
    m = doc["models"][MODEL]
    assert (m["max_model_len"], m["output_reserve"], m["max_tokens_cap"]) == (8192, 256, 4096)
    [r] = m["upstreams"]
    assert r["addr"] == "127.0.0.1" and isinstance(r["port"], int)
    # every special token of the model's tokenizer, longest first; added tokens that are
    # not special (<think>, <tool_call>) are the template's structural tokens, listed apart
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_pad|>"} <= \
        set(m["special_tokens"])
    assert "<think>" not in m["special_tokens"] and "<think>" in m["structural_tokens"]
    assert m["special_tokens"] == sorted(m["special_tokens"], key=lambda s: (-len(s), s))
    demo = doc["keys"]["e7aab4b439baa8c615eb31e352f5b4259085813fbcd95a65a5a346a6bdfb1bb3"]
    assert (demo["id"], demo["rpm"], demo["tpm"]) == ("demo", 600, 200000)
    assert doc["edge"]["on_counter_failure"] == "open"
    assert doc["edge"]["special_tokens"] == "escape"


@pytest.mark.parametrize("field,value,message", [
    ("on_counter_failure", "maybe",
     "edge.on_counter_failure: input should be 'open' or 'closed', got 'maybe'"),
    ("special_tokens", "ignore",
     ("edge.special_tokens: input should be 'escape', 'reject', 'strip' or 'allow', got "
      "'ignore'")),
    ("max_body_bytes", 10,
     "edge.max_body_bytes: input should be greater than or equal to 1024, got 10"),
    ("special_token_roles", "user", "edge.special_token_roles: input should be a valid list"),
    ("special_token_roles", ["usr"], "edge.special_token_roles.0: input should be 'system', "),
    ("status_listen", "0.0.0.0:8081",
     ("edge.status_listen: expected a loopback address (127.0.0.1:PORT, [::1]:PORT), "
      "got '0.0.0.0:8081'")),
    ("status_listen", "127.0.0.1:8080", "edge.status_listen: 127.0.0.1:8080 is also edge.listen"),
    ("auth_failures", {"exempt": ["10.0.0.1/8"]},
     ("edge.auth_failures.exempt.0: expected an address or CIDR network (10.0.0.0/8, "
      "2001:db8::/32): 10.0.0.1/8 has host bits set")),
    ("auth_failures", {"treshold": 5}, "edge.auth_failures.treshold: unknown key"),
])
def test_bad_edge_settings_name_the_field(config_path: Path, tmp_path: Path, field: str,
                                          value: Any, message: str) -> None:
    def edit(raw: dict[str, Any]) -> None:
        raw.setdefault("edge", {})[field] = value
    with pytest.raises(ConfigError, match=re.escape(message)):
        compiled(config_path, tmp_path, edit)


def test_exempt_networks_are_compiled_to_the_bytes_the_edge_compares(
        config_path: Path, tmp_path: Path) -> None:
    def edit(raw: dict[str, Any]) -> None:
        raw["edge"]["auth_failures"] = {"exempt": ["10.1.0.0/16", "192.0.2.7", "2001:db8::/33"]}
    af = compiled(config_path, tmp_path, edit)["edge"]["auth_failures"]
    assert af["exempt"] == ["10.1.0.0/16", "192.0.2.7/32", "2001:db8::/33"]
    assert af["exempt_networks"] == [["0a010000", 16], ["c0000207", 32],
                                     ["20010db8" + "0" * 24, 33]]
    assert (af["threshold"], af["window_s"], af["block_s"], af["log_lines_per_s"]) == \
        (100, 60, 60, 10)


def test_debian_dropin_is_rendered_from_the_template() -> None:
    hint = "run: python -m tokengate.tools.nginx_conf debian --templates nginx"
    dropin = nginx_conf.debian_conf(devstack.NGINX_DIR)
    assert dropin.read_text() == nginx_conf.render_debian(devstack.NGINX_DIR), hint
    snippet = nginx_conf.debian_location_conf(devstack.NGINX_DIR)
    assert snippet.read_text() == nginx_conf.render_debian_location(devstack.NGINX_DIR), hint


def test_debian_dropin_passes_nginx_t(config_path: Path, tmp_path: Path) -> None:
    # A Debian-shaped nginx.conf (modules, http { conf.d; server { snippet } }) with the
    # drop-in's absolute paths pointed at this checkout.
    edge_json = tmp_path / "edge.json"
    compile_config.write(config_path, edge_json)
    dropin = nginx_conf.debian_conf(devstack.NGINX_DIR).read_text() \
        .replace("/usr/share/tokengate/lua", str(devstack.LUA_DIR)) \
        .replace("/etc/tokengate/edge.json", str(edge_json)) \
        .replace("/run/tokengate/", f"{tmp_path}/")
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "tokengate.conf").write_text(dropin)
    snippet = nginx_conf.debian_location_conf(devstack.NGINX_DIR).read_text() \
        .replace("/var/lib/tokengate/usage/", f"{tmp_path}/") \
        .replace("/var/log/tokengate/", f"{tmp_path}/")
    (tmp_path / "tokengate-location.conf").write_text(snippet)
    temp = "\n".join(f"    {k}_temp_path {tmp_path}/{k};"
                     for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (tmp_path / "nginx.conf").write_text(f"""
load_module /usr/lib/nginx/modules/ndk_http_module.so;
load_module /usr/lib/nginx/modules/ngx_http_lua_module.so;
pid {tmp_path}/nginx.pid;
events {{}}
http {{
{temp}
    include {tmp_path}/conf.d/*.conf;
    server {{
        listen 127.0.0.1:1;
        include {tmp_path}/tokengate-location.conf;
    }}
}}
""")
    r = subprocess.run(["nginx", "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"),
                        "-e", "stderr"], check=False, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    assert "test is successful" in r.stderr
