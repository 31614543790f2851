-- A fast upstream that answers like vLLM 0.32's OpenAI server, for gateway benchmarks.
--
-- Bodies, SSE framing, field sets and order, cumulative usage chunks
-- (stream_options.continuous_usage_stats), the final `"choices": []` usage chunk
-- (stream_options.include_usage), the `data: [DONE]` terminator and the 400/404/405
-- error shapes (pydantic's validation errors for messages, prompt, max_tokens, n and a
-- temperature string that is not a number among them) are copied from the real server
-- (checked by tests/storm/test_upstream_contract.py against a live vLLM CPU server). The
-- generated text is a fixed 4-byte piece per token; every request generates exactly its
-- effective max_tokens (as vLLM with ignore_eos).
--
-- Prompt tokens: this server cannot tokenize. It takes the count from the
-- X-Token-Count request header (set by the tokengate edge, or by TokenStorm on direct
-- runs); a completions prompt given as token ids is counted exactly; anything else is
-- estimated as ceil(bytes / 4) of the text plus the chat template's per-message
-- overhead, which is not vLLM's number.
--
-- Timing: TTFT (ms) before the first token, then ITL (ms) between tokens; with ITL 0
-- the whole stream is written in one go (still one SSE event per token).
--
-- (Long for one thing: the module behind every route of the fast upstream, whose answers
-- are vLLM's byte for byte, one copied shape per route and error.)

local cjson = require "cjson.safe"

local ngx = ngx
local ngx_print = ngx.print
local ngx_flush = ngx.flush
local ngx_sleep = ngx.sleep
local ngx_time = ngx.time
local ngx_exit = ngx.exit
local ngx_var = ngx.var
local ngx_header = ngx.header
local ngx_req = ngx.req
local str_sub = string.sub
local str_rep = string.rep
local str_find = string.find
local str_format = string.format
local concat = table.concat
local tostring = tostring
local tonumber = tonumber
local type = type
local floor = math.floor
local ceil = math.ceil
local random = math.random
local io_open = io.open
local ipairs = ipairs
local pairs = pairs

local _M = { _VERSION = "0.1.0" }

-- Set once by init() in init_by_lua; read-only afterwards.
local conf = {
    model = "tiny-qwen3",
    max_model_len = 8192,
    ttft_s = 0,
    itl_s = 0,
    block_size = 128,
    fingerprint = "vllm-0.32.0-00000000",
    root = "",
    created = 0,
    vllm_version = "0.32.0",
    prompt_tokens_delta = 0,
}
local model_json = '"tiny-qwen3"'
local fp_json = '"vllm-0.32.0-00000000"'

-- 4-byte pieces: the text of C tokens is PIECES:sub(1, 4 * C).
local PIECE = " tok"
local PIECE_LEN = 4
local PIECES = ""

local seq = 0
local id_prefix = "00000000"

function _M.init(opts)
    for k, v in pairs(opts) do
        conf[k] = v
    end
    conf.ttft_s = (conf.ttft_ms or 0) / 1000
    conf.itl_s = (conf.itl_ms or 0) / 1000
    model_json = cjson.encode(conf.model)
    fp_json = cjson.encode(conf.fingerprint)
    PIECES = str_rep(PIECE, conf.max_model_len)
    conf.created = ngx_time()
    return true
end

function _M.init_worker()
    math.randomseed(ngx.worker.pid() * 1000003 + ngx.now() * 1000)
    id_prefix = str_format("%08x", random(0, 0x7fffffff))
end

local function next_id()
    seq = seq + 1
    return id_prefix .. str_format("%08x", seq % 0x100000000)
end

local function send_json(status, body, extra_headers)
    ngx.status = status
    ngx_header["Content-Type"] = "application/json"
    ngx_header["Content-Length"] = #body
    ngx_header["vary"] = "Origin"
    if extra_headers then
        for k, v in pairs(extra_headers) do
            ngx_header[k] = v
        end
    end
    ngx_print(body)
    return ngx_exit(status)
end

-- vLLM's error body: {"error":{"message","type","param","code"}}.
local function send_error(status, message, etype, param)
    local body = '{"error":{"message":' .. cjson.encode(message) .. ',"type":"' .. etype
        .. '","param":' .. (param and cjson.encode(param) or "null")
        .. ',"code":' .. status .. '}}'
    return send_json(status, body)
end

-- pydantic's validation error as vLLM reports it (type "Bad Request", param body.<loc>).
local function validation_error(vtype, loc, msg, input_repr)
    local message = "1 validation error:\n  {'type': '" .. vtype .. "', 'loc': '" .. loc
        .. "', 'msg': '" .. msg .. "', 'input': " .. input_repr .. "}"
    return send_error(400, message, "Bad Request", loc)
end

local function dict_repr(t)
    local n = 0
    for _ in pairs(t) do
        n = n + 1
    end
    return "'<dict of " .. n .. " items>'"
end

-- Python's repr of a JSON value, as pydantic quotes the input in its messages.
local function py_repr(v)
    if type(v) == "string" then
        if not str_find(v, "'", 1, true) then
            return "'" .. v .. "'"
        end
        return cjson.encode(v)
    end
    if type(v) == "table" then
        return dict_repr(v)
    end
    if v == true then
        return "True"
    end
    if v == false then
        return "False"
    end
    return tostring(v)
end

-- pydantic's lax integer: integral floats, booleans and digit strings are accepted.
local function lax_int(v)
    if type(v) == "number" then
        if v == floor(v) then
            return v
        end
        return nil, "int_from_float"
    end
    if type(v) == "boolean" then
        return v and 1 or 0
    end
    if type(v) == "string" then
        local n = tonumber(v)
        if n and n == floor(n) and str_find(v, "^%s*[-+]?%d+%s*$") then
            return n
        end
    end
    return nil, "int_parsing"
end

local function is_int(v)
    return type(v) == "number" and v == floor(v) and v > -2^53 and v < 2^53
end

local function int_str(v)
    return str_format("%d", v)
end

local function read_body()
    ngx_req.read_body()
    local body = ngx_req.get_body_data()
    if body then
        return body
    end
    -- Bodies above client_body_buffer_size are spooled to a file.
    local path = ngx_req.get_body_file()
    if not path then
        return ""
    end
    local f = io_open(path, "rb")
    if not f then
        return ""
    end
    body = f:read("*a")
    f:close()
    return body or ""
end

local function text_bytes(content)
    if type(content) == "string" then
        return #content
    end
    local n = 0
    if type(content) == "table" then
        for _, part in ipairs(content) do
            if type(part) == "table" and type(part.text) == "string" then
                n = n + #part.text
            end
        end
    end
    return n
end

-- Prompt tokens: the edge's exact count when present (plus prompt_tokens_delta, a
-- vLLM that counts otherwise), else an estimate.
local function prompt_tokens(kind, req)
    local h = tonumber(ngx_var.http_x_token_count)
    if h and h >= 0 and h == floor(h) then
        local p = h + conf.prompt_tokens_delta
        return p > 0 and p or 0
    end
    if kind == "chat" then
        -- Qwen's ChatML: <|im_start|>role\n ... <|im_end|>\n per message (5 tokens),
        -- plus <|im_start|>assistant\n (3 tokens).
        local n = 3
        for _, m in ipairs(req.messages) do
            if type(m) == "table" then
                n = n + 5 + ceil(text_bytes(m.content) / 4)
            end
        end
        return n
    end
    local p = req.prompt
    if type(p) == "table" and is_int(p[1]) then
        return #p
    end
    if type(p) == "string" then
        return ceil(#p / 4)
    end
    return 1
end

local function usage_json(p, c, details)
    return '{"prompt_tokens":' .. p .. ',"total_tokens":' .. (p + c)
        .. ',"completion_tokens":' .. c .. details
end

-- Non-streaming bodies ------------------------------------------------------------

local function chat_body(id, created, n, p, c, created_cache)
    local text = str_sub(PIECES, 1, PIECE_LEN * c)
    local choices = {}
    for i = 1, n do
        choices[i] = '{"index":' .. (i - 1) .. ',"message":{"role":"assistant","content":"'
            .. text .. '","refusal":null,"annotations":null,"audio":null,'
            .. '"function_call":null,"reasoning":null},"logprobs":null,'
            .. '"finish_reason":"length","stop_reason":null,"token_ids":null,'
            .. '"routed_experts":null}'
    end
    return '{"id":"chatcmpl-' .. id .. '","object":"chat.completion","created":' .. created
        .. ',"model":' .. model_json .. ',"choices":[' .. concat(choices, ",")
        .. '],"service_tier":null,"system_fingerprint":' .. fp_json
        .. ',"usage":' .. usage_json(p, c * n, ',"prompt_tokens_details":{"cached_tokens":0,'
            .. '"created_cache_tokens":' .. created_cache .. ',"multimodal_tokens":null},'
            .. '"completion_tokens_details":null}')
        .. ',"prompt_logprobs":null,"prompt_token_ids":null,"prompt_text":null,'
        .. '"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'
end

local function completion_body(id, created, n, p, c)
    local text = str_sub(PIECES, 1, PIECE_LEN * c)
    local choices = {}
    for i = 1, n do
        choices[i] = '{"index":' .. (i - 1) .. ',"text":"' .. text .. '","logprobs":null,'
            .. '"finish_reason":"length","stop_reason":null,"token_ids":null,'
            .. '"prompt_logprobs":null,"prompt_token_ids":null,"routed_experts":null}'
    end
    return '{"id":"cmpl-' .. id .. '","object":"text_completion","created":' .. created
        .. ',"model":' .. model_json .. ',"choices":[' .. concat(choices, ",")
        .. '],"service_tier":null,"system_fingerprint":' .. fp_json
        .. ',"usage":' .. usage_json(p, c * n, ',"prompt_tokens_details":{"cached_tokens":0,'
            .. '"created_cache_tokens":null,"multimodal_tokens":null},'
            .. '"completion_tokens_details":null}')
        .. ',"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'
end

-- Streaming -------------------------------------------------------------------------

-- One stream's constant parts, so that each event is a few concatenations.
local function stream_parts(kind, id, created)
    if kind == "chat" then
        return 'data: {"id":"chatcmpl-' .. id .. '","object":"chat.completion.chunk","created":'
            .. created .. ',"model":' .. model_json .. ',"choices":'
    end
    return 'data: {"id":"cmpl-' .. id .. '","object":"text_completion","created":' .. created
        .. ',"model":' .. model_json .. ',"choices":'
end

-- The stream as a list of events, each element one SSE event (one token after the
-- role events); vLLM's order for n > 1: every choice's role event, then tokens
-- round-robin across choices.
local function stream_events(kind, head, n, p, c, include_usage, continuous, created_cache)
    local events = {}
    local k = 0
    local per_chunk_usage = include_usage and continuous
    local cdetails = kind == "chat" and ',"completion_tokens_details":null}' or "}"
    if kind == "chat" then
        for i = 0, n - 1 do
            k = k + 1
            events[k] = head .. '[{"index":' .. i .. ',"delta":{"role":"assistant","content":""},'
                .. '"logprobs":null,"finish_reason":null}]'
                .. (per_chunk_usage and (',"usage":' .. usage_json(p, 0, cdetails)) or "")
                .. ',"prompt_token_ids":null,"prompt_text":null}\n\n'
        end
    end
    for t = 1, c do
        local piece = str_sub(PIECES, PIECE_LEN * (t - 1) + 1, PIECE_LEN * t)
        local last = t == c
        for i = 0, n - 1 do
            local finish
            if last then
                finish = '"finish_reason":"length","stop_reason":null'
            elseif kind == "chat" then
                finish = '"finish_reason":null'
            else
                finish = '"finish_reason":null,"stop_reason":null'
            end
            local choice
            if kind == "chat" then
                choice = '[{"index":' .. i .. ',"delta":{"content":"' .. piece
                    .. '"},"logprobs":null,' .. finish .. ',"token_ids":null}]'
            else
                choice = '[{"index":' .. i .. ',"text":"' .. piece .. '","logprobs":null,'
                    .. finish .. ',"prompt_token_ids":null,"token_ids":null}]'
            end
            local tail
            if per_chunk_usage then
                tail = ',"usage":' .. usage_json(p, t, cdetails) .. '}\n\n'
            elseif last and not include_usage then
                tail = ',"system_fingerprint":' .. fp_json .. '}\n\n'
            else
                tail = '}\n\n'
            end
            k = k + 1
            events[k] = head .. choice .. tail
        end
    end
    if include_usage then
        local pdetails
        if kind == "chat" then
            pdetails = ',"prompt_tokens_details":{"cached_tokens":0,"created_cache_tokens":'
                .. created_cache .. '}}'
        else
            pdetails = ',"prompt_tokens_details":{"cached_tokens":0}}'
        end
        k = k + 1
        events[k] = head .. '[],"usage":' .. usage_json(p, c * n, pdetails)
            .. ',"system_fingerprint":' .. fp_json .. '}\n\n'
    end
    k = k + 1
    events[k] = "data: [DONE]\n\n"
    return events, (kind == "chat") and n or 0
end

local function stream(kind, id, created, n, p, c, include_usage, continuous, created_cache)
    ngx.status = 200
    ngx_header["Content-Type"] = "text/event-stream; charset=utf-8"
    ngx_header["vary"] = "Origin"
    local head = stream_parts(kind, id, created)
    local events, n_role = stream_events(kind, head, n, p, c, include_usage, continuous,
                                         created_cache)
    if conf.ttft_s > 0 then
        ngx_sleep(conf.ttft_s)
    end
    local itl = conf.itl_s
    if itl <= 0 then
        ngx_print(events)
        return ngx_exit(200)
    end
    -- Role events and the first token leave together after TTFT, as in vLLM; then one
    -- token (all choices) every ITL.
    local total = #events
    local tail = include_usage and 2 or 1
    local first = n_role + n
    if first >= total - tail then
        first = total
    end
    local ok = ngx_print(concat(events, "", 1, first))
    ngx_flush(false)
    local i = first
    local state = ngx.shared.vllm_like
    while ok and i < total do
        ngx_sleep(itl)
        if state:get("asleep") then
            return ngx_exit(200) -- POST /sleep aborted it (vLLM's default mode "abort")
        end
        local upto = i + n
        if upto >= total - tail then
            upto = total  -- the last token leaves with the usage chunk and [DONE]
        end
        ok = ngx_print(concat(events, "", i + 1, upto))
        ngx_flush(false)
        i = upto
    end
    return ngx_exit(200)
end

-- Sleep mode -----------------------------------------------------------------------
--
-- vLLM's sleep-mode routes (vllm/entrypoints/serve/dev/sleep/api_router.py, served with
-- --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1): POST /sleep?level=0..2 aborts what is
-- running (its default mode "abort": a stream here stops at its next token) and answers
-- {"status": "sleeping", "level": n}; POST /wake_up waits wake_delay_ms (settable with
-- POST /tokenstorm/metrics, 0 at start: the time a GPU needs to load the weights back)
-- and answers {"status": "awake", "tags": null}; GET /is_sleeping answers
-- {"is_sleeping": bool}. A completion request that arrives while asleep is queued, not
-- refused, until a wake (vLLM's scheduler under PAUSED_NEW, vllm/v1/engine/core.py):
-- it counts in queued_asleep. sleeps, wakes and queued_asleep are read with
-- GET /tokenstorm/metrics.

local WAIT_S = 0.01 -- s: how often a queued request looks whether the engine woke

-- wait_awake(): returns once the engine is awake (at once when it is)
local function wait_awake()
    local state = ngx.shared.vllm_like
    if not state:get("asleep") then
        return
    end
    state:incr("queued_asleep", 1, 0)
    while state:get("asleep") do
        ngx_sleep(WAIT_S)
    end
end

function _M.sleep()
    if ngx_req.get_method() ~= "POST" then
        return send_json(405, '{"detail":"Method Not Allowed"}', { allow = "POST" })
    end
    local raw = ngx_var.arg_level
    local level = tonumber(raw or "1")
    if not level or level ~= floor(level) or level < 0 or level > 2 then
        -- FastAPI's query validation (Query(ge=0, le=2))
        return send_json(422, '{"detail":[{"type":"less_than_equal","loc":["query","level"],'
            .. '"msg":"Input should be a valid integer between 0 and 2","input":'
            .. cjson.encode(tostring(raw)) .. '}]}')
    end
    local state = ngx.shared.vllm_like
    state:set("asleep", true)
    state:incr("sleeps", 1, 0)
    return send_json(200, '{"status":"sleeping","level":' .. level .. '}')
end

function _M.wake_up()
    if ngx_req.get_method() ~= "POST" then
        return send_json(405, '{"detail":"Method Not Allowed"}', { allow = "POST" })
    end
    local state = ngx.shared.vllm_like
    local delay = state:get("wake_delay_ms") or 0
    if delay > 0 then
        ngx_sleep(delay / 1000)
    end
    state:delete("asleep")
    state:incr("wakes", 1, 0)
    return send_json(200, '{"status":"awake","tags":null}')
end

function _M.is_sleeping()
    local asleep = ngx.shared.vllm_like:get("asleep") == true
    return send_json(200, '{"is_sleeping":' .. tostring(asleep) .. '}')
end

-- Request handling -------------------------------------------------------------------

local function handle(kind)
    if ngx_req.get_method() ~= "POST" then
        return send_json(405, '{"detail":"Method Not Allowed"}', { allow = "POST" })
    end
    local ctype = ngx_var.content_type
    if not ctype or not str_find(ctype, "application/json", 1, true) then
        return send_error(400, "1 validation error:\n  Unsupported Media Type: Only "
            .. "'application/json' is allowed", "Bad Request", nil)
    end
    local req = cjson.decode(read_body())
    if type(req) ~= "table" or req[1] ~= nil then
        return validation_error("json_invalid", "body", "JSON decode error",
            "'<dict of 0 items>', 'ctx': {'error': 'Expecting value'}")
    end
    if kind == "chat" then
        if req.messages == nil then
            return validation_error("missing", "body.messages", "Field required",
                dict_repr(req))
        end
        if type(req.messages) ~= "table" or (next(req.messages) ~= nil
                and req.messages[1] == nil) then
            return validation_error("list_type", "body.messages",
                "Input should be a valid list", py_repr(req.messages))
        end
    elseif req.prompt == nil then
        return validation_error("missing", "body.prompt", "Field required", dict_repr(req))
    end
    local model = req.model
    if model ~= nil and model ~= cjson.null and model ~= conf.model then
        return send_error(404, "The model `" .. tostring(model) .. "` does not exist. "
            .. "Valid aliases: " .. conf.model .. ".", "NotFoundError", "model")
    end

    local max_tokens = req.max_tokens
    if kind == "chat" and req.max_completion_tokens ~= nil
            and req.max_completion_tokens ~= cjson.null then
        max_tokens = req.max_completion_tokens
    end
    if max_tokens == cjson.null then
        max_tokens = nil
    end
    if max_tokens ~= nil then
        local v, verr = lax_int(max_tokens)
        if not v then
            local msg = verr == "int_from_float"
                and "Input should be a valid integer, got a number with a fractional part"
                or "Input should be a valid integer"
            return validation_error(verr, "body.max_tokens", msg, py_repr(max_tokens))
        end
        max_tokens = v
    end
    local max_len = conf.max_model_len
    if max_tokens ~= nil then
        if max_tokens < 1 then
            return send_error(400, "max_tokens must be at least 1, got " .. int_str(max_tokens)
                .. ". (parameter=max_tokens, value=" .. int_str(max_tokens) .. ")",
                "BadRequestError", "max_tokens")
        end
        if max_tokens > max_len then
            return send_error(400, "max_tokens=" .. int_str(max_tokens)
                .. " cannot be greater than max_model_len=" .. max_len
                .. ". Please request fewer output tokens. (parameter=max_tokens, value="
                .. int_str(max_tokens) .. ")", "BadRequestError", "max_tokens")
        end
    end
    local n = req.n
    if n == nil or n == cjson.null then
        n = 1
    elseif not lax_int(n) then
        return validation_error("int_parsing", "body.n", "Input should be a valid integer",
            py_repr(n))
    else
        n = lax_int(n)
    end
    local temperature = req.temperature
    if type(temperature) == "string" and not tonumber(temperature) then
        return validation_error("float_parsing", "body.temperature",
            "Input should be a valid number, unable to parse string as a number",
            py_repr(temperature))
    end
    if n < 1 then
        return send_error(400, "n must be at least 1, got " .. int_str(n) .. ".",
            "BadRequestError", nil)
    end
    if n > 1 and req.temperature == 0 then
        return send_error(400, "n must be 1 when using greedy sampling, got " .. int_str(n)
            .. ".", "BadRequestError", nil)
    end
    local streaming = req.stream == true
    local so = req.stream_options
    if so ~= nil and so ~= cjson.null and not streaming then
        return send_error(400, "Stream options can only be defined when `stream=True`. "
            .. "(parameter=stream_options)", "BadRequestError", "stream_options")
    end

    local p = prompt_tokens(kind, req)
    if p > max_len then
        return send_error(400, "This model's maximum context length is " .. max_len
            .. " tokens. However, your prompt contains at least " .. (max_len + 1)
            .. " input tokens, which exceeds this limit even without any output tokens. "
            .. "Please reduce the length of the input prompt. (parameter=input_tokens, value="
            .. p .. ")", "BadRequestError", "input_tokens")
    end
    -- vLLM's default: the rest of the context for chat, 16 for completions (OpenAI's);
    -- prompt + max_tokens above max_model_len is clamped, not refused.
    local c = max_tokens or (kind == "chat" and max_len - p or 16)
    if c > max_len - p then
        c = max_len - p
    end
    if c < 1 then
        return send_error(400, "max_tokens must be at least 1, got " .. c
            .. ". (parameter=max_tokens, value=" .. c .. ")", "BadRequestError", "max_tokens")
    end
    -- Prefix-cache blocks this prompt would fill (vLLM CPU: 128-token blocks); nothing
    -- is ever a hit here.
    local created_cache = floor(p / conf.block_size) * conf.block_size

    wait_awake()
    local id = next_id()
    local created = ngx_time()
    if streaming then
        local include_usage, continuous = false, false
        if type(so) == "table" then
            include_usage = so.include_usage == true
            continuous = so.continuous_usage_stats == true
        end
        return stream(kind, id, created, n, p, c, include_usage, continuous, created_cache)
    end
    local total_s = conf.ttft_s + conf.itl_s * (c - 1)
    if total_s > 0 then
        ngx_sleep(total_s)
    end
    if kind == "chat" then
        return send_json(200, chat_body(id, created, n, p, c, created_cache))
    end
    return send_json(200, completion_body(id, created, n, p, c))
end

function _M.chat()
    return handle("chat")
end

function _M.completions()
    return handle("completion")
end

function _M.models()
    local body = '{"object":"list","data":[{"id":' .. model_json .. ',"object":"model",'
        .. '"created":' .. conf.created .. ',"owned_by":"vllm","root":'
        .. cjson.encode(conf.root) .. ',"parent":null,"max_model_len":' .. conf.max_model_len
        .. ',"permission":[{"id":"modelperm-' .. id_prefix .. '00000000",'
        .. '"object":"model_permission","created":' .. conf.created
        .. ',"allow_create_engine":false,"allow_sampling":true,"allow_logprobs":true,'
        .. '"allow_search_indices":false,"allow_view":true,"allow_fine_tuning":false,'
        .. '"organization":"*","group":null,"is_blocking":false}]}]}'
    return send_json(200, body)
end

-- GET /version: vLLM's {"version": "<vllm.__version__>"}
function _M.version()
    return send_json(200, '{"version":' .. cjson.encode(conf.vllm_version) .. '}')
end

function _M.not_found()
    return send_json(404, '{"detail":"Not Found"}')
end

-- Engine metrics -------------------------------------------------------------------
--
-- GET /metrics serves, in vLLM 0.32's exposition (names, help, labels model_name and
-- engine: vllm/v1/metrics/loggers.py), the gauges a test sets with POST
-- /tokenstorm/metrics (JSON: kv_cache_usage_perc 0..1, num_requests_waiting,
-- num_requests_running; all 0 at start; metrics_delay_ms: how long /metrics waits
-- before answering, to stand for a replica that stops answering), the TTFT
-- histogram's sum and count it sets the same way (time_to_first_token_seconds_sum,
-- s, and _count; one +Inf bucket holding the count) and
-- vllm:request_success_total, the answers with status 200 it sent (finished_reason
-- "length": every request generates its whole max_tokens). The state is in the
-- shared dict vllm_like, common to the workers.

local SETTABLE = { kv_cache_usage_perc = true, num_requests_waiting = true,
                   num_requests_running = true, metrics_delay_ms = true,
                   wake_delay_ms = true, time_to_first_token_seconds_sum = true,
                   time_to_first_token_seconds_count = true }
local COUNTED = { "sleeps", "wakes", "queued_asleep" } -- read-only (sleep mode)

local GAUGES = {
    { "num_requests_running", "Number of requests in model execution batches." },
    { "num_requests_waiting", "Number of requests waiting to be processed." },
    { "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage." },
}

-- value(v) -> v as prometheus_client writes a float ("3.0", "0.95")
local function value(v)
    if v == floor(v) then
        return str_format("%d.0", v)
    end
    return tostring(v)
end

function _M.metrics()
    local state = ngx.shared.vllm_like
    local delay = state:get("metrics_delay_ms") or 0
    if delay > 0 then
        ngx_sleep(delay / 1000)
    end
    local labels = '{engine="0",model_name=' .. model_json .. '}'
    local out = {}
    for _, g in ipairs(GAUGES) do
        local name = "vllm:" .. g[1]
        out[#out + 1] = "# HELP " .. name .. " " .. g[2] .. "\n# TYPE " .. name .. " gauge\n"
            .. name .. labels .. " " .. value(state:get(g[1]) or 0) .. "\n"
    end
    local n = value(state:get("time_to_first_token_seconds_count") or 0)
    out[#out + 1] = "# HELP vllm:time_to_first_token_seconds Histogram of time to first "
        .. "token in seconds.\n# TYPE vllm:time_to_first_token_seconds histogram\n"
        .. 'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name='
        .. model_json .. "} " .. n .. "\n"
        .. "vllm:time_to_first_token_seconds_count" .. labels .. " " .. n .. "\n"
        .. "vllm:time_to_first_token_seconds_sum" .. labels .. " "
        .. value(state:get("time_to_first_token_seconds_sum") or 0) .. "\n"
    out[#out + 1] = "# HELP vllm:request_success_total Count of successfully processed "
        .. "requests.\n# TYPE vllm:request_success_total counter\n"
        .. 'vllm:request_success_total{engine="0",finished_reason="length",model_name='
        .. model_json .. "} " .. value(state:get("request_success") or 0) .. "\n"
    local body = concat(out)
    ngx.status = 200
    ngx_header["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
    ngx_header["Content-Length"] = #body
    ngx_print(body)
    return ngx_exit(200)
end

-- POST /tokenstorm/metrics {"kv_cache_usage_perc": 0.95, ...}: sets the fields given
-- (numbers >= 0, SETTABLE); answers the fields' values after the change, and the sleep
-- mode's COUNTED ones. GET answers them unchanged.
function _M.set_metrics()
    local state = ngx.shared.vllm_like
    local req = ngx_req.get_method() == "GET" and {} or cjson.decode(read_body())
    if type(req) ~= "table" then
        return send_error(400, "expected a JSON object", "BadRequestError", nil)
    end
    for k, v in pairs(req) do
        if not SETTABLE[k] or type(v) ~= "number" or v < 0 then
            return send_error(400, "unknown field or not a number >= 0: " .. tostring(k),
                "BadRequestError", tostring(k))
        end
    end
    local now = {}
    for k in pairs(SETTABLE) do
        if req[k] then
            state:set(k, req[k])
        end
        now[k] = state:get(k) or 0
    end
    for _, k in ipairs(COUNTED) do
        now[k] = state:get(k) or 0
    end
    return send_json(200, cjson.encode(now))
end

-- log phase of the completion routes: one more finished request when the answer was 200
function _M.finished()
    if ngx.status == 200 then
        ngx.shared.vllm_like:incr("request_success", 1, 0)
    end
end

return _M
