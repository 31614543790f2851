-- The local limit tier (see tokengate.limits for how tiers combine): requests-per-minute
-- and tokens-per-minute per key, in a lua_shared_dict shared by all workers: a sliding-window counter (the current and the previous minute window; the
-- previous one weighs by how much of it still overlaps the last 60 s):
--
--     used(now) = prev * (1 - f) + cur        f = fraction of the current window elapsed
--
-- Admission is incr-then-check: incr is atomic across workers and returns the total
-- including every concurrent admission, so when the total goes over the limit the
-- request takes its increment back and is refused. Concurrent bursts can therefore
-- never admit more than the limit (a get-then-set could); at worst a request that would
-- have fitted is refused while another one's increment is being taken back.
--
-- Windows are numbered by wall-clock minutes (tokengate.clock.window_now, which is
-- ngx.now on a production edge) so every worker, every restart and every edge agrees on
-- them; durations elsewhere use the monotonic clock. Every function here takes the time
-- as its now argument (tokengate.limits passes window_now()).

local ngx = ngx
local shdict = require "tokengate.shdict"

local floor, ceil, max = math.floor, math.ceil, math.max
local ngx_log, ERR = ngx.log, ngx.ERR

local _M = { name = "local" }

local NONE = {} -- a request without levels (req.windows nil)

local WINDOW = 60 -- seconds: the limits are per minute
local TTL = 2 * WINDOW + 5 -- a window is read as "previous" for one more window

local dict

-- init(dict_name) -> true | nil, "shared dict not found: <name>"
function _M.init(dict_name)
    dict = shdict.get(dict_name)
    return shdict.found(dict, dict_name)
end

-- window(now) -> window id (minutes since the epoch), elapsed fraction in [0, 1)
local function window(now)
    local id = floor(now / WINDOW)
    return id, (now - id * WINDOW) / WINDOW
end

-- key("r" | "t", bucket, id) -> shared-dict key of one window count
local function key(kind, bucket, id)
    return kind .. id .. ":" .. bucket
end

-- retry_after(prev, cur, limit, cost, f) -> whole seconds (>= 1) until
-- used + cost <= limit, assuming no other traffic. cur excludes this request;
-- cost <= limit (a bigger cost can never succeed, the caller says so).
local function retry_after(prev, cur, limit, cost, f)
    local dt
    if prev > 0 and cur + cost <= limit then
        -- still in this window, once enough of the previous one has slid out
        local need = 1 - (limit - cur - cost) / prev
        dt = (need - f) * WINDOW
    else
        -- in the next window, where this window's count becomes the decaying "previous"
        local g = cur > 0 and max(0, 1 - (limit - cost) / cur) or 0
        dt = (1 - f + g) * WINDOW
    end
    return max(1, ceil(dt - 1e-9))
end

-- reset_s(prev, cur, f) -> seconds until the window counts have slid out completely.
local function reset_s(prev, cur, f)
    if cur > 0 then
        return (2 - f) * WINDOW
    elseif prev > 0 then
        return (1 - f) * WINDOW
    end
    return 0
end

-- state(limits, counts..., f, id) -> the state table documented at peek()
local function state(limits, rprev, rcur, tprev, tcur, f, id)
    local r_used = rprev * (1 - f) + rcur
    local t_used = tprev * (1 - f) + tcur
    return {
        window = id,
        rpm = limits.rpm, tpm = limits.tpm,
        remaining_requests = max(0, floor(limits.rpm - r_used + 1e-9)),
        remaining_tokens = max(0, floor(limits.tpm - t_used + 1e-9)),
        reset_requests = reset_s(rprev, rcur, f),
        reset_tokens = reset_s(tprev, tcur, f),
    }
end

-- peek(bucket, limits, now) -> state without admitting anything (for answers that are
-- not admitted: bad input, 429). state = {window, rpm, tpm, remaining_requests,
-- remaining_tokens, reset_requests (s), reset_tokens (s)}.
function _M.peek(bucket, limits, now)
    local id, f = window(now)
    return state(limits,
        dict:get(key("r", bucket, id - 1)) or 0, dict:get(key("r", bucket, id)) or 0,
        dict:get(key("t", bucket, id - 1)) or 0, dict:get(key("t", bucket, id)) or 0, f, id)
end

-- admit(bucket, limits, tokens, now) -> state (admitted)
--   | nil, state with state.reject = "requests" | "tokens", state.retry_after (s) and
--     state.alone = true when tokens > limits.tpm (no retry can succeed).
-- bucket: string naming the counted entity (key id, or key id @ model for overrides);
-- limits = {rpm, tpm}; tokens: the TPM reservation (prompt + output reserve).
local function admit(bucket, limits, tokens, now)
    local id, f = window(now)
    local rk, tk = key("r", bucket, id), key("t", bucket, id)
    if tokens > limits.tpm then
        local st = _M.peek(bucket, limits, now)
        st.reject, st.alone, st.retry_after = "tokens", true, WINDOW
        return nil, st
    end
    local rcur, err = dict:incr(rk, 1, 0, TTL)
    if not rcur then
        -- a full dict must not take the gateway down: admit, and say why in the log
        ngx_log(ERR, "tokengate limit: incr ", rk, ": ", err)
        return _M.peek(bucket, limits, now)
    end
    local rprev = dict:get(key("r", bucket, id - 1)) or 0
    local tprev = dict:get(key("t", bucket, id - 1)) or 0
    if rprev * (1 - f) + rcur > limits.rpm + 1e-9 then
        dict:incr(rk, -1)
        local tcur = dict:get(tk) or 0
        local st = state(limits, rprev, rcur - 1, tprev, tcur, f, id)
        st.reject = "requests"
        st.retry_after = retry_after(rprev, rcur - 1, limits.rpm, 1, f)
        return nil, st
    end
    local tcur
    tcur, err = dict:incr(tk, tokens, 0, TTL)
    if not tcur then
        ngx_log(ERR, "tokengate limit: incr ", tk, ": ", err)
        return state(limits, rprev, rcur, tprev, 0, f, id)
    end
    if tprev * (1 - f) + tcur > limits.tpm + 1e-9 then
        dict:incr(tk, -tokens)
        dict:incr(rk, -1)
        local st = state(limits, rprev, rcur - 1, tprev, tcur - tokens, f, id)
        st.reject = "tokens"
        st.retry_after = retry_after(tprev, tcur - tokens, limits.tpm, tokens, f)
        return nil, st
    end
    return state(limits, rprev, rcur, tprev, tcur, f, id)
end

-- correct(bucket, window, delta): corrects the TPM count of the window the request was
-- admitted in by delta tokens ((prompt + completion) - reserved; negative returns the
-- unused reservation). The window keeps its own TTL; a window that already expired
-- is recreated for the rest of TTL, harmlessly.
local function correct(bucket, window_id, delta)
    if delta == 0 then
        return
    end
    local ok, err = dict:incr(key("t", bucket, window_id), delta, 0, TTL)
    if not ok then
        ngx_log(ERR, "tokengate limit: settle ", bucket, ": ", err)
    end
end

-- release(bucket, window_id, tokens): takes back a whole admission (1 request and tokens)
-- from the window it was admitted in: the global tier refused what this limiter admitted.
local function release(bucket, window_id, tokens)
    local ok, err = dict:incr(key("r", bucket, window_id), -1, 0, TTL)
    if ok then
        ok, err = dict:incr(key("t", bucket, window_id), -tokens, 0, TTL)
    end
    if not ok then
        ngx_log(ERR, "tokengate limit: release ", bucket, ": ", err)
    end
end

-- incoming(req, now) -> state | nil, refused state: the tier's side of
-- tokengate.limits. req = {bucket, limits = {rpm, tpm}, tokens, windows}; windows: the
-- levels above the key with a window of their own ({id, level, name, rpm, tpm}: its
-- team, its organization), each counted in the bucket of its id, which every member
-- shares. The key's window and then each level's are reserved in turn, incr-then-check
-- each; when one refuses, those before it take the reservation back, so no window ever
-- counts more than its limit (at worst a request that would have fitted is refused
-- while another one's reservation is being taken back). The admitted state is the
-- window with the fewest tokens left (the tightest level; state.level names it, nil for
-- the key), a refused one that of the level that refused. The admitted window id is
-- kept in req.window for uncommit and settle.
function _M.incoming(req, now)
    local st, refused = admit(req.bucket, req.limits, req.tokens, now)
    if not st then
        return nil, refused
    end
    req.window = st.window
    local windows = req.windows or NONE
    for i = 1, #windows do
        local lv = windows[i]
        local lst, lref = admit(lv.id, lv, req.tokens, now)
        if not lst then
            for j = i - 1, 1, -1 do
                release(windows[j].id, req.window, req.tokens)
            end
            release(req.bucket, req.window, req.tokens)
            lref.level = lv
            return nil, lref
        end
        if lst.remaining_tokens < st.remaining_tokens then
            lst.level = lv
            st = lst
        end
    end
    return st
end

-- uncommit(req): a later tier refused what this one admitted: take it all back, at
-- every level.
function _M.uncommit(req)
    release(req.bucket, req.window, req.tokens)
    local windows = req.windows or NONE
    for i = 1, #windows do
        release(windows[i].id, req.window, req.tokens)
    end
end

-- settle(req, actual): the request ended having used actual tokens (prompt +
-- completion); its window and its levels' are corrected by actual - reserved.
function _M.settle(req, actual)
    local delta = actual - req.tokens
    correct(req.bucket, req.window, delta)
    local windows = req.windows or NONE
    for i = 1, #windows do
        correct(windows[i].id, req.window, delta)
    end
end

_M.WINDOW = WINDOW

return _M
