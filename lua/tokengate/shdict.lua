-- The shared dicts (lua_shared_dict) the edge's modules keep their cross-worker state
-- in, looked up by name once, when a module starts (init or init_worker). A missing one
-- is a configuration that lacks its lua_shared_dict line: the module refuses to start.
-- Ground floor: requires nothing.

local ngx = ngx
local tostring = tostring

local _M = {}

-- get(name) -> the shared dict (ngx.shared[name]) | nil, "shared dict not found: <name>"
function _M.get(name)
    local dict = ngx.shared[name]
    if not dict then
        return nil, "shared dict not found: " .. tostring(name)
    end
    return dict
end

return _M
