-- Clocks. Durations (ttft_ms, total_ms) use CLOCK_MONOTONIC; wall-clock
-- time is only for timestamps in records and for the per-minute limit windows (which
-- every worker and every edge must agree on).
--
-- The limit windows read window_now(). On a production edge it is ngx.now itself (the
-- same function, no wrapper, nothing to configure). A test edge can move it: when the
-- module tokengate_test.window_clock is on lua_package_path, window_now is that
-- module's now(). That module lives in the tests' tree (tests/edge/lua/), which no
-- install ships, and only the tests' own nginx processes have it on their path (through
-- LUA_PATH, which the ";;" of lua_package_path expands to): an edge cannot get a movable
-- clock from its configuration file, by accident or otherwise.

local ffi = require "ffi"

local C, ffi_new = ffi.C, ffi.new
local floor = math.floor
local format = string.format
local os_date = os.date
local tonumber, ngx, package, require = tonumber, ngx, package, require

ffi.cdef [[
typedef long tg_time_t;
struct tg_timespec { tg_time_t tv_sec; long tv_nsec; };
int clock_gettime(int clk_id, struct tg_timespec *tp);
]]

local CLOCK_MONOTONIC = 1
local ts = ffi_new("struct tg_timespec")

local _M = {}

-- mono_ms() -> milliseconds (float, µs resolution) of CLOCK_MONOTONIC; only differences
-- between two calls mean anything.
function _M.mono_ms()
    C.clock_gettime(CLOCK_MONOTONIC, ts)
    return tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
end

-- round3(ms) -> ms rounded to 3 decimals (a duration of mono_ms's µs resolution, as
-- the usage event and the trace record it)
function _M.round3(x)
    return floor(x * 1000 + 0.5) / 1000
end

-- window_now() -> seconds since the epoch (float, ms resolution): the clock that numbers
-- the per-minute limit windows (tokengate.local_limit).
_M.window_now = ngx.now
local TEST_CLOCK = "tokengate_test.window_clock"
if package.searchpath(TEST_CLOCK, package.path) then
    -- found, so loaded for real: a test clock with an error fails the edge's start
    _M.window_now = require(TEST_CLOCK).now
end

-- the last second rfc3339_ms formatted, and its text: every usage event formats its
-- request's start, and requests of the same second share the date (os.date is a C call
-- that LuaJIT's traces cannot hold, and a new string each time)
local last_sec, last_text = nil, nil

-- rfc3339_ms(t) -> "2026-11-29T16:40:00.123Z" for t = seconds since the epoch (float).
function _M.rfc3339_ms(t)
    local sec = floor(t)
    local ms = floor((t - sec) * 1000 + 0.5)
    if ms >= 1000 then
        sec, ms = sec + 1, ms - 1000
    end
    if sec ~= last_sec then
        last_sec, last_text = sec, os_date("!%Y-%m-%dT%H:%M:%S", sec)
    end
    return last_text .. format(".%03dZ", ms)
end

return _M
