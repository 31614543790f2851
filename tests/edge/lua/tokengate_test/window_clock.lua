-- The movable clock of the limit windows on a test edge (see tokengate.clock). The test
-- edges have this folder on their Lua path (LUA_PATH); no install ships it.
--
-- The clock is set by the file "window_clock" in the nginx prefix, one line:
--     at <t>        the windows' clock stands still at t (seconds since the epoch)
--     offset <s>    the windows' clock is ngx.now() + s
-- and is ngx.now() while the file is absent. The file is read on every call: a test
-- edge's requests are few, and a write is seen by every worker at once.

local ngx = ngx
local ngx_now = ngx.now
local io_open = io.open
local match = string.match
local tonumber = tonumber
local tostring = tostring

local _M = {}

local prefix = ngx.config.prefix()
if prefix:sub(-1) ~= "/" then
    prefix = prefix .. "/"
end
local PATH = prefix .. "window_clock"

-- now() -> seconds since the epoch (float) of the windows' clock
function _M.now()
    local f = io_open(PATH, "r")
    if not f then
        return ngx_now()
    end
    local line = f:read("*l")
    f:close()
    local mode, value = match(line or "", "^(%a+) (%S+)$")
    value = tonumber(value)
    if mode == "at" and value then
        return value
    elseif mode == "offset" and value then
        return ngx_now() + value
    end
    error("window_clock: expected 'at <t>' or 'offset <s>', got " .. tostring(line))
end

return _M
