-- The API modules' contract (tokengate.api): every module of the registry
-- (tokengate.apis) fits the interface, and every route of every module runs through the
-- hooks the stages call, in their order, on a body of its own (SAMPLES: a route without
-- one fails here, so a new API comes with its sample). What each hook answers is each
-- module's own spec; here: that it answers in the interface's shapes.

local t = ...
local cjson = require "cjson.safe"
local json = require "tokengate.json"
local api = require "tokengate.api"
local apis = require "tokengate.apis"
local body_mod = require "tokengate.body"
local output = require "tokengate.output"

local case, eq = t.case, t.eq
-- ok(v, what): v must be truthy (t.ok wants exactly true)
local function ok(v, what)
    t.ok(v ~= nil and v ~= false, what)
end
local type = type
local pairs = pairs

local MODELS = { m = { name = "m", max_model_len = 100, max_n = 8, output_reserve = 16,
                       role_tokens = {}, structural_set = {},
                       all_tokens = { "<|im_end|>", anchor = "<" } },
                 e = { name = "e", max_model_len = 100, max_n = 8, runner = "pooling",
                       role_tokens = {}, structural_set = {},
                       all_tokens = { "<|im_end|>", anchor = "<" } } }
local EDGE = {
    structured_output = { max_bytes = 2000, max_depth = 8, max_properties = 16 },
    max_json_depth = 64, max_unknown_fields_bytes = 0, template_kwargs_allowed = {},
    special_tokens = "reject",
}

-- SAMPLES[route]: a body each route with a body takes (of model m, or e for a pooling
-- API), the smallest of its API's usual shape
local SAMPLES = {
    chat = '{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}',
    completions = '{"model":"m","prompt":"hi","max_tokens":4}',
    messages = '{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}',
    count_tokens = '{"model":"m","messages":[{"role":"user","content":"hi"}]}',
    responses = '{"model":"m","input":"hi","max_output_tokens":4}',
    input_tokens = '{"model":"m","input":"hi"}',
    embeddings = '{"model":"e","input":"hi"}',
}

-- each(fn): fn(module, route) for every route of every module of the registry
local function each(fn)
    for i = 1, #apis.MODULES do
        local mod = apis.MODULES[i]
        for route in pairs(mod.ALLOW) do
            fn(mod, route)
        end
    end
end

case("every module has every hook of the interface, its own or the default", function()
    for i = 1, #apis.MODULES do
        local mod = apis.MODULES[i]
        for name, default in pairs(api.HOOKS) do
            if default or mod[name] ~= nil then
                eq(type(mod[name]), "function", mod.NAME .. "." .. name)
            end
        end
        for name, default in pairs(api.DECLARATIONS) do
            if default then
                eq(type(mod[name]), type(default), mod.NAME .. "." .. name)
            end
        end
    end
end)

case("every route is found by its path and belongs to one module", function()
    for i = 1, #apis.MODULES do
        local mod = apis.MODULES[i]
        for path, route in pairs(mod.ROUTES) do
            eq(apis.route(path), route, path)
            ok(mod.ALLOW[route], path .. ": no ALLOW")
        end
    end
    each(function(mod, route)
        eq(apis.api(route), mod, route)
        eq(apis.ALLOW[route], mod.ALLOW[route], route)
    end)
end)

case("every route with a body has a counter endpoint, known fields and a sample", function()
    each(function(mod, route)
        if not mod.NO_BODY[route] then
            local e = mod.ENDPOINT[route]
            ok(type(e) == "number" and e >= 1 and e <= 6, route .. ": ENDPOINT " .. tostring(e))
            ok(mod.FIELDS[route] and mod.FIELDS[route].model, route .. ": no FIELDS")
            ok(SAMPLES[route], route .. ": no sample body in apis_spec.lua")
        end
    end)
end)

case("every route with a body runs through the stages' hooks", function()
    each(function(mod, route)
        if mod.NO_BODY[route] then
            return
        end
        local body = assert(json.decode(SAMPLES[route]))
        local model, err = mod.validate(route, body, MODELS, EDGE)
        ok(model, route .. ": validate: " .. tostring(err and err.message))
        eq(model.runner or "generate", mod.RUNNER, route)
        local counts = mod.sanitize(body, model, EDGE)
        eq({ counts.removed, counts.stripped, counts.escaped, counts.collapsed },
            { 0, 0, 0, 0 }, route)
        local ctx = { route = route, api = mod, key = { id = "k", digest = "d" },
                      model = model.name, replica = { name = "r" },
                      request_id = ("0"):rep(32) }
        mod.adjust(ctx, body, model)
        eq(output.check(mod, route, body, model), true, route)
        ok(mod.check(ctx, {}, body), route .. ": check")
        if mod.LOCAL[route] then
            local text = mod.count_answer(model, 7)
            ok(cjson.decode(text), route .. ": count_answer is no JSON")
            return
        end
        local counted = { prompt = 7, prompts = 1, reply = { prompt_tokens = 7,
            max_tokens_requested = 4, max_tokens_effective = 4 } }
        local out = output.budget(mod, model, body, counted, ctx.key)
        eq(out, mod.GENERATES and 4 or 0, route)
        mod.placed(ctx, body)
        -- changed by the edge: forwarded as its encoding (else the client's bytes)
        local text, encoded = body_mod.text(body)
        if encoded then
            ok(cjson.decode(text), route .. ": the body's text is no JSON")
        end
    end)
end)

case("every module answers errors, limits and usage in the interface's shapes", function()
    each(function(mod, route)
        local err = { status = 429, message = "slow down", type = "invalid_request_error",
                      code = "rate_limit_exceeded" }
        local doc = cjson.decode(mod.error_body(err))
        ok(doc and cjson.encode(doc):find("slow down", 1, true), route .. ": error_body")
        local h = {}
        mod.rate_headers(h, { rpm = 10, tpm = 100, remaining_requests = 9,
                              remaining_tokens = 90, reset_requests = 6,
                              reset_tokens = 6 })
        ok(next(h), route .. ": rate_headers set none")
        local ctx = { route = route, api = mod }
        eq(mod.sse_event(ctx, ": keep-alive"), ": keep-alive", route)
        mod.whole_usage(ctx, { object = "other" })
        eq(ctx.u_source, nil, route)
        local e = mod.upstream_error(ctx, err)
        eq(e.status, 429, route)
    end)
end)

case("define refuses a module that does not fit the interface", function()
    local function fails(mod, want)
        local good, msg = pcall(api.define, mod)
        eq(good, false)
        ok(msg:find(want, 1, true), msg)
    end
    local function hook() end
    fails({ NAME = "x", ROUTES = {}, ALLOW = {}, ROUTE = {} }, "unknown declaration ROUTE")
    fails({ NAME = "x", ROUTES = {} }, "has no ALLOW")
    fails({ NAME = "x", ROUTES = {}, ALLOW = { x = "POST" }, ENDPOINT = { x = 1 } },
        "has a body and the module no validate")
    fails({ NAME = "x", ROUTES = {}, ALLOW = { x = "POST" }, validate = hook,
            sanitize = hook }, "route x has no counter ENDPOINT")
    fails({ NAME = "x", ROUTES = {}, ALLOW = { x = "POST" }, ENDPOINT = { x = 1 },
            validate = hook, sanitize = hook, LOCAL = { x = true } },
        "LOCAL route x without count_answer")
    fails({ NAME = "x", ROUTES = {}, ALLOW = { x = "GET, HEAD" }, NO_BODY = { x = true } },
        "NO_BODY route x without without_body")
end)
