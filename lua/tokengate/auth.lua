-- API keys: `Authorization: Bearer <key>` (or what an API module reads: the Messages
-- API's x-api-key). The configuration stores only SHA-256 hex
-- digests (never keys), so the edge hashes the presented key and looks the digest up.
-- SHA-256: tokengate.digest.

local lrucache = require "resty.lrucache"
local errors = require "tokengate.errors"
local digest = require "tokengate.digest"

local find = string.find
local sub = string.sub
local type = type

local _M = {}

-- presented key -> hex digest; a worker hashes each distinct key once.
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

local MISSING = errors.new(401, "You didn't provide an API key. Send it as "
    .. "'Authorization: Bearer <key>'.", nil, "invalid_api_key")
local INVALID = errors.new(401, "Incorrect API key provided.", nil, "invalid_api_key")
_M.MISSING, _M.INVALID = MISSING, INVALID -- authenticate()'s errors, for telling them apart

-- authenticate(keys, header, presented) -> key entry (from the compiled config: {id,
-- rpm, tpm, models, digest}) | nil, err (401, errors.new shape: MISSING without a key,
-- else INVALID). presented: a key the request's API takes another way (the Messages
-- API's x-api-key, which wins), or nil: then the bearer token of header.
function _M.authenticate(keys, header, presented)
    local token = presented or _M.bearer(header)
    if not token then
        return nil, MISSING
    end
    local hex = digests:get(token)
    if not hex then
        hex = digest.sha256_hex(token)
        digests:set(token, hex)
    end
    local key = keys[hex]
    if not key then
        return nil, INVALID
    end
    return key
end

return _M
