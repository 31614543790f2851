-- The quota of the calling key (GET /v1/key, tokengate.apis.key): its limits and its
-- levels' (team, organization), what their windows hold now and what their budgets hold
-- in the current periods, with the reset times; the caller's own data and its levels'
-- only (a key never learns another key's figures).
--
-- Shape (OpenRouter's GET /api/v1/key answers {"data": {"label", "limit", "usage",
-- "limit_remaining", ...}} at the same place under its base URL; the fields it defines
-- keep its meaning, the rest are tokengate's):
--   {"data": {
--     "label": "<key id>", "team": "<name>" | null, "org": "<name>" | null,
--     "limit": <spend limit of the budget with the least spend left, currency> | null,
--     "usage": <what that budget holds: spent + reserved> | null,
--     "limit_remaining": <limit - usage, >= 0> | null,
--     "source": "global" (Redis: every edge) | "local" (this edge's counters),
--     "currency": "USD",
--     "limits": [{"level": "key" | "team" | "org", "name", "rpm", "tpm",
--                 "requests", "tokens" (in the last 60 s), "remaining_requests",
--                 "remaining_tokens", "reset_s"}],
--     "budgets": [{"level", "name", "period": "day" | "month", "model" | null,
--                  "spend_limit" | null, "spent", "reserved",
--                  "token_limit" | null, "tokens_used", "tokens_reserved",
--                  "resets_at": RFC 3339, "reset_s"}]}}
-- spent and tokens_used are the budget counters' settled figures (the real cost of the
-- requests that ended, the ledger's corrections included: tokengate.ledger.budgets),
-- reserved what requests in flight hold. With global limits the figures are Redis's,
-- the ones admission decides on; when the limits sidecar does not answer, this edge's
-- own (source "local").

local json = require "tokengate.json"
local budget = require "tokengate.budget"
local local_limit = require "tokengate.local_limit"
local global_limit = require "tokengate.global_limit"
local clock = require "tokengate.clock"

local max, floor = math.max, math.floor
local ngx_log, WARN = ngx.log, ngx.WARN

local _M = {}

local NANO = 1e9

-- the levels a key's limits are counted at: itself, then its team and organization
local function levels_of(key)
    local out = { { level = "key", name = key.id, id = key.id, rpm = key.rpm,
                    tpm = key.tpm } }
    for i = 1, #key.levels do
        out[#out + 1] = key.levels[i]
    end
    return out
end

-- window_entry(lv, requests, tokens, reset_s) -> one "limits" entry; reset_s in
-- seconds, to the tenth
local function window_entry(lv, requests, tokens, reset_s)
    local o = json.object()
    json.set(o, "level", lv.level)
    json.set(o, "name", lv.name)
    json.set(o, "rpm", lv.rpm)
    json.set(o, "tpm", lv.tpm)
    json.set(o, "requests", requests)
    json.set(o, "tokens", tokens)
    json.set(o, "remaining_requests", max(0, lv.rpm - requests))
    json.set(o, "remaining_tokens", max(0, lv.tpm - tokens))
    json.set(o, "reset_s", floor(reset_s * 10 + 0.5) / 10)
    return o
end

-- budget_entry(it, u) -> one "budgets" entry; u: {spent_nano, tokens, reserved_nano,
-- reserved_tokens}
local function budget_entry(it, u, key)
    local b, lv = it.b, it.level
    local o = json.object()
    json.set(o, "level", lv and lv.level or "key")
    json.set(o, "name", lv and lv.name or key.id)
    json.set(o, "period", b.period)
    json.set(o, "model", b.model or json.null)
    json.set(o, "spend_limit", b.spend or json.null)
    json.set(o, "spent", u.spent_nano / NANO)
    json.set(o, "reserved", u.reserved_nano / NANO)
    json.set(o, "token_limit", b.tokens or json.null)
    json.set(o, "tokens_used", u.tokens)
    json.set(o, "tokens_reserved", u.reserved_tokens)
    json.set(o, "resets_at", it.ends)
    json.set(o, "reset_s", floor(it.left + 0.5))
    return o
end

-- document(doc, key, use_global) -> JSON text of the key's quota (shape above)
function _M.document(doc, key, use_global)
    local now = clock.window_now()
    local levels = levels_of(key)
    local items = budget.items(key, now)
    local windows = {}
    for i = 2, #levels do
        if levels[i].rpm then
            windows[#windows + 1] = levels[i]
        end
    end
    local r, err
    if use_global then
        r, err = global_limit.quota(key.id, windows, items)
        if not r then
            ngx_log(WARN, "tokengate: quota of key ", key.id, " from this edge's counters: ",
                err)
        end
    end
    local limits = json.array()
    local with_window = { levels[1] }
    for i = 1, #windows do
        with_window[i + 1] = windows[i]
    end
    for i = 1, #with_window do
        local lv = with_window[i]
        if r then
            local w = r.windows[i]
            limits[i] = window_entry(lv, w.requests, w.tokens, w.reset_ms / 1000)
        else
            local st = local_limit.peek(lv.id, lv, now)
            limits[i] = window_entry(lv, lv.rpm - st.remaining_requests,
                lv.tpm - st.remaining_tokens, st.reset_tokens)
        end
    end
    local budgets, tightest, left = json.array(), nil, nil
    for i = 1, #items do
        local it = items[i]
        local u = r and r.counters[i] or budget.local_usage(it, now)
        budgets[i] = budget_entry(it, u, key)
        local spend = it.b.spend_nano
        if spend and (not left or spend - u.spent_nano - u.reserved_nano < left) then
            tightest, left = { spend, u.spent_nano + u.reserved_nano },
                spend - u.spent_nano - u.reserved_nano
        end
    end
    local data = json.object()
    json.set(data, "label", key.id)
    json.set(data, "team", key.team or json.null)
    local org = key.levels[2]
    json.set(data, "org", org and org.name or json.null)
    json.set(data, "limit", tightest and tightest[1] / NANO or json.null)
    json.set(data, "usage", tightest and tightest[2] / NANO or json.null)
    json.set(data, "limit_remaining", tightest and max(0, left) / NANO or json.null)
    json.set(data, "source", r and "global" or "local")
    json.set(data, "currency", doc.currency)
    json.set(data, "limits", limits)
    json.set(data, "budgets", budgets)
    local out = json.object()
    json.set(out, "data", data)
    return json.encode(out)
end

return _M
