-- Clients that keep presenting invalid API keys (edge.auth_failures): `threshold`
-- invalid keys from one client within `window_s` (counted from its first failure) block
-- it for `block_s`. A blocked client is answered 429 before its key is checked, so a
-- valid key from it waits too: a guesser learns nothing while blocked, and the refusal
-- costs one shared-dict read. Requests without any key never count (no guess, and what
-- health checks send). Networks in `exempt` (a NAT gateway or proxy that many clients
-- share) are never blocked.
--
-- A client is its IPv4 address, or the /64 of its IPv6 address (one host commonly holds
-- a whole /64); IPv4-mapped IPv6 addresses count as IPv4. State lives in its own shared
-- dict: "f<client>" (failures, ttl window_s) and "b<client>" (the block's end, seconds
-- since the epoch, ttl block_s). Both change with atomic operations only (incr with init
-- and ttl, add), so concurrent failures on every worker block a client exactly once.

local ngx = ngx
local errors = require "tokengate.errors"
local metrics = require "tokengate.metrics"
local shdict = require "tokengate.shdict"

local ngx_var, ngx_now, ngx_log, WARN, ERR = ngx.var, ngx.now, ngx.log, ngx.WARN, ngx.ERR
local sub, byte, char, format = string.sub, string.byte, string.char, string.format
local ceil, floor = math.ceil, math.floor
local tonumber, tostring, ipairs = tonumber, tostring, ipairs

local _M = {}

local dict
local threshold, window_s, block_s = 0, 1, 1
local exempt = {} -- { {bytes = "<network address, raw>", bits = <prefix length>}, ... }

local V4_MAPPED = "\0\0\0\0\0\0\0\0\0\0\255\255"

-- hex_bytes(hex) -> the raw bytes of an even-length hex string
local function hex_bytes(hex)
    return (hex:gsub("%x%x", function(h) return char(tonumber(h, 16)) end))
end

-- init(dict_name, conf) -> true | nil, "shared dict not found: <name>".
-- conf: the compiled edge.auth_failures {threshold, window_s, block_s (s),
-- exempt_networks = {{hex, prefix length}, ...}}.
function _M.init(dict_name, conf)
    local err
    dict, err = shdict.get(dict_name)
    if not dict then
        return nil, err
    end
    threshold, window_s, block_s = conf.threshold, conf.window_s, conf.block_s
    exempt = _M.networks(conf.exempt_networks)
    return true
end

-- networks(list) -> the exempt networks for client(): list is the compiled
-- exempt_networks, {{"<network address, hex>", <prefix length>}, ...}.
function _M.networks(list)
    local out = {}
    for i, n in ipairs(list) do
        out[i] = { bytes = hex_bytes(n[1]), bits = n[2] }
    end
    return out
end


-- in_network(a, n) -> true when raw address a lies in network n {bytes, bits}
local function in_network(a, n)
    if #a ~= #n.bytes then
        return false
    end
    local whole = floor(n.bits / 8)
    if sub(a, 1, whole) ~= sub(n.bytes, 1, whole) then
        return false
    end
    local rest = n.bits - whole * 8
    if rest == 0 then
        return true
    end
    local unit = 2 ^ (8 - rest) -- the masked byte compares in units of its low bits
    return floor(byte(a, whole + 1) / unit) == floor(byte(n.bytes, whole + 1) / unit)
end

-- client(a, nets) -> the key of a client whose raw address ($binary_remote_addr) is a:
-- IPv4 (4 bytes, also when mapped into IPv6) as is, IPv6 its /64 (8 bytes); nil when
-- a lies in one of nets (networks()).
function _M.client(a, nets)
    if #a == 16 and sub(a, 1, 12) == V4_MAPPED then
        a = sub(a, 13)
    end
    for i = 1, #nets do
        if in_network(a, nets[i]) then
            return nil
        end
    end
    if #a == 16 then
        return sub(a, 1, 8)
    end
    return a
end
local client = _M.client

-- check() -> true | nil, err (429, rate_limit_exceeded, Retry-After: the seconds left of
-- the block, at least 1) for a blocked client.
function _M.check()
    if threshold == 0 then
        return true
    end
    local c = client(ngx_var.binary_remote_addr or "", exempt)
    if not c then
        return true
    end
    local ends = dict:get("b" .. c)
    if not ends then
        return true
    end
    local left = ceil(ends - ngx_now())
    if left <= 0 then
        return true -- expired between the ttl check and now
    end
    return errors.refuse(429, format("Too many requests with an invalid API key came from "
        .. "your address: its requests are refused for %d s more. Check the key your "
        .. "client sends.", left), nil, "rate_limit_exceeded", "requests",
        { ["Retry-After"] = tostring(left) })
end

-- failed(): one invalid key from this client; the one that reaches `threshold` within
-- the window blocks it (logged at warn level, counted as auth_blocks).
function _M.failed()
    if threshold == 0 then
        return
    end
    local c = client(ngx_var.binary_remote_addr or "", exempt)
    if not c then
        return
    end
    -- the window starts at the first failure: init_ttl applies only when incr creates it
    local n, err = dict:incr("f" .. c, 1, 0, window_s)
    if not n then
        ngx_log(ERR, "tokengate lockout: ", err)
        return
    end
    if n < threshold then
        return
    end
    -- add succeeds once per block, whichever worker gets there first
    if dict:add("b" .. c, ngx_now() + block_s, block_s) then
        metrics.incr("auth_blocks")
        ngx_log(WARN, "tokengate: client ", ngx_var.remote_addr, " blocked for ", block_s,
            " s after ", n, " invalid API keys in ", window_s, " s")
    end
end

return _M
