-- The request's state: every field of ngx.ctx that the edge's modules share, its type
-- and the modules that write it, in the order a request fills them in. A module reads
-- and writes only the fields declared here, and writes only those it is named a writer
-- of; tests/edge/unit/test_lua_state.py checks every `ctx.<field>` of lua/tokengate/
-- against this list. Nothing else lives in ngx.ctx (the per-request table ngx_lua
-- keeps across a request's phases; an internal redirect, such as nginx's error_page,
-- starts an empty one).
--
-- A field is a plain Lua value: "string", "number" (tokens, ms, s as named), "boolean",
-- "table" (its shape in the writer's docstring), and "|nil" where it may be unset.
-- Writers are module names below tokengate. ("stages.read" is tokengate.stages.read);
-- "apis" stands for every API module (tokengate.apis.*), which write what their hooks
-- are documented to write (tokengate.api).
-- This module is the ground floor: it requires nothing. At run time it gives the one
-- field read lazily, request_id.

local ngx = ngx

local _M = {}

-- request_id(ctx) -> the request's $request_id (32 hex digits), kept in ctx.request_id:
-- an ngx.var read looks the variable up by its name each time, and the phases need the
-- id several times (the header X-Request-Id, the limits, the usage event, the trace).
function _M.request_id(ctx)
    local id = ctx.request_id
    if not id then
        id = ngx.var.request_id
        ctx.request_id = id
    end
    return id
end

-- FIELDS[name] = { type, writers (space-separated), meaning }
_M.FIELDS = {
    -- access begins (tokengate.phases), before any stage
    t0 = { "number", "phases", "monotonic ms when the access phase began (tokengate.clock)" },
    uri = { "string", "phases", "the client's path, nginx's normalized $uri, before set_uri" },
    route = { "string|nil", "phases", "the route name (tokengate.apis.route); nil: no route" },
    model_id = { "string|nil", "phases", "the id in the path: GET /v1/models/{id}, a response id" },
    api = { "table|nil", "phases", "the route's API module (tokengate.apis.api; "
        .. "tokengate.api.BASE for a path that is no route); nil before access" },
    endpoint = { "string", "phases", "the usage event's endpoint (tokengate.apis.endpoint)" },
    request_id = { "string|nil", "state batch", "$request_id (32 hex), kept by request_id() below" },
    preflight = { "string|nil", "cors", "a CORS preflight: \"allowed\" | \"refused\"" },
    session_id = { "string|nil", "session", "the agent session (tokengate.session)" },
    session_source = { "string|boolean|nil", "session", "the header or field that named the "
        .. "session; false: no header named it" },
    trace = { "table|nil", "trace", "the request's trace (tokengate.trace.start)" },

    -- read: the key and the route (tokengate.stages.read)
    unauthenticated = { "string|nil", "stages.read", "why there is no key: the status "
        .. "counter's name" },
    key = { "table|nil", "stages.read phases", "the compiled API key (tokengate.auth)" },
    limit_req = { "table|nil", "stages.read", "the limits the request is held to "
        .. "(tokengate.limits.request: built once, its model named later)" },
    rate = { "table|nil", "stages.read stages.validate stages.admit apis", "the key's window "
        .. "state for the limit headers (tokengate.limits.peek, reserve)" },
    batch = { "table|nil", "batch", "a line of a batch sent by the batch service "
        .. "(tokengate.batch.act_for): {id, custom_id, check}" },
    no_body = { "boolean|nil", "stages.read", "the route has no body (its API's NO_BODY): "
        .. "no body, no count" },

    -- validate: the body, its model, its session (tokengate.stages.validate)
    model = { "string|nil", "stages.validate apis", "the served model's name" },
    model_entry = { "table|nil", "stages.validate apis", "the compiled model" },
    stream = { "boolean|nil", "stages.validate apis", "the client asked for a stream" },
    sanitized = { "table|nil", "stages.validate", "the sanitizer's counts {removed, "
        .. "stripped, escaped, collapsed} (tokengate.sanitize)" },
    body = { "table|nil", "stages.validate", "the parsed body (tokengate.json object; its "
        .. "text: tokengate.body.text)" },
    history = { "boolean|nil", "apis", "the body continues a stored history the counter "
        .. "cannot see (previous_response_id): count source \"history\"" },
    pin = { "table|nil", "apis", "the replica the request must go to (the one holding the "
        .. "response it names)" },

    -- count: the prompt, the completion budget, the reservation (tokengate.stages.count)
    count_s = { "number|nil", "stages.count", "seconds the count took" },
    token_estimate = { "number|nil", "stages.count apis", "the prompt's tokens as counted" },
    count_source = { "string|nil", "stages.count", "\"counter\" | \"estimate\" | \"history\"" },
    system_tokens = { "number|nil", "stages.count", "the system messages' tokens" },
    prompt_count = { "number|nil", "stages.count", "prompts in the request (completions lists)" },
    n = { "number|nil", "stages.count", "completions per prompt (the body's n)" },
    prefix_plan = { "table|nil", "stages.count", "the prompt's blocks for prefix routing "
        .. "(tokengate.prefix.plan)" },
    slo = { "table|nil", "stages.route slo", "latency targets, class and the prediction's "
        .. "decision (tokengate.slo; routing.policy slo)" },
    local_answer = { "string|nil", "stages.count", "the edge's own answer (count_tokens, "
        .. "input_tokens), sent once admitted" },
    max_tokens_requested = { "number|nil", "stages.count", "the client's completion limit" },
    max_tokens_applied = { "number|nil", "stages.count", "the completion limit forwarded and "
        .. "reserved" },
    max_tokens_capped_by = { "string|nil", "stages.count", "\"model\" | \"key\": whose cap "
        .. "lowered the client's limit" },

    -- route: the replica, the queue (tokengate.stages.route, tokengate.upstream,
    -- tokengate.queue)
    replica = { "table|nil", "upstream", "the chosen replica (a compiled upstream entry)" },
    replica_model = { "string|nil", "upstream", "the model whose replica holds the request's "
        .. "tokens (tokengate.upstream.take, release)" },
    replica_tokens = { "number|nil", "upstream", "the tokens the replica holds for the request" },
    replica_paced = { "boolean|nil", "upstream", "its priority paces prefills "
        .. "(max_prefill_tokens): counted among the replica's paced requests" },
    prefix_expected = { "number|nil", "upstream", "prompt tokens the replica is expected to "
        .. "serve from its prefix cache" },
    prefix_source = { "string|nil", "upstream", "\"events\" | \"approximate\": where that "
        .. "expectation came from" },
    queue = { "table|nil", "queue", "the request's place in its key's queue (tokengate.queue)" },
    queue_ms = { "number|nil", "stages.route queue", "ms waited in the queue (0 while "
        .. "queueing is on)" },
    response_id = { "string|nil", "apis", "the id of the response the request makes "
        .. "(tokengate.apis.responses.placed)" },
    want_usage = { "boolean|nil", "apis.openai", "the client's stream_options.include_usage" },
    want_continuous = { "boolean|nil", "apis.openai", "the client's "
        .. "stream_options.continuous_usage_stats" },
    proxied = { "boolean|nil", "stages.route", "the request was forwarded" },
    balanced = { "boolean|nil", "stages.route", "the balancer ran once (a second run is a retry)" },
    tried = { "table|nil", "stages.route", "replica name -> true: replicas that failed it" },

    -- admit: the limit tiers (tokengate.stages.admit)
    limits_tier = { "string|nil", "stages.admit", "the tier that decided: \"local\" | "
        .. "\"global\"" },

    -- the answer: headers and body filters (tokengate.stages.respond, tokengate.usage)
    status_sent = { "number|nil", "stages.respond", "the status the client was sent" },
    replace_body = { "string|nil", "stages.respond", "the error body that replaces an "
        .. "nginx error page" },
    upstream_error = { "table|nil", "stages.respond", "the backend's error body, collected "
        .. "to be rewritten in the API's shape" },
    sse = { "boolean|nil", "stages.respond", "the answer is an event stream" },
    t_first = { "number|nil", "stages.respond", "monotonic ms of the answer's first byte" },
    eof = { "boolean|nil", "stages.respond", "the answer's last byte passed" },
    error = { "string|nil", "errors stages.respond usage apis phases", "the usage event's "
        .. "error: the code (or type) of what the request ended with" },
    sse_rest = { "string|nil", "usage", "a stream's partial event, held until its end" },
    sse_done = { "boolean|nil", "usage apis", "the stream's end event passed" },
    sse_seen = { "boolean|nil", "usage", "an event of the stream was read" },
    refused_in_stream = { "boolean|nil", "usage", "the stream's first event was an error: "
        .. "vLLM refused the request before generating (billed nothing)" },
    json_parts = { "table|nil", "usage", "a whole JSON answer's chunks, read at its end" },
    m_deltas = { "number|nil", "apis", "the stream's text deltas so far (an API's running "
        .. "output count)" },
    u_prompt = { "number|nil", "usage apis", "prompt tokens vLLM reported (cumulative: the "
        .. "last value wins)" },
    u_completion = { "number|nil", "usage apis", "completion tokens vLLM reported" },
    u_cached = { "number|nil", "usage apis", "prompt tokens vLLM served from its prefix cache" },
    u_source = { "string|nil", "usage apis", "\"final\" | \"running\": which usage was seen" },
}

return _M
