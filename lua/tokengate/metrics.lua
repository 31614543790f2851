-- Edge metrics: counters in a lua_shared_dict shared by all workers, served as JSON by
-- /tokengate/status on the loopback status server (edge.status_listen,
-- tokengate-http.conf).
--
-- Counters only ever grow (since nginx started; a reload keeps them, a restart clears
-- them), so a scraper takes rates from differences. incr with an init value is atomic
-- across workers.

local ngx = ngx
local json = require "tokengate.json"

local ngx_log = ngx.log
local ERR = ngx.ERR
local tostring = tostring

local _M = {}

-- The counters, in the order /tokengate/status lists them:
--   global_admitted        admitted by the global (Redis) window
--   global_refused         refused by the global window (429)
--   global_fallback        admitted on the local limits alone because the global tier
--                          failed (sum of the five reasons below)
--   global_fallback_unavailable   the limits sidecar answered UNAVAILABLE (Redis down)
--   global_fallback_down          the limits sidecar is unreachable (not running)
--   global_fallback_timeout       no answer within edge.global_limits_timeout_ms
--   global_fallback_error         anything else (an unexpected gRPC status, a bad reply)
--   global_fallback_backoff       not asked: the tier failed less than
--                                 edge.global_limits_backoff_ms ago
--   global_settled         settlements the sidecar applied (found or not)
--   global_settle_failed   settlements that did not reach Redis (the reservation then
--                          stays as reserved until it leaves the 60 s window)
--   global_settle_dropped  settlements not sent because the worker's queue was full
--   access_log_lines       lines written to the sampled access log
--   unauthenticated_missing_key   401: no API key (requests without a valid key write no
--                                 usage event; these four count them by reason)
--   unauthenticated_invalid_key   401: a key that is not configured
--   unauthenticated_blocked       429: the client is blocked (edge.auth_failures)
--   unauthenticated_refused       refused by nginx itself (bad request line or headers,
--                                 ...) without a valid key
--   unauthenticated_log_lines     their lines in the sampled access log (at most
--                                 edge.auth_failures.log_lines_per_s per worker; also
--                                 in access_log_lines)
--   auth_blocks            clients blocked after too many invalid keys
--   count_drift_requests   requests whose usage.prompt_tokens from vLLM differed from the
--                          counter's count (tokengate.drift; the event's count_drift)
--   count_drift_tokens     the sum of those differences, absolute, tokens
--   admission_shed         requests answered 503 overloaded: every replica's KV cache or
--                          queue above the bounds of the key's priority
--                          (tokengate.admission; each has a usage event)
--   admission_headroom     small prompts sent to a replica above its KV-cache threshold
--                          (edge.admission.small_prompt_headroom)
local NAMES = {
    "global_admitted", "global_refused", "global_fallback", "global_fallback_unavailable",
    "global_fallback_down", "global_fallback_timeout", "global_fallback_error",
    "global_fallback_backoff", "global_settled", "global_settle_failed",
    "global_settle_dropped", "access_log_lines", "unauthenticated_missing_key",
    "unauthenticated_invalid_key", "unauthenticated_blocked", "unauthenticated_refused",
    "unauthenticated_log_lines", "auth_blocks", "count_drift_requests", "count_drift_tokens",
    "admission_shed", "admission_headroom",
}

local dict

-- init(dict_name) -> true | nil, "shared dict not found: <name>"
function _M.init(dict_name)
    dict = ngx.shared[dict_name]
    if not dict then
        return nil, "shared dict not found: " .. tostring(dict_name)
    end
    return true
end

-- incr(name, n?): adds n (default 1) to a counter; a full dict only logs.
function _M.incr(name, n)
    if not dict then
        return
    end
    local ok, err = dict:incr(name, n or 1, 0)
    if not ok then
        ngx_log(ERR, "tokengate metrics: incr ", name, ": ", err)
    end
end

-- first_in(key, seconds) -> true for the first call with key in each period of that
-- many seconds, across all workers (add is atomic; its ttl ends the period): what
-- bounds a repeated log line. A full dict answers false: better a missed line than a
-- flood.
function _M.first_in(key, seconds)
    return dict ~= nil and dict:add(key, true, seconds) == true
end

-- get(name) -> the counter's value (0 when never incremented)
function _M.get(name)
    return dict and dict:get(name) or 0
end

-- json_text(extra) -> {"<counter>": n, ..., <extra fields>} as JSON text; extra: a
-- json.object whose fields are appended (state that is not a counter).
function _M.json_text(extra)
    local o = json.object()
    for i = 1, #NAMES do
        json.set(o, NAMES[i], _M.get(NAMES[i]))
    end
    if extra then
        local keys = extra[json.KEYS]
        for i = 1, #keys do
            json.set(o, keys[i], extra[keys[i]])
        end
    end
    return json.encode(o)
end

return _M
