-- The agent session a request belongs to: read from the request, bounded and sanitized,
-- never used for authentication (a client names its own sessions; the key decides what
-- it may do). It is written as the usage event's session_id, the ledger keeps totals per
-- (key, session), and a key's optional session_budget refuses a session that spent it.
--
-- Sources, first one present wins (the precedence is a decision, docs/api/sessions.md):
--   1. X-Session-Id                 the generic header: a client or a proxy in front of
--                                   the gateway that names the session on purpose
--   2. X-Claude-Code-Session-Id     Claude Code (one id per `claude` session)
--   3. session-id, conversation_id  Codex CLI: 0.171 sends its thread id as session-id
--                                   (also thread-id, x-client-request-id and the body's
--                                   prompt_cache_key: seen on the wire); older releases
--                                   session_id and conversation_id (codex-rs codex-api
--                                   requests/headers.rs). nginx reads session-id and
--                                   session_id as one variable; names with "_" need
--                                   `underscores_in_headers on` (the location snippet)
--   4. the body's own fields, in the order the request's API module lists them
--      (its SESSION_FIELDS, tokengate.api: default OpenAI's safety_identifier then user);
--      its SESSION_CHAIN field (Responses: previous_response_id) resolves to the session
--      of the answer it continues (kept by this edge, see remember()); an answer this
--      edge does not know names the session itself
-- A value is a session when it is a non-empty string. Printable ASCII (0x20-0x7E) of at
-- most MAX_BYTES bytes is kept as sent; anything else (longer, control characters,
-- other bytes) becomes "sha256:" .. the first 32 hex digits of its SHA-256, so one
-- hostile value is still one session and no byte of it reaches logs or Redis.
--
-- Spend per session (session_budget): kept in the shared dict tokengate_sessions of
-- this edge, settled in the log phase with what the request is billed (atomic incr, no
-- read-modify-write across workers). Bound: a session is refused once its settled total
-- reached the budget, so it ends at most one request's usage above the budget, plus the
-- usage of its requests still in flight when it was reached, per edge: with E edges
-- behind one balancer a session can spend up to E times its budget (the ledger's Redis
-- totals, `tokengate usage --by session`, stay exact).

local ngx = ngx
local digest = require "tokengate.digest"
local errors = require "tokengate.errors"

local type = type
local sub, gsub, find, format = string.sub, string.gsub, string.find, string.format
local tonumber = tonumber
local ngx_var, clear_header, ngx_shared = ngx.var, ngx.req.clear_header, ngx.shared

local _M = {}

_M.MAX_BYTES = 128
local MAX_BYTES = _M.MAX_BYTES
local DICT = "tokengate_sessions"
-- a session's spend is counted for this long after its first request at this edge, s
_M.SPEND_TTL_S = 7 * 86400
-- a response's session is remembered this long for requests that continue it, s
_M.CHAIN_TTL_S = 86400

-- the headers, in order; ngx.var names ($http_x_session_id): nginx turns "-" into "_",
-- so "session-id" and "session_id" read the same variable
local HEADERS = {
    { "http_x_session_id", "x-session-id" },
    { "http_x_claude_code_session_id", "x-claude-code-session-id" },
    { "http_session_id", "session-id" },
    { "http_conversation_id", "conversation_id" },
}

-- clean(s) -> s when it is 1..MAX_BYTES bytes of printable ASCII, else its
-- "sha256:<32 hex>" name; nil for nil or "".
function _M.clean(s)
    if s == nil or s == "" then
        return nil
    end
    if #s <= MAX_BYTES and not find(s, "[^\32-\126]") then
        return s
    end
    return "sha256:" .. sub(digest.sha256_hex(s), 1, 32)
end
local clean = _M.clean

-- field(body, name) -> the body's string at name ("metadata.user_id": one level down),
-- or nil
local function field(body, name)
    local dot = find(name, ".", 1, true)
    local v
    if dot then
        local o = body[sub(name, 1, dot - 1)]
        v = type(o) == "table" and o[sub(name, dot + 1)] or nil
    else
        v = body[name]
    end
    return type(v) == "string" and v ~= "" and v or nil
end

-- chain_key(id) -> the dict key of a response id's session: its edge request id (the
-- 32 hex digits after "resp_", tokengate.apis.responses.response_id), the id itself otherwise
local function chain_key(id)
    return "r:" .. sub(id, 1, 37)
end

-- from_headers(ctx) -> true when a header named the session: sets ctx.session_id and
-- ctx.session_source (the header's name). Read before the body is, so that a request
-- refused for its body still carries its session in the usage event.
-- A session header holding a control character is not forwarded: vLLM's HTTP server
-- refuses the whole request for it ("Invalid HTTP request received"), which the client
-- would see as a backend failure of a request already reserved and counted.
function _M.from_headers(ctx)
    local found = false
    for i = 1, #HEADERS do
        local h = HEADERS[i]
        local v = ngx_var[h[1]]
        if v and v ~= "" then
            if find(v, "[%z\1-\8\10-\31\127]") then
                clear_header(h[2])
                clear_header(gsub(h[2], "-", "_"))
            end
            if not found then
                ctx.session_id, ctx.session_source = clean(v), h[2]
                found = true
            end
        end
    end
    if not found then
        ctx.session_source = false -- looked: no header
    end
    return found
end

-- read(ctx, body): sets ctx.session_id (sanitized, or nil) and ctx.session_source (the
-- header or field it came from). body: the parsed body or nil (a stored response's
-- route). The module's header comment gives the order.
function _M.read(ctx, body)
    if ctx.session_source == nil and _M.from_headers(ctx) or ctx.session_id then
        return
    end
    if type(body) ~= "table" then
        return
    end
    local api = ctx.api
    local fields, chain = api.SESSION_FIELDS, api.SESSION_CHAIN
    for i = 1, #fields do
        local name = fields[i]
        local v = field(body, name)
        if v then
            if name == chain then
                local dict = ngx_shared[DICT]
                local known = dict and dict:get(chain_key(v))
                ctx.session_id = known or clean(v)
            else
                ctx.session_id = clean(v)
            end
            ctx.session_source = name
            return
        end
    end
end

-- spend keys of a (key, session) in the dict: tokens, and cost in nano-units
local function spend_keys(key_id, sid)
    local k = key_id .. "\0" .. sid
    return "t:" .. k, "c:" .. k
end

-- amount(x) -> currency units x as text, to the nano-unit without trailing zeros (as
-- tokengate.budget writes amounts)
local function amount(x)
    local text = format("%.9f", x)
    return (gsub(gsub(text, "0+$", ""), "%.$", ""))
end

-- check(ctx, doc) -> true | nil, err (403 session_budget_exceeded, in the API's shape
-- via errors.send): the key's session_budget {tokens, spend} against what this edge
-- settled for the session. doc: the compiled configuration (its currency). No session,
-- or no budget: true.
function _M.check(ctx, doc)
    local sid, key = ctx.session_id, ctx.key
    local b = key and key.session_budget
    if not sid or type(b) ~= "table" then
        return true
    end
    local dict = ngx_shared[DICT]
    if not dict then
        return true
    end
    local tk, ck = spend_keys(key.id, sid)
    local tokens = tonumber(b.tokens)
    local used = tokens and (dict:get(tk) or 0)
    if tokens and used >= tokens then
        return nil, errors.new(403, format("Session '%s' of this key has used %d tokens, its "
            .. "session budget is %d tokens (session_budget.tokens): start a new session.",
            errors.clip(sid), used, tokens), nil, "session_budget_exceeded",
            "insufficient_quota")
    end
    local spend = tonumber(b.spend)
    local spent = spend and (dict:get(ck) or 0) / 1e9
    if spend and spent >= spend then
        local cur = doc and doc.currency or ""
        return nil, errors.new(403, format("Session '%s' of this key has spent %s %s, its "
            .. "session budget is %s %s (session_budget.spend): start a new session.",
            errors.clip(sid), amount(spent), cur, amount(spend), cur), nil,
            "session_budget_exceeded", "insufficient_quota")
    end
    return true
end

-- settle(ctx, tokens, cost): adds what the request is billed (tokens: prompt +
-- completion; cost: currency units, nil when the budget has no spend) to its session's
-- spend. Only for a key with a session_budget.
function _M.settle(ctx, tokens, cost)
    local sid, key = ctx.session_id, ctx.key
    local b = key and key.session_budget
    if not sid or type(b) ~= "table" then
        return
    end
    local dict = ngx_shared[DICT]
    if not dict then
        return
    end
    local tk, ck = spend_keys(key.id, sid)
    -- incr with init and init_ttl is atomic across workers; the TTL is set when the
    -- entry is made (a session's first request here)
    if tokens > 0 then
        dict:incr(tk, tokens, 0, _M.SPEND_TTL_S)
    end
    if cost and cost > 0 then
        dict:incr(ck, cost * 1e9, 0, _M.SPEND_TTL_S)
    end
end

-- remember(ctx, response_id): the session of a response this edge forwarded (the
-- Responses API's id, tokengate.apis.responses), for the requests that continue it.
function _M.remember(ctx, response_id)
    local sid = ctx.session_id
    local dict = ngx_shared[DICT]
    if not sid or not dict or type(response_id) ~= "string" then
        return
    end
    dict:set(chain_key(response_id), sid, _M.CHAIN_TTL_S)
end

-- needs_cost(key) -> true when the key's session budget limits spend (the log phase
-- then prices the request)
function _M.needs_cost(key)
    local b = key and key.session_budget
    return type(b) == "table" and tonumber(b.spend) ~= nil
end

return _M
