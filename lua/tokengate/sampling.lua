-- The tiered access log: which requests get a line. Usage events are written for every
-- authenticated request (100 %); this only thins the operator's access log.
--
-- The rule is the Python reference's (tests/sampling_reference.py), exactly: its
-- tests/sampling_vectors.json is replayed through this module by
-- tests/edge/test_edge_access_log.py:
--
--     keep = status >= error_status                        (every error)
--         or bucket(request_id) < threshold(rate_for(total_ms))
--     rate_for(total_ms) = slow_rate if total_ms > slow_ms else rate
--     bucket(request_id) = int(request_id[0:8], 16) % 10000    (nil: not 8 hex digits,
--                                                               always kept)
--     threshold(r)       = floor(r * 10000 + 0.5)
--
-- The decision depends on the request id, status and duration only, so every edge and
-- every replay keeps the same requests. The first 8 hex digits fit in 32 bits, exact in
-- LuaJIT's doubles.

local clock = require "tokengate.clock"

local find, sub = string.find, string.sub
local floor = math.floor
local tonumber = tonumber
local mono_ms = clock.mono_ms

local _M = {}

local BUCKETS = 10000

-- threshold(rate) -> buckets out of 10000 kept at rate (rate in [0, 1], half up).
local function threshold(rate)
    return floor(rate * BUCKETS + 0.5)
end
_M.threshold = threshold

-- bucket(request_id) -> 0..9999, or nil when the id does not start with 8 hex digits.
-- tonumber(s, 16) alone would also take "0x12", " 1234567" or "-1234567": the pattern
-- check comes first.
local function bucket(request_id)
    if not find(request_id, "^%x%x%x%x%x%x%x%x") then
        return nil
    end
    return tonumber(sub(request_id, 1, 8), 16) % BUCKETS
end
_M.bucket = bucket

-- rules(access_log) -> the compiled rule table {error_status, slow_ms, slow_rate, rate,
-- slow_threshold, threshold} from the compiled config's access_log section (fields
-- error_status (HTTP status), slow_ms (ms), slow_rate, rate (fractions)).
function _M.rules(al)
    return {
        error_status = al.error_status, slow_ms = al.slow_ms,
        slow_rate = al.slow_rate, rate = al.rate,
        slow_threshold = threshold(al.slow_rate), threshold = threshold(al.rate),
    }
end

-- keep(rules, request_id, status, total_ms) -> kept (bool), tier, rate:
-- tier "error" (status >= error_status, rate 1), "unbucketed" (id without 8 hex digits,
-- rate 1), "slow" (total_ms > slow_ms, rate slow_rate) or "sampled" (rate).
-- status: the HTTP status sent; total_ms: the request's duration (monotonic), ms.
function _M.keep(r, request_id, status, total_ms)
    if status >= r.error_status then
        return true, "error", 1
    end
    local b = bucket(request_id)
    if not b then
        return true, "unbucketed", 1
    end
    if total_ms > r.slow_ms then
        return b < r.slow_threshold, "slow", r.slow_rate
    end
    return b < r.threshold, "sampled", r.rate
end

-- Requests without a valid API key write no usage event and are not sampled by the
-- rule above (every 401 would be an "error" line): the first `per_s` of each second
-- get a line, per worker, so a flood of random keys writes a bounded log. Per-worker
-- state on purpose: no shared-dict traffic on the path a flood takes.
local second, lines = -1, 0

-- keep_unauthenticated(per_s) -> kept (bool): whether this request without a valid
-- key gets an access-log line; per_s: edge.auth_failures.log_lines_per_s (0: none).
function _M.keep_unauthenticated(per_s)
    local now = floor(mono_ms() / 1000)
    if now ~= second then
        second, lines = now, 0
    end
    if lines >= per_s then
        return false
    end
    lines = lines + 1
    return true
end

return _M
