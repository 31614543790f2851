-- The shared dicts (lua_shared_dict) the edge's modules keep their cross-worker state
-- in, looked up by name once, when a module starts (init or init_worker). A missing one
-- is a configuration that lacks its lua_shared_dict line: the module refuses to start.
-- Ground floor: requires nothing.

local ngx, tostring = ngx, tostring
local ngx_now = ngx.now

local _M = {}

-- found(dict, name) -> true | nil, "shared dict not found: <name>": a module's init()
-- answer for the dict that get(name) gave it
function _M.found(dict, name)
    if not dict then
        return nil, "shared dict not found: " .. tostring(name)
    end
    return true
end

-- get(name) -> the shared dict (ngx.shared[name]) | nil, "shared dict not found: <name>"
function _M.get(name)
    local dict = ngx.shared[name]
    local ok, err = _M.found(dict, name)
    if not ok then
        return nil, err
    end
    return dict
end

-- A run of failures (an outage) shared by the workers, logged once at each end:
-- run_began(dict, key) -> true for the one call, in any worker, that began the run (its
-- start time goes to dict[key]; add() is atomic across workers), false for the others;
-- run_over(dict, key) -> the run's length (s) for the one call that ended it, nil for the
-- others and when no run is on (the start time names the run, so only one worker wins
-- the end's add(); the key goes either way).
function _M.run_began(dict, key)
    return (dict:add(key, ngx_now()))
end

function _M.run_over(dict, key)
    local since = dict:get(key)
    if not since then
        return nil
    end
    local first = dict:add(key .. ":over:" .. since, true, 60)
    dict:delete(key)
    if first then
        return ngx_now() - since
    end
    return nil
end

return _M
