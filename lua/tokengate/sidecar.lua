-- The one client of tokengate's sidecars (the counter's CountTokens, the global limits'
-- Reserve and Settle), usable from the access phase and from timers alike. Two
-- transports, one call():
--
-- The counter (frames()): a cosocket speaks counter frames (tokengate.counter.frames:
-- a gRPC length-prefixed request; a status byte and a length-prefixed reply) straight
-- to its workers' unix sockets. Each call goes to the socket with the fewest calls in
-- progress from this nginx worker (a short count does not wait behind a long one while
-- another counter worker is free); a socket that cannot be connected to falls through
-- to the next one, once.
--
-- The global limits (new()): a cosocket speaks plain HTTP/1.1 to this nginx's own
-- loopback hop server (tokengate-http.conf), which grpc_passes to the sidecar. Lua has
-- no HTTP/2 client, and ngx.location.capture straight to a grpc_pass location crashes
-- the worker with Debian's lua module (and subrequests do not exist in timers). What
-- comes back, verified with Debian's nginx 1.22: success is HTTP 200 with the framed
-- reply and grpc-status 0 as a chunked trailer; a gRPC error is a trailers-only
-- response, so grpc-status and grpc-message arrive as headers; a dead or slow sidecar
-- gives the hop's own 502/504.
--
-- Breaker: one per sidecar, in a shared dict so every worker sees it. After a failure
-- that says the sidecar is down or slow (unreachable, timeout, UNAVAILABLE, DEADLINE
-- EXCEEDED) calls fail at once with reason "backoff" for backoff_ms; then the next call
-- probes again. An outage costs one timeout per backoff period, not one per request.
--
-- Error log: one line when an outage starts (the first down/slow failure, whichever
-- worker saw it) and one when the sidecar answers again, not one per call: nginx's own
-- line for each failed cosocket connect is off in the API's location
-- (lua_socket_log_errors), or a counter restart wrote 70 [crit] lines in 19 s.

local ngx = ngx
local pb = require "tokengate.pb"
local shdict = require "tokengate.shdict"

local tcp = ngx.socket.tcp
local io_open = io.open
local ngx_now, ngx_log, ERR, WARN = ngx.now, ngx.log, ngx.ERR, ngx.WARN
local crc32 = ngx.crc32_short
local format, byte = string.format, string.byte
local tonumber, tostring, setmetatable = tonumber, tostring, setmetatable
local gsub, char, find, sub = string.gsub, string.char, string.find, string.sub
local lower, match = string.lower, string.match
local concat = table.concat

local _M = {}
local mt = { __index = _M }

local GRPC_DEADLINE_EXCEEDED = 4
local GRPC_UNAVAILABLE = 14
local ENOENT = 2
local KEEPALIVE_MS = 60000
local POOL_SIZE = 64
local worker_exiting = ngx.worker.exiting

-- release(sock): the connection back to the keep-alive pool, or closed while this worker
-- exits (a reload): the pool's timer is cancelable, so an exiting worker leaves a pooled
-- connection open and nginx logs "[alert] open socket #N left in connection" as it
-- exits (lua-nginx-module #1279; nginx's own upstream keepalive does the same check)
local function release(sock)
    if worker_exiting() then
        sock:close()
    else
        sock:setkeepalive(KEEPALIVE_MS, POOL_SIZE)
    end
end

-- grpc-message is percent-encoded (gRPC over HTTP/2 spec: bytes outside 0x20..0x7E and
-- "%" only). ngx.unescape_uri would also turn "+" into a space, so decode by hand.
local function hexbyte(h)
    return char(tonumber(h, 16))
end

-- new(name, address, timeout_ms, backoff_ms, dict) -> client | nil, err
--   name: the sidecar's name ("counter", "limits"; the breaker's key and the pool's);
--   address: the hop server, "unix:/path" or "host:port" / "[v6]:port";
--   timeout_ms: each call's deadline (connect + send + read), ms;
--   backoff_ms: how long the breaker stays open after a down/slow failure, ms (0: off);
--   dict: a lua_shared_dict (the breaker's state, shared by the workers).
function _M.new(name, address, timeout_ms, backoff_ms, dict)
    if not dict then
        return nil, "sidecar " .. tostring(name) .. ": shared dict not found"
    end
    local host, port
    if sub(address, 1, 5) == "unix:" then
        host = address
    else
        local h, p = match(address, "^%[?(.-)%]?:(%d+)$")
        if not h then
            return nil, "sidecar " .. name .. ": bad hop address: " .. tostring(address)
        end
        host, port = h, tonumber(p)
    end
    return setmetatable({
        name = name, host = host, port = port, timeout_ms = timeout_ms,
        backoff_s = backoff_ms / 1000, dict = dict, breaker_key = "breaker:" .. name,
        outage_key = "outage:" .. name, pool = "tokengate_hop:" .. address,
    }, mt)
end

-- frames(name, sockets, timeout_ms, backoff_ms, dict) -> client | nil, err
--   sockets: the counter workers' unix sockets, {"unix:/run/tokengate/counter.sock.0",
--   ...}; the other arguments as new()'s.
function _M.frames(name, sockets, timeout_ms, backoff_ms, dict)
    if not dict then
        return nil, "sidecar " .. tostring(name) .. ": shared dict not found"
    end
    if #sockets == 0 then
        return nil, "sidecar " .. name .. ": no sockets"
    end
    local peers = {}
    for i = 1, #sockets do
        if sub(sockets[i], 1, 5) ~= "unix:" then
            return nil, "sidecar " .. name .. ": not a unix socket: " .. tostring(sockets[i])
        end
        peers[i] = { host = sockets[i], file = sub(sockets[i], 6),
                     pool = "tokengate_frames:" .. sockets[i], busy = 0, changed = 0,
                     down_until = 0 }
    end
    return setmetatable({
        name = name, peers = peers, turn = 0, timeout_ms = timeout_ms,
        backoff_s = backoff_ms / 1000, dict = dict, breaker_key = "breaker:" .. name,
        outage_key = "outage:" .. name,
    }, mt)
end

-- read_fields(sock, h) -> true | nil, err: "name: value" lines up to a blank one (the
-- headers, or the trailers after the last chunk) into h: content_length, chunked,
-- grpc_status, grpc_message (decoded), close.
local function read_fields(sock, h)
    while true do
        local line, err = sock:receive("*l")
        if not line then
            return nil, err
        end
        if line == "" then
            return true
        end
        local name, value = match(line, "^([^:]+):%s*(.-)%s*$")
        if name then
            name = lower(name)
            if name == "content-length" then
                h.content_length = tonumber(value)
            elseif name == "transfer-encoding" then
                h.chunked = find(lower(value), "chunked", 1, true) ~= nil
            elseif name == "grpc-status" then
                h.grpc_status = tonumber(value)
            elseif name == "grpc-message" then
                h.grpc_message = (gsub(value, "%%(%x%x)", hexbyte))
            elseif name == "connection" then
                h.close = lower(value) == "close"
            end
        end
    end
end

-- read_response(sock) -> http status, fields (see read_fields), body | nil, err.
-- HTTP/1.1 with a Content-Length or a chunked body (and its trailers).
local function read_response(sock)
    local line, err = sock:receive("*l")
    if not line then
        return nil, err
    end
    local code = tonumber(match(line, "^HTTP/1%.%d (%d%d%d)"))
    if not code then
        return nil, "bad status line"
    end
    local h = {}
    local ok
    ok, err = read_fields(sock, h)
    if not ok then
        return nil, err
    end
    local body = ""
    if h.chunked then
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
        ok, err = read_fields(sock, h)
        if not ok then
            return nil, err
        end
        body = concat(parts, "", 1, n)
    elseif h.content_length then
        if h.content_length > 0 then
            body, err = sock:receive(h.content_length)
            if not body then
                return nil, err
            end
        end
    else
        body, err = sock:receive("*a")
        if not body then
            return nil, err
        end
        h.close = true
    end
    return code, h, body
end

-- connect(self, peer, timeout_ms) -> sock | nil, err: a pooled connection to peer (the
-- hop server: self; a counter socket: one of self.peers), each step of the call within
-- timeout_ms (default self.timeout_ms)
local function connect(self, peer, timeout_ms)
    if peer.file then
        -- nginx logs a connect() to a unix socket file that is not there at [crit],
        -- whatever lua_socket_log_errors says (a counter worker removes its socket when
        -- it stops and publishes the next one once its models are loaded): look first,
        -- before every connect. Whether this one takes a pooled connection or makes a
        -- new one is not known beforehand: nginx drops a pooled connection silently once
        -- the counter closes it, and a peer that answered a moment ago then met the
        -- removed file (one [crit] line per nginx worker and counter socket for each
        -- counter restart). The look is one open() failing with ENXIO (a socket).
        local f, _, errno = io_open(peer.file, "rb")
        if f then
            f:close()
        elseif errno == ENOENT then
            return nil, "no such file or directory"
        end
    end
    local sock = tcp()
    local t = timeout_ms or self.timeout_ms
    sock:settimeouts(t, t, t)
    local ok, err
    if peer.port then
        ok, err = sock:connect(peer.host, peer.port, { pool = peer.pool })
    else
        ok, err = sock:connect(peer.host, { pool = peer.pool })
    end
    if not ok then
        return nil, err
    end
    return sock
end

-- exchange(sock, path, frame, size) -> code, headers, body | nil, err. frame, size:
-- pb.frame()'s.
local function exchange(sock, path, frame, size)
    local ok, err = sock:send({
        "POST ", path, " HTTP/1.1\r\nHost: tokengate-hop\r\n",
        "Content-Type: application/grpc\r\nTE: trailers\r\nContent-Length: ", size,
        "\r\n\r\n", frame,
    })
    if not ok then
        return nil, "send: " .. err
    end
    return read_response(sock)
end

-- failure(self, reason, message, grpc_status, heavy) -> nil, failure; opens the breaker
-- for the reasons that say the sidecar is down or slow. heavy: the call was large, so a
-- timeout says nothing about the sidecar (a client must not be able to switch a sidecar
-- off for everyone with one slow body).
-- failure.outage: the failure is part of an outage that this module logs (callers log
-- only the others).
local function failure(self, reason, message, grpc_status, heavy)
    local outage = reason ~= "error" and reason ~= "backoff"
        and not (heavy and reason == "timeout")
    if outage then
        if self.backoff_s > 0 then
            self.dict:set(self.breaker_key, true, self.backoff_s)
        end
        -- the first failure of an outage, in whichever worker, logs it
        if shdict.run_began(self.dict, self.outage_key) then
            ngx_log(ERR, "tokengate: ", self.name, " unavailable (", reason, ": ",
                tostring(message), "); logged again when it answers")
        end
    end
    return nil, { reason = reason, message = message, grpc_status = grpc_status,
                  outage = outage }
end

-- answered(self): the sidecar answered (a reply or its own verdict); ends an outage,
-- logged once: the outage's start time names it, and add() lets one worker log it.
local function answered(self)
    local took = shdict.run_over(self.dict, self.outage_key)
    if took then
        ngx_log(WARN, "tokengate: ", self.name, " answers again after ",
            format("%.1f", took), " s")
    end
end

-- exchange_frames(sock, frame) -> status, payload | nil, err: one counter frame sent,
-- its reply read (tokengate.counter.frames): the gRPC status code and the reply message
-- (status 0) or the status message
local function exchange_frames(sock, frame)
    local ok, err = sock:send(frame)
    if not ok then
        return nil, err
    end
    local head
    head, err = sock:receive(6)
    if not head then
        return nil, err
    end
    local status, flag, b1, b2, b3, b4 = byte(head, 1, 6)
    if flag ~= 0 then
        return nil, "compressed reply"
    end
    local n = ((b1 * 256 + b2) * 256 + b3) * 256 + b4
    if n == 0 then
        return status, ""
    end
    local payload
    payload, err = sock:receive(n)
    if not payload then
        return nil, err
    end
    return status, payload
end

-- A counter socket that refused a connection (its worker died; the new one publishes the
-- socket once its models are loaded, seconds later) is skipped by this nginx worker for
-- this long, s: one failed connect, not one per request, and one error-log line.
local DOWN_S = 1

-- A call's preferred worker (its affinity) is taken while it has at most this many more
-- calls in progress from this nginx worker than the least busy one; beyond that the
-- least busy is taken: under load the calls spread as without affinity.
local AFFINITY_SLACK = 1

-- pick(self, skip, affinity) -> the peer with the fewest calls in progress from this
-- worker, other than skip and those marked down (unless every other one is); ties go
-- round. affinity (a string, or nil): the call's preferred peer is the one its CRC-32
-- names (the same peer from every nginx worker, as long as the peers are the same), taken
-- when it is neither skip nor down and has at most AFFINITY_SLACK more calls in progress
-- than that least busy one. A count left by a call whose request was ended mid-way (the
-- client left: its coroutine never resumes) is forgotten once that peer has seen no call
-- start or end for twice the call's deadline.
local function pick(self, skip, affinity)
    local peers, n = self.peers, #self.peers
    local now = ngx_now()
    local stale = now - 2 * self.timeout_ms / 1000
    self.turn = self.turn % n + 1
    local best, best_down
    for i = 0, n - 1 do
        local p = peers[(self.turn + i - 1) % n + 1]
        if p.busy > 0 and p.changed < stale then
            p.busy = 0
        end
        if p ~= skip then
            if p.down_until > now then
                best_down = best_down or p
            elseif not best or p.busy < best.busy then
                best = p
            end
        end
    end
    if affinity and best then
        local p = peers[crc32(affinity) % n + 1]
        if p ~= skip and p.down_until <= now and p.busy <= best.busy + AFFINITY_SLACK then
            return p
        end
    end
    return best or best_down
end

-- busy(peer, delta): this worker's calls in progress to peer
local function busy(peer, delta)
    peer.busy = peer.busy + delta
    peer.changed = ngx_now()
end

-- attempt(self, peer, frame, timeout_ms) -> status, payload | nil, err: one call to
-- peer, on a pooled connection (again on a fresh one when a reused connection turns out
-- closed: the counter worker restarted). A peer that refuses the connection is marked
-- down for DOWN_S.
local function attempt(self, peer, frame, timeout_ms)
    local sock, err = connect(self, peer, timeout_ms)
    if sock then
        local status, payload = exchange_frames(sock, frame)
        if not status and payload ~= "timeout" and sock:getreusedtimes() > 0 then
            sock:close()
            sock, err = connect(self, peer, timeout_ms)
            if sock then
                status, payload = exchange_frames(sock, frame)
            end
        end
        if sock then
            if not status then
                sock:close()
                return nil, payload
            end
            release(sock)
            return status, payload
        end
    end
    peer.down_until = ngx_now() + DOWN_S
    return nil, "connect: " .. tostring(err)
end

-- call_frames(self, frame, weight, affinity) -> call()'s results, over counter frames
local function call_frames(self, frame, weight, affinity)
    local timeout_ms = self.timeout_ms * weight
    local peer = pick(self, nil, affinity)
    busy(peer, 1)
    local status, payload = attempt(self, peer, frame, timeout_ms)
    busy(peer, -1)
    if not status and payload ~= "timeout" and #self.peers > 1 then
        -- counting is idempotent: a call that a worker could not answer (its socket
        -- refused, or the worker died with the call) goes to another worker, once. A
        -- slow one's does not: the edge's wait stays within the deadline.
        peer = pick(self, peer)
        busy(peer, 1)
        status, payload = attempt(self, peer, frame, timeout_ms)
        busy(peer, -1)
    end
    local heavy = weight > 1
    if not status then
        if payload == "timeout" then
            return failure(self, "timeout", "no answer in " .. timeout_ms .. " ms", nil,
                heavy)
        end
        return failure(self, "down", tostring(payload))
    end
    if status == 0 then
        return payload
    end
    if status == GRPC_UNAVAILABLE then
        return failure(self, "unavailable", payload, status)
    elseif status == GRPC_DEADLINE_EXCEEDED then
        return failure(self, "timeout", "gRPC DEADLINE_EXCEEDED", status, heavy)
    end
    return nil, { reason = "status", grpc_status = status, message = payload }
end

-- call_hop(self, path, frame, size) -> call()'s results, through the hop server
local function call_hop(self, path, frame, size)
    local sock, err = connect(self, self)
    if not sock then
        return failure(self, "down", "connect: " .. tostring(err))
    end
    local reused = sock:getreusedtimes() > 0
    -- exchange() -> code, headers, body | nil, err
    local code, h, body = exchange(sock, path, frame, size)
    if not code and reused and h ~= "timeout" then
        -- the hop server may have closed an idle pooled connection
        sock:close()
        sock, err = connect(self, self)
        if not sock then
            return failure(self, "down", "connect: " .. tostring(err))
        end
        code, h, body = exchange(sock, path, frame, size)
    end
    if not code then
        sock:close()
        if h == "timeout" then
            return failure(self, "timeout", "no answer in " .. self.timeout_ms .. " ms")
        end
        return failure(self, "down", tostring(h))
    end
    if h.close then
        sock:close()
    else
        release(sock)
    end
    local gs = h.grpc_status
    if gs and gs ~= 0 then
        if gs == GRPC_UNAVAILABLE then
            return failure(self, "unavailable", h.grpc_message or "", gs)
        elseif gs == GRPC_DEADLINE_EXCEEDED then
            return failure(self, "timeout", "gRPC DEADLINE_EXCEEDED", gs)
        end
        return nil, { reason = "status", grpc_status = gs, message = h.grpc_message or "" }
    end
    if code == 502 then
        return failure(self, "down", self.name .. " unreachable (hop answered 502)")
    elseif code == 504 then
        return failure(self, "timeout", "no answer in " .. self.timeout_ms .. " ms")
    elseif code ~= 200 then
        return failure(self, "error", "hop answered HTTP " .. code)
    end
    local msg, ferr = pb.unframe(body)
    if not msg then
        return failure(self, "error", "reply: " .. ferr)
    end
    return msg
end

-- call(path, message, weight, affinity) -> reply message bytes | nil, failure
--   path: the gRPC method, "/tokengate.v1.GlobalLimits/Reserve" (the hop's; a frames
--   client serves CountTokens only and ignores it); message: the serialized request
--   (unframed protobuf bytes: a string, or a list of strings sent one after the other,
--   pb.count_request's pieces); weight: counter frames only, an integer >= 1 (default
--   1): the call may take weight x timeout_ms, and when above 1 (a large body) its
--   timeout does not open the breaker; affinity: counter frames only, a string or nil:
--   calls of the same affinity prefer the same worker (pick), whose caches then hold
--   what they share (a conversation's earlier turns). Every method called through here is
--   idempotent, so a pooled connection the server had closed is retried once.
--   failure = { reason = "backoff" (breaker open: not asked) | "down" (unreachable)
--                      | "timeout" | "unavailable" (gRPC UNAVAILABLE)
--                      | "status" (another non-zero gRPC status: the sidecar's verdict)
--                      | "error" (a broken reply or an unexpected HTTP status),
--               grpc_status = <number> | nil, message = <grpc-message or why>,
--               outage = true when this module logged it (an outage's start, or a
--                        call during one) }
function _M.call(self, path, message, weight, affinity)
    if self.backoff_s > 0 and self.dict:get(self.breaker_key) then
        return nil, { reason = "backoff", message = self.name .. " skipped after a failure",
                      outage = true }
    end
    local frame, size = pb.frame(message)
    local msg, fail
    if self.peers then
        msg, fail = call_frames(self, frame, weight or 1, affinity)
    else
        msg, fail = call_hop(self, path, frame, size)
    end
    if msg or fail.reason == "status" then
        answered(self)
    end
    return msg, fail
end

-- backing_off() -> true while the breaker is open (for /tokengate/status)
function _M.backing_off(self)
    return self.dict:get(self.breaker_key) == true
end

return _M
