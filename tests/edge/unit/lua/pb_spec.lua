-- tokengate.pb: the counter frames and the limits messages, encoded and decoded by hand.
-- Expected bytes are those of Python's SerializeToString for the same messages
-- (tokengate.v1.counter_pb2 / limits_pb2), computed once and pinned here.

local t = ...
local pb = require "tokengate.pb"

local case, eq, hex, unhex = t.case, t.eq, t.hex, t.unhex

-- flat(pieces) -> the bytes of a list of pieces (nested lists), as a cosocket sends them
local function flat(p)
    if type(p) == "string" then
        return p
    end
    local out = {}
    for i = 1, #p do
        out[i] = flat(p[i])
    end
    return table.concat(out)
end

-- ------------------------------------------------------------ encoders

case("reserve_request: varints at the 1- and 2-byte boundaries", function()
    -- key_id "k", rpm 127, tpm 128, tokens 16384, request_id "r"
    eq(hex(pb.reserve_request("k", "", false, 127, 128, 16384, "r")),
        "0a016b207f288001308080013a0172")
end)

case("reserve_request: 2^53, 2^53 + 2 and the largest double below 2^64 are exact",
    function()
        eq(hex(pb.reserve_request("", "", false, 2 ^ 53, 2 ^ 53 + 2, 2 ^ 64 - 2048, "")),
            "2080808080808080102882808080808080103080f0ffffffffffffff01")
        eq(hex(pb.reserve_request("", "", false, 2 ^ 32, 1e12, 2 ^ 63, "")),
            "2080808080102880a094a58d1d3080808080808080808001")
    end)

case("reserve_request: proto3 defaults are omitted", function()
    eq(pb.reserve_request("", "", false, 0, 0, 0, ""), "")
end)

case("reserve_request: strings of 128 bytes and more take a 2-byte length", function()
    eq(hex(pb.reserve_request(string.rep("\195\169", 100), "m", true, 1, 1, 1, "x")),
        "0ac801" .. string.rep("c3a9", 100) .. "12016d18012001280130013a0178")
end)

case("settle_request", function()
    eq(hex(pb.settle_request("k", "", false, "rid", 300)), "0a016b220372696428ac02")
    eq(hex(pb.settle_request("k", "m", true, "r", 0)), "0a016b12016d1801220172")
end)

case("budget_request: nested counters, a counter of defaults is an empty message",
    function()
        local counters = {
            { counter = "*:day:20790", spend_limit_nano = 1e18, token_limit = 0,
              ttl_s = 172800 },
            { counter = "m:month:683", spend_limit_nano = 0, token_limit = 1e12,
              ttl_s = 2851200 },
            { counter = "", spend_limit_nano = 0, token_limit = 0, ttl_s = 0 },
        }
        eq(hex(pb.budget_request("k1", "r1", counters, 2 ^ 60, 1)),
            "0a026b31120272311a1b0a0b2a3a6461793a323037393010808090bbbad6adf00d2080c60a1a19"
            .. "0a0b6d3a6d6f6e74683a3638331880a094a58d1d208083ae011a00208080808080808080102801")
        eq(hex(pb.budget_request("k1", "r1", {}, 0, 0)), "0a026b3112027231")
    end)

case("uint fields refuse what a uint64 cannot hold, naming the field", function()
    local function refused(n, text)
        t.raises(function() pb.reserve_request("k", "m", false, 1, 1, n, "r") end,
            "tokengate.pb: field 6: " .. text .. " is not an integer in 0..2^64-1")
    end
    refused(-1, "-1")
    refused(0.5, "0.5")
    refused(math.huge, "inf")
    refused(-math.huge, "-inf")
    refused(2 ^ 64, "1.844674407371e+19")
    refused("5", "5")
    t.raises(function() pb.settle_request("k", "m", false, "r", 0 / 0) end,
        "tokengate.pb: field 5: nan is not an integer in 0..2^64-1")
    t.raises(function()
        pb.budget_request("k", "r", { { counter = "c", spend_limit_nano = 1.5, token_limit = 0,
                                        ttl_s = 1 } }, 1, 1)
    end, "tokengate.pb: field 2: 1.5 is not an integer in 0..2^64-1")
end)

case("count_request: two pieces, the body itself not copied", function()
    local body = '{"prompt":"hi"}'
    local pieces = pb.count_request("qwen", 2, body)
    eq(#pieces, 2)
    eq(hex(pieces[1]), "0a047177656e10021a0f")
    eq(pieces[2] == body, true)
    eq(hex(flat(pieces)), "0a047177656e10021a0f7b2270726f6d7074223a226869227d")
end)

case("count_request: a body of 200 bytes has a 2-byte length", function()
    eq(hex(pb.count_request("m", 1, string.rep("x", 200))[1]), "0a016d10011ac801")
end)

case("frame: the 5-byte header of sizes across byte boundaries", function()
    local function header(n)
        local f, size = pb.frame(string.rep("x", n))
        eq(size, 5 + n)
        return hex(f[1])
    end
    eq(header(0), "0000000000")
    eq(header(255), "00000000ff")
    eq(header(256), "0000000100")
    eq(header(65537), "0000010001")
    eq(header(16777217), "0001000001")
end)

case("frame: pieces are counted, not copied", function()
    local msg = { "ab", "cde" }
    local f, size = pb.frame(msg)
    eq(size, 10)
    eq(f[2] == msg, true)
    eq(hex(flat(f)), "00000000056162636465")
end)

case("unframe: the first message; short, compressed, truncated frames refused", function()
    eq(pb.unframe("\0\0\0\0\3abcdef"), "abc")
    eq(pb.unframe("\0\0\0\0\0"), "")
    eq({ pb.unframe("\0\0\0\0") }, { nil, "short gRPC frame" })
    eq({ pb.unframe("\1\0\0\0\1a") }, { nil, "compressed gRPC frame" })
    eq({ pb.unframe("\0\0\0\0\4abc") }, { nil, "truncated gRPC frame" })
    eq({ pb.unframe("\0\1\0\0\0abc") }, { nil, "truncated gRPC frame" })
end)

-- ------------------------------------------------------------ decoders

case("count_reply: every field, the breakdown nested", function()
    eq(pb.count_reply(unhex("08d2091080c00218aeb6022a07080a18b009201832097368613235363a61"
        .. "623a0268664001")), {
        prompt_tokens = 1234, max_model_len = 40960, max_tokens_effective = 39726,
        max_tokens_requested = 0, prompt_count = 1, tokenizer_fingerprint = "sha256:ab",
        tokenizer_backend = "hf", block_hashes = "", block_size = 0, prefix_hits = {},
        breakdown = { system = 10, tools = 0, messages = 1200, template_overhead = 24 } })
end)

case("count_reply: block hashes, block size and repeated prefix hits, in order", function()
    -- CountReply(prompt_tokens=40, block_hashes=bytes(1..16), block_size=16,
    -- prefix_hits=[("10.0.0.1:8000", 32), ("b:1", 0), ("c:2", 300)]): the second hit's
    -- cached_tokens is the proto3 default, absent from the bytes
    local r = pb.count_reply(unhex("08284a100102030405060708090a0b0c0d0e0f1050105a110a0d3130"
        .. "2e302e302e313a3830303010205a050a03623a315a080a03633a3210ac02"))
    eq(r.block_hashes, unhex("0102030405060708090a0b0c0d0e0f10"))
    eq(r.block_size, 16)
    eq(r.prefix_hits, { { upstream = "10.0.0.1:8000", cached_tokens = 32 },
                        { upstream = "b:1", cached_tokens = 0 },
                        { upstream = "c:2", cached_tokens = 300 } })
end)

case("count_reply: a malformed prefix hit is refused", function()
    eq({ pb.count_reply("\90\1\16") }, { nil, "bad varint" })
end)

case("count_reply: absent fields take proto3 defaults", function()
    eq(pb.count_reply("\8\7"), {
        prompt_tokens = 7, max_model_len = 0, max_tokens_effective = 0,
        max_tokens_requested = 0, prompt_count = 0, tokenizer_fingerprint = "",
        tokenizer_backend = "", block_hashes = "", block_size = 0, prefix_hits = {},
        breakdown = { system = 0, tools = 0, messages = 0, template_overhead = 0 } })
    eq(pb.count_reply("").prompt_tokens, 0)
end)

case("decoders skip unknown fields of every wire type", function()
    -- field 15 varint, field 14 bytes, field 13 fixed64, field 12 fixed32, then field 1
    local r = pb.count_reply(unhex("78ff0172026869" .. "69" .. "0102030405060708"
        .. "65" .. "01020304" .. "0805"))
    eq(r.prompt_tokens, 5)
end)

case("decoders refuse malformed messages", function()
    eq({ pb.count_reply("\8") }, { nil, "bad varint" })
    eq({ pb.count_reply("\8\128") }, { nil, "bad varint" })
    eq({ pb.count_reply("\128") }, { nil, "bad tag" })
    eq({ pb.count_reply("\50\5abc") }, { nil, "bad length" })
    eq({ pb.count_reply("\11") }, { nil, "unsupported wire type 3" })
    eq({ pb.count_reply("\12") }, { nil, "unsupported wire type 4" })
    eq({ pb.count_reply("\42\1\8") }, { nil, "bad varint" }) -- inside the breakdown
    eq({ pb.count_reply("\42\2\8") }, { nil, "bad length" })
    eq({ pb.count_reply("\8" .. string.rep("\128", 10) .. "\1") }, { nil, "bad varint" })
end)

case("decoders refuse a fixed64 or fixed32 field cut short", function()
    eq({ pb.count_reply("\105\1\2\3") }, { nil, "bad fixed64" })
    eq({ pb.count_reply("\105\1\2\3\4\5\6\7") }, { nil, "bad fixed64" })
    eq({ pb.count_reply("\101\1") }, { nil, "bad fixed32" })
    eq({ pb.count_reply("\101\1\2\3") }, { nil, "bad fixed32" })
    -- one that ends the message exactly is whole
    eq(pb.count_reply("\8\5\105\1\2\3\4\5\6\7\8").prompt_tokens, 5)
    eq(pb.count_reply("\8\5\101\1\2\3\4").prompt_tokens, 5)
end)

case("reserve_reply: booleans, uint64 up to 2^64 - 1, uint32 up to 2^32 - 1", function()
    eq(pb.reserve_reply(unhex("080120828080808080801028ffffffffffffffffff0130ffffffff0f38e0"
        .. "d403")), {
        admitted = true, limited_by = 0, never_fits = false, remaining_requests = 2 ^ 53 + 2,
        remaining_tokens = 2 ^ 64, reset_requests_ms = 2 ^ 32 - 1, reset_tokens_ms = 60000,
        retry_after_ms = 0, level = 0 })
    eq(pb.reserve_reply(""), {
        admitted = false, limited_by = 0, never_fits = false, remaining_requests = 0,
        remaining_tokens = 0, reset_requests_ms = 0, reset_tokens_ms = 0, retry_after_ms = 0,
        level = 0 })
end)

case("reserve_reply: a uint64 above 2^53 decodes to the nearest double", function()
    -- 2^63 + 2^55 + 1025: the nearest double is 2^63 + 2^55 + 2048
    eq(pb.reserve_reply(unhex("2881888080808080c08001")).remaining_tokens,
        2 ^ 63 + 2 ^ 55 + 2048)
end)

case("settle_reply: zigzag-decoded delta", function()
    eq(pb.settle_reply(unhex("08011001")), { found = true, delta = -1, window_tokens = 0 })
    eq(pb.settle_reply(unhex("1002")).delta, 1)
    eq(pb.settle_reply(unhex("10ffffffffff3f")).delta, -2 ^ 40)
    eq(pb.settle_reply(unhex("10808080808040")).delta, 2 ^ 40)
    eq(pb.settle_reply(unhex("10ffffffffffffff0f")).delta, -2 ^ 52)
    eq(pb.settle_reply(""), { found = false, delta = 0, window_tokens = 0 })
end)

case("budget_reserve_reply: one usage per counter, empty ones included", function()
    eq(pb.budget_reserve_reply(unhex("0801220c08808090bbbad6adf00d1005220022020807")), {
        admitted = true, refused = 0, limited_by = 0,
        usage = { { spent_nano = 1e18, tokens = 5 }, { spent_nano = 0, tokens = 0 },
                  { spent_nano = 7, tokens = 0 } } })
    eq(pb.budget_reserve_reply(""), { admitted = false, refused = 0, limited_by = 0,
                                      usage = {} })
end)

case("budget_settle_reply", function()
    eq(pb.budget_settle_reply(unhex("08011001")), { applied = true, reserved = true })
    eq(pb.budget_settle_reply(unhex("1001")), { applied = false, reserved = true })
    eq({ pb.budget_settle_reply("\8") }, { nil, "bad varint" })
end)

case("encode then decode: 1e18 nano-units stay exact", function()
    eq(hex(pb.budget_request("", "", {}, 1e18, 0)), "20808090bbbad6adf00d")
    eq(pb.budget_reserve_reply(unhex("220a08808090bbbad6adf00d")).usage[1].spent_nano, 1e18)
end)
