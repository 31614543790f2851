-- Clocks. Durations (ttft_ms, total_ms) use CLOCK_MONOTONIC; wall-clock
-- time is only for timestamps in records and for the per-minute limit windows (which
-- every worker and every edge must agree on).

local ffi = require "ffi"

local C = ffi.C
local ffi_new = ffi.new
local floor = math.floor
local format = string.format
local os_date = os.date
local tonumber = tonumber

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

-- rfc3339_ms(t) -> "2026-11-29T16:40:00.123Z" for t = seconds since the epoch (float).
function _M.rfc3339_ms(t)
    local sec = floor(t)
    local ms = floor((t - sec) * 1000 + 0.5)
    if ms >= 1000 then
        sec, ms = sec + 1, ms - 1000
    end
    return os_date("!%Y-%m-%dT%H:%M:%S", sec) .. format(".%03dZ", ms)
end

return _M
