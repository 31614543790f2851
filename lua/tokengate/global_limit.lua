-- The global limit tier: one RPM/TPM window per key in Redis, shared by every edge, through
-- the tokengate-limits sidecar (tokengate.v1.GlobalLimits, proto/tokengate/v1/limits.proto).
-- The local shared-dict limiter (tokengate.limit) stays the first gate; only what it
-- admits is reserved here.
--
-- Reserve (access phase) goes through the loopback hop the counter uses (tokengate.hop):
-- ngx.location.capture -> internal /_tokengate/limits/reserve -> proxy_pass HTTP/1.1
-- keepalive -> the hop server on a unix socket -> grpc_pass to the limits workers.
--
-- Settle (log phase) cannot use subrequests or cosockets there. It is queued per worker
-- and sent by a timer (ngx.timer.at(0)) with a cosocket straight to the hop server, as
-- plain HTTP/1.1 (the hop server turns it into gRPC, so no HTTP/2 client is needed here).
-- One timer per settlement would create a fake request and a coroutine per request and
-- hit lua_max_running_timers (256) under load; instead at most DRAINERS timers per worker
-- each empty the queue over one keepalive connection. A settlement that cannot be sent
-- leaves the reservation as reserved until it slides out of the 60 s window (counted in
-- global_settle_failed / global_settle_dropped): the error is on the safe side.
--
-- Failure: when the sidecar (or Redis behind it) is down, answers UNAVAILABLE, or does not
-- answer within edge.global_limits_timeout_ms, the request is admitted on the local limits
-- alone (X-Tokengate-Limits: local, counter global_fallback). For the next
-- edge.global_limits_backoff_ms no request asks (global_fallback_backoff), so an outage
-- costs one timeout per backoff period and per worker at most, not one per request.

local ngx = ngx
local pb = require "tokengate.pb"
local hop = require "tokengate.hop"
local metrics = require "tokengate.metrics"

local timer_at = ngx.timer.at
local tcp = ngx.socket.tcp
local ngx_log = ngx.log
local ERR = ngx.ERR
local WARN = ngx.WARN
local tonumber = tonumber
local tostring = tostring
local pcall = pcall
local concat = table.concat
local ceil = math.ceil
local max = math.max
local find = string.find
local sub = string.sub
local lower = string.lower
local match = string.match

local _M = {}

local HOP = "/_tokengate/limits/reserve"
local SETTLE_PATH = "/tokengate.v1.GlobalLimits/Settle"
local GRPC_DEADLINE_EXCEEDED = 4
local GRPC_UNAVAILABLE = 14
local LIMITED_BY = { [1] = "requests", [2] = "tokens" }
local WINDOW = 60 -- s: Retry-After of a request that can never fit, as tokengate.limit
local BACKOFF_KEY = "gl:backoff"
local MAX_QUEUE = 10000 -- settlements waiting per worker
local DRAINERS = 4 -- timers sending settlements per worker
local KEEPALIVE_MS = 60000
local POOL = 8

local dict -- tokengate_limits (the backoff flag)
local backoff_s, timeout_ms
local hop_host, hop_port -- the hop server: host, port or "unix:/path", nil

-- init_worker(dict_name, edge, hop_address) -> true | nil, err.
-- edge: the compiled edge section (global_limits_timeout_ms, global_limits_backoff_ms);
-- hop_address: where the hop server listens, "unix:/path" or "host:port".
function _M.init_worker(dict_name, edge, hop_address)
    dict = ngx.shared[dict_name]
    if not dict then
        return nil, "shared dict not found: " .. tostring(dict_name)
    end
    timeout_ms = edge.global_limits_timeout_ms
    backoff_s = edge.global_limits_backoff_ms / 1000
    if sub(hop_address, 1, 5) == "unix:" then
        hop_host, hop_port = hop_address, nil
    else
        local h, p = match(hop_address, "^%[?(.-)%]?:(%d+)$")
        if not h then
            return nil, "bad hop address: " .. hop_address
        end
        hop_host, hop_port = h, tonumber(p)
    end
    return true
end

-- fallback(reason, detail) -> nil, "local": reason "unavailable" | "down" | "timeout" |
-- "error" | "backoff" (see tokengate.metrics); counts and (unless backing off) logs why the
-- request is admitted on its local limits alone, and starts the backoff period.
local function fallback(reason, detail)
    metrics.incr("global_fallback")
    metrics.incr("global_fallback_" .. reason)
    if reason ~= "backoff" then
        ngx_log(WARN, "tokengate: global limits ", reason, " (", detail,
            "): admitting on local limits")
        dict:set(BACKOFF_KEY, true, backoff_s)
    end
    return nil, "local"
end

-- state(r, limits) -> a tokengate.limit state (the x-ratelimit-* headers) from a
-- ReserveReply: remaining and reset are Redis's, across all edges.
local function state(r, limits)
    return {
        rpm = limits.rpm, tpm = limits.tpm,
        remaining_requests = r.remaining_requests, remaining_tokens = r.remaining_tokens,
        reset_requests = r.reset_requests_ms / 1000, reset_tokens = r.reset_tokens_ms / 1000,
    }
end

-- reserve(key_id, model, per_model, limits, tokens, request_id) -> st, tier
--   admitted:  st (tokengate.limit state shape), "global"
--   refused:   st with st.reject = "requests" | "tokens", st.retry_after (whole s, >= 1),
--              st.alone (can never fit), "global" (answer with limit.rejection(st))
--   fallback:  nil, "local" (sidecar/Redis down or slow: the local limits decided)
-- key_id: the key's id; model: served model name; per_model: limits are the key's
-- override for model; limits = {rpm, tpm}; tokens: the reservation (tokens);
-- request_id: $request_id (idempotency of retries, and the Settle handle).
function _M.reserve(key_id, model, per_model, limits, tokens, request_id)
    if dict:get(BACKOFF_KEY) then
        return fallback("backoff")
    end
    local msg, failure = hop.call(HOP, pb.reserve_request(key_id, model, per_model,
        limits.rpm, limits.tpm, tokens, request_id))
    if not msg then
        local gs, status = failure.grpc_status, failure.http_status
        if gs == GRPC_UNAVAILABLE then
            return fallback("unavailable", failure.message)
        elseif gs == GRPC_DEADLINE_EXCEEDED then
            return fallback("timeout", "gRPC DEADLINE_EXCEEDED")
        elseif gs then
            return fallback("error", "gRPC status " .. gs)
        elseif status == 504 then
            return fallback("timeout", "no answer in " .. timeout_ms .. " ms")
        elseif status == 502 then
            return fallback("down", "sidecar unreachable")
        elseif status ~= 200 then
            return fallback("error", "hop answered HTTP " .. status)
        end
        return fallback("error", "reply: " .. failure.message)
    end
    local r, err = pb.reserve_reply(msg)
    if not r then
        return fallback("error", "reply: " .. err)
    end
    local st = state(r, limits)
    if r.admitted then
        metrics.incr("global_admitted")
        return st, "global"
    end
    metrics.incr("global_refused")
    st.reject = LIMITED_BY[r.limited_by] or "tokens"
    st.alone = r.never_fits
    st.retry_after = r.never_fits and WINDOW or max(1, ceil(r.retry_after_ms / 1000))
    return st, "global"
end

-- ------------------------------------------------------------------ settlement

local queue, qhead, qtail = {}, 1, 0 -- worker-local FIFO of framed SettleRequests
local running = 0 -- drainer timers alive in this worker

-- read_response(sock) -> http status, grpc-status (number or nil), body, close (the
-- server closes the connection) | nil, err.
-- A minimal HTTP/1.1 response reader for the hop server's answers: Content-Length or
-- chunked bodies (the grpc-status trailer after the last chunk is read too).
local function read_response(sock)
    local line, err = sock:receive("*l")
    if not line then
        return nil, err
    end
    local code = tonumber(match(line, "^HTTP/1%.%d (%d%d%d)"))
    if not code then
        return nil, "bad status line"
    end
    local length, chunked, gs, close
    while true do
        line, err = sock:receive("*l")
        if not line then
            return nil, err
        end
        if line == "" then
            break
        end
        local name, value = match(line, "^([^:]+):%s*(.-)%s*$")
        if name then
            name = lower(name)
            if name == "content-length" then
                length = tonumber(value)
            elseif name == "transfer-encoding" then
                chunked = find(lower(value), "chunked", 1, true) ~= nil
            elseif name == "grpc-status" then
                gs = tonumber(value)
            elseif name == "connection" then
                close = lower(value) == "close"
            end
        end
    end
    local body = ""
    if chunked then
        local parts, n = {}, 0
        while true do
            line, err = sock:receive("*l")
            if not line then
                return nil, err
            end
            local size = tonumber(match(line, "^%x+"), 16)
            if not size then
                return nil, "bad chunk size"
            end
            if size == 0 then
                break
            end
            local data
            data, err = sock:receive(size + 2)
            if not data then
                return nil, err
            end
            n = n + 1
            parts[n] = sub(data, 1, size)
        end
        -- trailers, up to the blank line
        while true do
            line, err = sock:receive("*l")
            if not line then
                return nil, err
            end
            if line == "" then
                break
            end
            local v = match(line, "^[Gg][Rr][Pp][Cc]%-[Ss][Tt][Aa][Tt][Uu][Ss]:%s*(%d+)")
            if v then
                gs = tonumber(v)
            end
        end
        body = concat(parts, "", 1, n)
    elseif length then
        if length > 0 then
            body, err = sock:receive(length)
            if not body then
                return nil, err
            end
        end
    else
        body, err = sock:receive("*a")
        if not body then
            return nil, err
        end
        close = true
    end
    return code, gs, body, close
end

-- connect() -> sock | nil, err: a (possibly reused) connection to the hop server
local function connect()
    local sock = tcp()
    -- connect, send, read: the hop's grpc timeouts answer first; these are backstops
    sock:settimeouts(1000, 1000, timeout_ms + 1000)
    local ok, err
    if hop_port then
        ok, err = sock:connect(hop_host, hop_port, { pool = "tokengate_hop" })
    else
        ok, err = sock:connect(hop_host, { pool = "tokengate_hop" })
    end
    if not ok then
        return nil, err
    end
    return sock
end

-- settle_one(sock, frame) -> reply | nil, err, broken (the connection cannot be reused)
local function settle_one(sock, frame)
    local ok, err = sock:send({
        "POST ", SETTLE_PATH, " HTTP/1.1\r\nHost: tokengate-hop\r\n",
        "Content-Type: application/grpc\r\nTE: trailers\r\nContent-Length: ", #frame,
        "\r\n\r\n", frame,
    })
    if not ok then
        return nil, "send: " .. err, true
    end
    local code, gs, body, close = read_response(sock)
    if not code then
        return nil, "read: " .. tostring(gs), true
    end
    if gs and gs ~= 0 then
        return nil, "gRPC status " .. gs, close
    end
    if code ~= 200 then
        return nil, "hop answered HTTP " .. code, close
    end
    local msg, ferr = pb.unframe(body)
    if not msg then
        return nil, ferr, close
    end
    local reply, derr = pb.settle_reply(msg)
    if not reply then
        return nil, derr, close
    end
    return reply, nil, close
end

-- drain(premature): timer handler; sends queued settlements until the queue is empty.
local function drain(premature)
    local sock, err
    local ok, perr = pcall(function()
        while qhead <= qtail do
            local frame = queue[qhead]
            queue[qhead] = nil
            qhead = qhead + 1
            if not sock then
                sock, err = connect()
            end
            local reply, broken
            if sock then
                local reused = sock:getreusedtimes() > 0
                reply, err, broken = settle_one(sock, frame)
                if broken then
                    sock:close()
                    sock = nil
                    if reused then
                        -- the hop server may have closed an idle pooled connection;
                        -- Settle is idempotent (it sets the actual tokens), so retry once
                        sock, err = connect()
                        if sock then
                            reply, err, broken = settle_one(sock, frame)
                            if broken then
                                sock:close()
                                sock = nil
                            end
                        end
                    end
                end
            end
            if reply then
                metrics.incr("global_settled")
            else
                metrics.incr("global_settle_failed")
                ngx_log(WARN, "tokengate: global limits settle failed: ", err)
            end
        end
    end)
    if not ok then
        ngx_log(ERR, "tokengate: global limits settle: ", perr)
    end
    if qhead > qtail then
        qhead, qtail = 1, 0
    end
    if sock then
        if premature then
            sock:close()
        else
            sock:setkeepalive(KEEPALIVE_MS, POOL)
        end
    end
    running = running - 1
end

-- settle(key_id, model, per_model, request_id, actual_tokens): corrects the request's
-- Redis reservation to actual_tokens (prompt + completion, tokens), asynchronously.
-- Callable from the log phase; never blocks.
function _M.settle(key_id, model, per_model, request_id, actual_tokens)
    if qtail - qhead + 1 >= MAX_QUEUE then
        metrics.incr("global_settle_dropped")
        return
    end
    qtail = qtail + 1
    queue[qtail] = pb.frame(pb.settle_request(key_id, model, per_model, request_id,
        actual_tokens))
    -- one more drainer while there is more queued than the running ones are taking
    if running < DRAINERS and qtail - qhead + 1 > running then
        local ok, err = timer_at(0, drain)
        if ok then
            running = running + 1
        elseif running == 0 then
            -- no timer left: the queue waits for the next settlement to start one
            ngx_log(ERR, "tokengate: global limits settle timer: ", err)
        end
    end
end

-- backing_off() -> true while the tier is skipped after a failure (for /tokengate/status)
function _M.backing_off()
    return dict ~= nil and dict:get(BACKOFF_KEY) == true
end

return _M
