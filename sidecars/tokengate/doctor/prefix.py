"""The checks of an upstream of a model routed by the prefix cache (``routing.policy:
prefix``): the replica hashes KV-cache blocks as the counter does.

    prefix_cache  the labels of vLLM's ``vllm:cache_config_info`` on ``GET /metrics``:
                  prefix caching on, ``block_size`` and ``prefix_caching_hash_algo`` as
                  ``routing`` says (else the counter's block hashes never match the
                  replica's)
    kv_events     (a replica of ``routing.kv_events``) a ZMQ subscriber connects to its
                  publisher, a completions probe of a fresh random prompt of two blocks
                  and a token (token ids, one generated token) is sent, and a
                  ``BlockStored`` event of it must carry the counter's hashes of those
                  blocks within ``KV_EVENTS_WAIT_S``: the endpoint, the events and the
                  seed (``routing.hash_seed``, which no route shows) are checked at once
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokengate import config as tg_config
from tokengate.doctor import fetch
from tokengate.doctor.check import Check, Status
from tokengate.ledger.engine_record import DOCTOR_PROBE_PREFIX

if TYPE_CHECKING:  # imported where used: it loads transformers, slow for other commands
    from tokengate.counter.counting import ModelCounter

KV_EVENTS_WAIT_S = 10.0  # how long the kv_events probe waits to connect, then for its event
# vllm:cache_config_info's labels (vllm/config/cache.py CacheConfig.metrics_info)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def prefix_cache(check: Callable[[str, Status, str], Check], model: tg_config.ModelConfig,
                 base: str, timeout_s: float) -> Check:
    """The ``prefix_cache`` check of the upstream at ``base`` (module docstring); raises
    ``fetch.Unreachable`` when it does not answer."""
    what, routing = "prefix_cache", model.routing
    where = f"models.{model.name}.routing"
    a = fetch.request("GET", base + "/metrics", timeout_s=timeout_s)
    if a.status != 200:
        return check(what, "FAIL", f"GET /metrics: HTTP {a.status}")
    text = a.raw.decode("utf-8", "replace")
    line = next((x for x in text.splitlines() if x.startswith("vllm:cache_config_info{")), None)
    if line is None:
        return check(what, "FAIL", "GET /metrics has no vllm:cache_config_info: is this a "
                                   "vLLM server? prefix routing needs its block size and "
                                   "hash algorithm")
    labels = dict(_LABEL.findall(line[:line.rfind("}")]))
    wrong = []
    if labels.get("enable_prefix_caching") != "True":
        wrong.append(f"prefix caching is off (enable_prefix_caching "
                     f"{labels.get('enable_prefix_caching')}): start vLLM with "
                     "--enable-prefix-caching, or set the policy to least_outstanding")
    if labels.get("block_size") != str(routing.block_size):
        wrong.append(f"its --block-size is {labels.get('block_size')}, {where}.block_size "
                     f"is {routing.block_size}")
    if labels.get("prefix_caching_hash_algo") != routing.hash_algo:
        wrong.append(f"its --prefix-caching-hash-algo is "
                     f"{labels.get('prefix_caching_hash_algo')}, {where}.hash_algo is "
                     f"{routing.hash_algo}")
    if wrong:
        return check(what, "FAIL", "; ".join(wrong) + ": the counter's block hashes would "
                                   "never match the replica's")
    return check(what, "OK", f"prefix caching on, blocks of {routing.block_size} tokens, "
                             f"{routing.hash_algo} hashes, as {where} says")


def kv_events(check: Callable[[str, Status, str], Check], model: tg_config.ModelConfig,
              base: str, endpoint: str, counter: ModelCounter | str,
              timeout_s: float) -> Check:
    """The ``kv_events`` check of the upstream at ``base`` whose publisher is
    ``endpoint`` (module docstring): the probe's ``BlockStored`` hashes
    against the counter's, compared by ``kv_index.key_of`` (vLLM publishes 32-byte
    hashes or, by default, their low 64 bits as integers)."""
    import secrets

    import msgspec
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from tokengate import prefix_hash
    from tokengate.counter import kv_index
    from tokengate.counter.errors import BadRequest

    what = "kv_events"
    if isinstance(counter, str):
        return check(what, "FAIL", f"the counter cannot load models.{model.name}.dir: "
                                   f"{counter}")
    bs = model.routing.block_size
    vocab = counter.tokenizer.vocab_size
    # a prompt no cache holds yet: its blocks are stored (and published) by this probe
    prompt = [1000 + secrets.randbelow(max(vocab - 2000, 1)) for _ in range(2 * bs + 1)]
    try:
        reply = counter.count("completions", {"model": model.name, "prompt": prompt})
    except BadRequest as e:
        return check(what, "FAIL", f"the counter refused the probe: {e}")
    full = prefix_hash.block_hashes(prompt, bs, model.routing.hash_algo,
                                    model.routing.hash_seed)
    if reply.block_hashes != b"".join(h[:prefix_hash.PREFIX_BYTES] for h in full):
        return check(what, "FAIL", "the counter's block hashes are not prefix_hash's: a "
                                   "bug, report it")
    want = [kv_index.key_of(h) for h in full]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sub.connect(endpoint)
        if not monitor.poll(int(KV_EVENTS_WAIT_S * 1000)):
            return check(what, "FAIL", f"nothing listens on {endpoint} after "
                                       f"{KV_EVENTS_WAIT_S:g} s: start vLLM with "
                                       "--kv-events-config '{\"enable_kv_cache_events\": "
                                       "true, \"publisher\": \"zmq\", \"endpoint\": "
                                       f"\"tcp://*:{endpoint.rpartition(':')[2]}\"}}'")
        recv_monitor_message(monitor)
        time.sleep(0.3)  # the subscription reaches the publisher (a SUB misses the rest)
        a = fetch.request("POST", base + "/v1/completions",
                          {"model": model.name, "prompt": prompt, "max_tokens": 1},
                          timeout_s, {"X-Request-Id": f"{DOCTOR_PROBE_PREFIX}{uuid.uuid4().hex}"})
        if a.status != 200:
            return check(what, "FAIL", f"the completions probe got {fetch.why(a)}")
        decode = msgspec.msgpack.Decoder(kv_index.EventBatch).decode
        event = msgspec.msgpack.Decoder(kv_index.Event).decode
        seen = 0
        deadline = time.monotonic() + KV_EVENTS_WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            if not sub.poll(int(left * 1000)):
                break
            frames = sub.recv_multipart()
            seen += 1
            try:
                raws = decode(frames[-1]).events if len(frames) == 3 else []
            except msgspec.DecodeError:
                continue
            for raw in raws:
                try:
                    ev = event(raw)
                except msgspec.DecodeError:
                    continue
                # the probe's first block, whatever hashes it came with
                if not isinstance(ev, kv_index.BlockStored) or ev.token_ids[:bs] != prompt[:bs]:
                    continue
                try:
                    theirs = [kv_index.key_of(h) for h in ev.block_hashes]
                except ValueError:
                    theirs = []
                if theirs[:2] == want:
                    return check(what, "OK", f"{endpoint} published the probe's 2 blocks "
                                             "with the counter's hashes")
                return check(what, "FAIL", f"{endpoint} published the probe's blocks with "
                                           "other hashes than the counter's: is "
                                           f"models.{model.name}.routing.hash_seed the "
                                           "replica's PYTHONHASHSEED (null: none set)?")
        why = f"{seen} message(s), none about the probe" if seen else "no event"
        return check(what, "FAIL", f"{why} from {endpoint} within {KV_EVENTS_WAIT_S:g} s of "
                                   "the probe: is this the endpoint of this replica's "
                                   "--kv-events-config?")
    finally:
        sub.disable_monitor()
        monitor.close(0)
        sub.close(0)
        ctx.term()
