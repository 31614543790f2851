-- API keys: `Authorization: Bearer <key>` (or what an API module reads: the Messages
-- API's x-api-key). The configuration stores only SHA-256 hex
-- digests (never keys), so the edge hashes the presented key and looks the digest up.
-- SHA-256: tokengate.digest.

local lrucache = require "resty.lrucache.pureffi"
local errors = require "tokengate.errors"
local digest = require "tokengate.digest"

local find, sub = string.find, string.sub
local type = type
local ngx_time = ngx.time
local os_date = os.date

local _M = {}

-- presented key -> hex digest; a worker hashes each distinct key once (pureffi: a
-- flood of random keys sets one entry each, see tokengate.count's cache).
local digests = lrucache.new(1024)

-- bearer(header) -> the token of an "Authorization: Bearer <token>" value, or nil.
-- The scheme is case-insensitive (RFC 7235); surrounding spaces are ignored.
function _M.bearer(header)
    if type(header) ~= "string" then
        return nil
    end
    local _, e = find(header, "^%s*[Bb][Ee][Aa][Rr][Ee][Rr]%s+")
    if not e then
        return nil
    end
    local token = sub(header, e + 1)
    token = (token:gsub("%s+$", ""))
    if token == "" then
        return nil
    end
    return token
end

-- digest(token) -> the SHA-256 hex digest of a presented key (cached per worker)
function _M.digest(token)
    local hex = digests:get(token)
    if not hex then
        hex = digest.sha256_hex(token)
        digests:set(token, hex)
    end
    return hex
end

local MISSING = errors.new(401, "You didn't provide an API key. Send it as "
    .. "'Authorization: Bearer <key>'.", nil, "invalid_api_key")
local INVALID = errors.new(401, "Incorrect API key provided.", nil, "invalid_api_key")
-- A disabled or expired key may say so: only the holder of its secret can present it,
-- so the answer tells a guesser nothing (an unknown key, or the old secret of a rotated
-- key past its overlap, gets INVALID).
local DISABLED = errors.new(401, "This API key is disabled. Ask the gateway's operator "
    .. "to enable it.", nil, "invalid_api_key")
_M.MISSING, _M.INVALID = MISSING, INVALID -- authenticate()'s errors, for telling them apart
_M.DISABLED = DISABLED

-- expired(at) -> the 401 of a key that expired at `at` (epoch s)
local function expired(at)
    return errors.new(401, "This API key expired at " .. os_date("!%Y-%m-%dT%H:%M:%SZ", at)
        .. ". Ask the gateway's operator for a new one.", nil, "invalid_api_key")
end

-- usable(key, now) -> key | nil, err (401 DISABLED or expired): the key's own state.
-- Times are whole seconds since the epoch, compiled into edge.json; ngx.time() is the
-- wall clock (cached per event-loop turn), so a key stops within a second of its time.
local function usable(key, now)
    if key.disabled then
        return nil, DISABLED
    end
    local at = key.expires_at
    if at and now >= at then
        return nil, expired(at)
    end
    return key
end
_M.usable = usable

-- authenticate(keys, header, presented, previous) -> key entry (from the compiled
-- config: {id, rpm, tpm, models, digest}) | nil, err (401, errors.new shape: MISSING
-- without a key, INVALID for an unknown key or a previous digest past its expiry,
-- DISABLED or an expiry message for a key that is disabled or expired).
-- presented: a key the request's API takes another way (the Messages API's x-api-key,
-- which wins), or nil: then the bearer token of header. previous: the config's
-- previous_keys (digest -> {key, expires_at}) of rotated keys, or nil.
function _M.authenticate(keys, header, presented, previous)
    local token = presented or _M.bearer(header)
    if not token then
        return nil, MISSING
    end
    local hex = _M.digest(token)
    local now = ngx_time()
    local key = keys[hex]
    if not key then
        local old = previous and previous[hex]
        if not old or now >= old.expires_at then
            return nil, INVALID
        end
        key = old.key
    end
    return usable(key, now)
end

return _M
