-- The edge's own answers: a body the edge made itself (a model list, a count, a health
-- check, the status page, an error) written with its length, ending the request. Every
-- content handler and every answer of the access phase goes through here.

local ngx = ngx

local ngx_print, ngx_exit = ngx.print, ngx.exit
local pairs = pairs

local _M = {}

-- write(status, text, headers, content_type): the status, Content-Type (default
-- application/json), Content-Length (bytes of text), the extra headers (name -> value,
-- or nil) and the body; the caller ends the request (send() does).
function _M.write(status, text, headers, content_type)
    ngx.status = status
    local h = ngx.header
    h["Content-Type"] = content_type or "application/json"
    h["Content-Length"] = #text
    if headers then
        for k, v in pairs(headers) do
            h[k] = v
        end
    end
    ngx_print(text)
end

-- send(status, text, headers, content_type) -> never returns normally: write(), then
-- the request ends with status.
function _M.send(status, text, headers, content_type)
    _M.write(status, text, headers, content_type)
    return ngx_exit(status)
end

return _M
