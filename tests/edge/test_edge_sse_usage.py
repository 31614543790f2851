"""How the edge reads usage from a stream as it passes (tokengate.usage.sse), in the edge's
own LuaJIT: events split across body-filter chunks, the per-chunk usage removed for a
client that did not ask for it, the final usage chunk dropped or kept, and the text that
is not an event the edge reads ("data:" without a space, CRLF separators, a last event
without its blank line) passed on untouched. The usage object is what Lua's
'"usage":%s*(%b{})' finds (braces counted, strings not parsed), and the removal is what
gsub(event, ',%s*"usage":%s*%b{}', "", 1) does: a byte scan replaced those patterns, and
the last test checks it against them on generated events.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.fixtures_edge import run_lua

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit

RUNNING = ('data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}],'
           '"usage":{"prompt_tokens":9,"total_tokens":11,"completion_tokens":2}}')
FINAL = ('data: {"id":"c","choices":[],"usage":{"prompt_tokens":9,"total_tokens":12,'
         '"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}}}')
STRIPPED = 'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}]}'


def sse(chunks: list[str], want_usage: bool = False, want_continuous: bool = False
        ) -> dict[str, Any]:
    """The text usage.sse passes on for each chunk (the last one at eof) and the ctx
    fields it leaves."""
    out = run_lua(f"""
        local usage = require "tokengate.usage"
        local cjson = require "cjson"
        local chunks = cjson.decode({json.dumps(json.dumps(chunks))})
        local ctx = {{ want_usage = {str(want_usage).lower()},
                      want_continuous = {str(want_continuous).lower()},
                      api = require "tokengate.apis.chat" }}
        local sent = {{}}
        for i = 1, #chunks do
            sent[i] = usage.sse(ctx, chunks[i], i == #chunks)
        end
        return cjson.encode({{ sent = sent, prompt = ctx.u_prompt or cjson.null,
            completion = ctx.u_completion or cjson.null, cached = ctx.u_cached or cjson.null,
            source = ctx.u_source or cjson.null, done = ctx.sse_done or false,
            error = ctx.error or cjson.null }})""")
    return json.loads(out)


def test_running_usage_is_read_and_removed_for_a_client_that_did_not_ask() -> None:
    got = sse([RUNNING + "\n\n", FINAL + "\n\n", "data: [DONE]\n\n"])
    assert got["sent"] == [STRIPPED + "\n\n", "", "data: [DONE]\n\n"]
    assert (got["prompt"], got["completion"], got["cached"], got["source"], got["done"]) == \
        (9, 3, 4, "final", True)


def test_include_usage_keeps_the_final_chunk_and_continuous_keeps_every_one() -> None:
    only_final = sse([RUNNING + "\n\n" + FINAL + "\n\n"], want_usage=True)
    assert only_final["sent"] == [STRIPPED + "\n\n" + FINAL + "\n\n"]
    every = sse([RUNNING + "\n\n" + FINAL + "\n\n"], want_usage=True, want_continuous=True)
    assert every["sent"] == [RUNNING + "\n\n" + FINAL + "\n\n"]


def test_an_event_split_across_chunks_is_held_until_its_end() -> None:
    event = RUNNING + "\n\n"
    got = sse([event[:20], event[20:95], event[95:-1], event[-1:], "data: [DONE]\n\n"])
    assert got["sent"] == ["", "", "", STRIPPED + "\n\n", "data: [DONE]\n\n"]
    assert (got["prompt"], got["completion"], got["source"]) == (9, 2, "running")


def test_a_client_that_left_is_billed_the_last_running_usage() -> None:
    got = sse([RUNNING + "\n\n", RUNNING.replace(":2}", ":5}")[:60]])
    assert got["sent"] == [STRIPPED + "\n\n", RUNNING.replace(":2}", ":5}")[:60]]
    assert (got["completion"], got["source"]) == (2, "running")


def test_usage_null_then_an_object_and_whitespace_around_it() -> None:
    ev = ('data: {"usage": null,"choices":[{"delta":{}}] ,\n "usage":\t{ "prompt_tokens": 7,'
          ' "completion_tokens":\n1 }}')
    got = sse([ev + "\n\n"])
    assert got["sent"] == ['data: {"usage": null,"choices":[{"delta":{}}] }\n\n']
    assert (got["prompt"], got["completion"], got["source"]) == (7, 1, "running")


def test_braces_are_counted_inside_strings_as_the_pattern_counts_them() -> None:
    # vLLM never writes braces inside usage; the object ends where the braces balance
    ev = ('data: {"choices":[{"delta":{"content":"{\\"}"}}],'
          '"usage":{"prompt_tokens":3,"note":"}","completion_tokens":8}}')
    got = sse([ev + "\n\n"])
    assert got["sent"] == [('data: {"choices":[{"delta":{"content":"{\\"}"}}]'
                           '","completion_tokens":8}}\n\n')]
    assert (got["prompt"], got["completion"]) == (3, 0)


def test_what_is_not_an_event_the_edge_reads_passes_untouched() -> None:
    no_space = RUNNING.replace("data: ", "data:", 1) + "\n\n"
    crlf = RUNNING + "\r\n\r\n"
    assert sse([no_space])["sent"] == [no_space]
    assert sse([no_space])["source"] is None
    got = sse([crlf, crlf])  # no "\n\n": held, then sent as it came at eof
    assert got["sent"] == ["", crlf + crlf] and got["source"] is None
    last = sse([RUNNING + "\n\n", FINAL])  # a last event without its blank line
    assert last["sent"] == [STRIPPED + "\n\n", FINAL]
    assert (last["completion"], last["source"]) == (2, "running")


def test_an_unbalanced_usage_object_is_passed_over() -> None:
    ev = 'data: {"usage":{"prompt_tokens":1,"choices":[{"delta":{}}],"usage":{"prompt_tokens":4}'
    got = sse([ev + "\n\n"])
    assert got["sent"] == ['data: {"usage":{"prompt_tokens":1,"choices":[{"delta":{}}]\n\n']
    assert (got["prompt"], got["completion"]) == (4, 0)


def test_an_error_event_names_its_code() -> None:
    got = sse([('data: {"error":{"object":"error","message":"m","type":"BadRequestError",'
               '"code":400}}\n\n'), 'data: {"error":{"code":"later"}}\n\n'])
    assert got["error"] == "BadRequestError"


def test_the_scan_finds_what_the_patterns_find() -> None:
    # generated events, split at random, through usage.sse and through the patterns it
    # replaced (the reference below is the former code)
    out = run_lua(r"""
        local usage = require "tokengate.usage"
        local function reference(ctx, ev)
            if ev:sub(1, 6) ~= "data: " or ev == "data: [DONE]" then
                return ev
            end
            local a = ev:find('"usage":', 7, true)
            if not a then
                return ev
            end
            local u = ev:match('"usage":%s*(%b{})', a)
            if not u then
                return ev
            end
            local final = ev:find('"choices":[]', 7, true) ~= nil
            local p = u:match('"prompt_tokens":%s*(%d+)')
            local c = u:match('"completion_tokens":%s*(%d+)')
            if p or c then
                ctx.p, ctx.c = tonumber(p) or ctx.p or 0, tonumber(c) or 0
            end
            if final then
                return ctx.want_usage and ev or nil
            end
            if ctx.want_usage and ctx.want_continuous then
                return ev
            end
            return (ev:gsub(',%s*"usage":%s*%b{}', "", 1))
        end
        local parts = { "{", "}", "{", "}", ",", " ", "\t", "\r", "\n", '"', '\\"', ":",
            '"usage":', '"usage": ', '"usage":null', '"prompt_tokens":', '"prompt_tokens": ',
            '"completion_tokens":', "12", "3", '"choices":[]', '"choices":[{"delta":{}}]',
            '"content":"}"', '"content":"{"', '"a"', "[", "]" }
        math.randomseed(7)
        local events = {}
        for e = 1, 4000 do
            local t = { math.random(10) == 1 and "data:" or "data: " }
            for _ = 1, math.random(0, 24) do
                t[#t + 1] = parts[math.random(#parts)]
            end
            events[e] = table.concat(t)
        end
        local bad = 0
        for e = 1, #events, 4 do
            local ctx = { want_usage = e % 3 == 0, want_continuous = e % 5 == 0,
                          api = require "tokengate.apis.chat" }
            local ref = { want_usage = ctx.want_usage, want_continuous = ctx.want_continuous }
            local want, stream = {}, {}
            for k = e, e + 3 do
                local ev = events[k]
                while ev:find("\n\n", 1, true) or ev:sub(-1) == "\n" do
                    ev = ev:gsub("\n\n", "\n"):gsub("\n$", "")
                end
                local kept = reference(ref, ev)
                if kept then
                    want[#want + 1] = kept .. "\n\n"
                end
                stream[#stream + 1] = ev .. "\n\n"
            end
            stream = table.concat(stream)
            local got, pos = {}, 1
            while pos <= #stream do
                local n = math.random(1, 40)
                got[#got + 1] = usage.sse(ctx, stream:sub(pos, pos + n - 1),
                    pos + n > #stream)
                pos = pos + n
            end
            if table.concat(got) ~= table.concat(want) or (ctx.u_prompt or -1) ~= (ref.p or -1)
                    or (ctx.u_completion or -1) ~= (ref.c or -1) then
                bad = bad + 1
                if bad == 1 then
                    io.stderr:write(stream, "\n", table.concat(got), "\n", table.concat(want))
                end
            end
        end
        return tostring(bad)""")
    assert out == "0"
