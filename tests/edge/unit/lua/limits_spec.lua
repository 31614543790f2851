-- tokengate.limits: the x-ratelimit-reset-* duration format (OpenAI's: "250ms", "1.2s",
-- "6m0s"), the TPM reservation of DESIGN contract 3, per-model buckets and the headers.

local t = ...
local limits = require "tokengate.limits"

local case, eq = t.case, t.eq
local duration = limits.duration

-- durations(cases) -> a case's function: duration(seconds) is the text, for each
-- {seconds, text} of cases
local function durations(cases)
    return function()
        for i = 1, #cases do
            eq(duration(cases[i][1]), cases[i][2])
        end
    end
end

case("duration: zero and below is 0s", durations({
    { 0, "0s" }, { -0.0, "0s" }, { -5, "0s" },
}))

case("duration: under a second in whole milliseconds, rounded up", durations({
    { 0.25, "250ms" }, { 0.0001, "1ms" }, { 1e-12, "1ms" }, { 0.001, "1ms" },
    { 0.0015, "2ms" }, { 0.999, "999ms" },
}))

case("duration: just under a second is 1s", durations({
    { 0.9995, "1s" }, { 0.99999, "1s" },
}))

case("duration: seconds to a tenth, rounded up, no .0", durations({
    { 1, "1s" }, { 1.2, "1.2s" }, { 1.21, "1.3s" }, { 1.25, "1.3s" }, { 2.0001, "2.1s" },
    { 59, "59s" }, { 59.9, "59.9s" },
}))

case("duration: from a minute on, minutes and whole seconds rounded up", durations({
    { 59.91, "1m0s" }, { 60, "1m0s" }, { 61.5, "1m2s" }, { 90, "1m30s" },
    { 119.01, "2m0s" }, { 120, "2m0s" }, { 360, "6m0s" },
}))

case("reservation: prompt + n x prompts x min(completion, output reserve)", function()
    local req = {}
    eq(limits.reservation(req, 100, 1, 50, 1, 256), 150)
    eq({ req.prompt, req.out_reserve, req.tokens }, { 100, 50, 150 })
    eq(limits.reservation(req, 100, 3, 4096, 2, 256), 100 + 3 * 2 * 256)
    eq({ req.prompt, req.out_reserve, req.tokens }, { 100, 1536, 1636 })
    eq(limits.reservation(req, 7, 1, 0, 1, 256), 7)
end)

case("cached weight: the key's, else the model's, else every hit counts", function()
    eq(limits.cached_weight({ cached_tokens_weight = 0.5 }, { cached_tokens_weight = 0 }), 0.5)
    eq(limits.cached_weight({}, { cached_tokens_weight = 0 }), 0)
    eq(limits.cached_weight({}, {}), 1)
end)

case("weigh: expected hits count the weight each; charged weighs vLLM's cached", function()
    local req = {}
    limits.reservation(req, 1000, 1, 50, 1, 256)
    limits.weigh(req, 0, 896)
    eq(req.tokens, 1000 - 896 + 50)
    eq(limits.charged(req, 1000, 768, 40), 1000 - 768 + 40)
    limits.reservation(req, 1000, 1, 50, 1, 256)
    limits.weigh(req, 0.25, 2000) -- never more than the prompt
    eq(req.tokens, 250 + 50)
    eq(limits.charged(req, 1000, 1000, 3), 250 + 3)
    limits.reservation(req, 1000, 1, 50, 1, 256)
    limits.weigh(req, 1, 896)
    eq(req.tokens, 1050)
    eq(limits.charged(req, 1000, 768, 40), 1040)
    limits.reservation(req, 1000, 1, 50, 1, 256)
    limits.weigh(req, 0, nil)
    eq(req.tokens, 1050)
    eq(limits.charged(req, 1000, 0, 40), 1040)
end)

case("request: a key's own window, or the model override's", function()
    local key = { id = "k1", rpm = 10, tpm = 1000, models = { m = { rpm = 2, tpm = 50 } } }
    eq(limits.request(key, "other", "rid"), { key_id = "k1", model = "other",
        per_model = false, bucket = "k1", limits = key, request_id = "rid", tokens = 0 })
    eq(limits.request(key, "m", "rid"), { key_id = "k1", model = "m", per_model = true,
        bucket = "k1@m", limits = key.models.m, request_id = "rid", tokens = 0 })
    eq(limits.request(key, nil, "rid").bucket, "k1")
end)

case("headers: limits, remaining and reset durations", function()
    local h = {}
    limits.headers(h, { rpm = 60, tpm = 10000, remaining_requests = 59,
                        remaining_tokens = 9850, reset_requests = 105, reset_tokens = 0.5 })
    eq(h, { ["x-ratelimit-limit-requests"] = 60, ["x-ratelimit-limit-tokens"] = 10000,
            ["x-ratelimit-remaining-requests"] = 59, ["x-ratelimit-remaining-tokens"] = 9850,
            ["x-ratelimit-reset-requests"] = "1m45s", ["x-ratelimit-reset-tokens"] = "500ms" })
end)
