-- Sanitizing the strings a model reads, after strict JSON decoding (so escapes such as
-- \u200b are already characters and every string is valid UTF-8). Every API module
-- walks its own body shape with the visitors at the end of this file. (Over 600 lines:
-- cleaning, the token policies and the visitors share one per-request state and one
-- first-refusal rule, and are proven together by sanitize_spec.lua.)
--
-- Removed, everywhere the model reads text: invisible characters with no meaning
-- (U+200B, U+2060, U+FEFF, U+00AD, U+180E, invisible operators U+2061..U+2064, bidi
-- marks U+200E/U+200F/U+061C, embeddings/overrides U+202A..U+202E, isolates
-- U+2066..U+2069), tag characters U+E0000..U+E007F (they can spell out hidden ASCII) and
-- C0/C1 controls except TAB, LF, CR (DEL U+007F goes with them).
-- Kept: U+200C/U+200D (ZWNJ/ZWJ), which Persian, Indic scripts and emoji sequences need,
-- U+FE0F (emoji presentation), and the tags of an emoji tag sequence: U+1F3F4 then 1..6
-- tags among U+E0030..U+E0039 / U+E0061..U+E007A then U+E007F (subdivision flags such
-- as England's); longer or other tag runs after U+1F3F4 are removed whole.
-- Because the input is valid UTF-8, each byte pattern below can only match whole
-- characters: a lead byte such as 0xE2 never occurs inside another character.

local ffi = require "ffi"
local json = require "tokengate.json"
local errors = require "tokengate.errors"

local cast = ffi.cast
local u8p = ffi.typeof("const uint8_t *")

local find, gsub, sub, byte = string.find, string.gsub, string.sub, string.byte
local concat, sort = table.concat, table.sort
local type = type
local format, match = string.format, string.match
local tonumber = tonumber
local is_array, is_object, encode = json.is_array, json.is_object, json.encode
local decode, utf8_char, KEYS = json.decode, json.utf8_char, json.KEYS

-- The string fields of a content part that vLLM reads as text: "text" (types text,
-- input_text, output_text), "refusal" (refusal), "thinking" (thinking). Each is visited
-- whatever the part's type says: cleaning a field vLLM ignores costs nothing.
local PART_FIELDS = { "text", "refusal", "thinking" }

local _M = {}

-- dirty(s) -> true when s holds at least one removable character. Most text has none,
-- so this JIT-compiled byte loop is all the work a clean string costs.
local function dirty(s)
    local p = cast(u8p, s)
    local n = #s
    for i = 0, n - 1 do
        local b = p[i]
        if b < 0x20 then
            if b ~= 9 and b ~= 10 and b ~= 13 then
                return true
            end
        elseif b == 0x7F then
            return true
        elseif b == 0xC2 then
            local c = p[i + 1]
            if c <= 0x9F or c == 0xAD then
                return true
            end
        elseif b == 0xE2 and i + 2 < n then
            local c, d = p[i + 1], p[i + 2]
            if (c == 0x80 and (d == 0x8B or d == 0x8E or d == 0x8F
                    or (d >= 0xAA and d <= 0xAE)))
                or (c == 0x81 and ((d >= 0xA0 and d <= 0xA4) or (d >= 0xA6 and d <= 0xA9))) then
                return true
            end
        elseif b == 0xEF and i + 2 < n then
            if p[i + 1] == 0xBB and p[i + 2] == 0xBF then
                return true
            end
        elseif b == 0xD8 then
            if p[i + 1] == 0x9C then
                return true
            end
        elseif b == 0xE1 and i + 2 < n then
            if p[i + 1] == 0xA0 and p[i + 2] == 0x8E then
                return true
            end
        elseif b == 0xF3 and i + 2 < n then
            -- a tag character (also those of a flag: the slow path tells them apart)
            if p[i + 1] == 0xA0 and p[i + 2] <= 0x81 then
                return true
            end
        end
    end
    return false
end

local PATTERNS = {
    "[%z\1-\8\11\12\14-\31\127]",  -- C0 controls except \t \n \r, and DEL
    "\194[\128-\159\173]",          -- C1 controls U+0080..U+009F, soft hyphen U+00AD
    "\226\128[\139\142\143\170-\174]", -- U+200B ZWSP, U+200E/F LRM/RLM, U+202A..U+202E
    "\226\129[\160-\164\166-\169]", -- U+2060 WJ, U+2061..U+2064, U+2066..U+2069 isolates
    "\239\187\191",                 -- U+FEFF BOM / zero-width no-break space
    "\216\156",                      -- U+061C Arabic letter mark
    "\225\160\142",                 -- U+180E Mongolian vowel separator
}

local TAG = "\243\160[\128\129]"     -- lead of a tag character U+E0000..U+E007F (4 bytes)
local BLACK_FLAG = "\240\159\143\180" -- U+1F3F4
local CANCEL_TAG = "\243\160\129\191" -- U+E007F
local TAG_AT = "^" .. TAG

-- flag_tags(s, a, b) -> true when the tag run s[a..b-1] (whole tag characters) continues
-- an emoji tag sequence: right after U+1F3F4, 1..6 tags 0-9 / a-z, then U+E007F.
local function flag_tags(s, a, b)
    local spec = (b - a) / 4 - 1
    if spec < 1 or spec > 6 or a < 5 or sub(s, a - 4, a - 1) ~= BLACK_FLAG
        or sub(s, b - 4, b - 1) ~= CANCEL_TAG then
        return false
    end
    for i = a, b - 8, 4 do
        -- U+E0030..U+E0039 = F3 A0 80 B0..B9; U+E0061..U+E007A = F3 A0 81 A1..BA
        local c, d = byte(s, i + 2), byte(s, i + 3)
        if not ((c == 0x80 and d >= 0xB0 and d <= 0xB9)
                or (c == 0x81 and d >= 0xA1 and d <= 0xBA)) then
            return false
        end
    end
    return true
end

-- strip_tags(s) -> s without tag characters except those of emoji tag sequences, number
-- removed (characters).
local function strip_tags(s)
    local a = find(s, TAG)
    if not a then
        return s, 0
    end
    local out, n, pos, removed = {}, 0, 1, 0
    while a do
        local b = a + 4
        while find(s, TAG_AT, b) do
            b = b + 4
        end
        if not flag_tags(s, a, b) then
            n = n + 1
            out[n] = sub(s, pos, a - 1)
            pos = b
            removed = removed + (b - a) / 4
        end
        a = find(s, TAG, b)
    end
    n = n + 1
    out[n] = sub(s, pos)
    return concat(out, "", 1, n), removed
end

-- clean(s) -> s without the removable characters, number removed (characters).
function _M.clean(s)
    if not dirty(s) then
        return s, 0
    end
    local total = 0
    for i = 1, #PATTERNS do
        local n
        s, n = gsub(s, PATTERNS[i], "")
        total = total + n
    end
    local n
    s, n = strip_tags(s)
    return s, total + n
end
local clean = _M.clean

-- Special and structural tokens ---------------------------------------------------
-- A token list (tokengate.config: model.role_tokens[role], model.all_tokens) is an array
-- of literal strings, longest first, with .anchor = "<" when every one holds a "<".

-- find_special(s, tokens) -> the token string that occurs first in s, or nil (of two
-- tokens starting at the same byte the longer wins).
local function find_special(s, tokens)
    local anchor = tokens.anchor
    if anchor and not find(s, anchor, 1, true) then
        return nil
    end
    local best, best_at = nil, nil
    for i = 1, #tokens do
        local at = find(s, tokens[i], 1, true)
        if at and (not best_at or at < best_at) then
            best, best_at = tokens[i], at
        end
    end
    return best
end

-- strip_special(s, tokens) -> s without any of the token strings, number removed. One
-- linear pass per token: a token that the removals join back together ("<|im_" ..
-- "<think>" .. "end|>") survives it, and the caller refuses the text instead of looping
-- (nested tokens are never an accident, and a loop would be quadratic).
local function strip_special(s, tokens)
    local n = 0
    for i = 1, #tokens do
        local tok = tokens[i]
        if find(s, tok, 1, true) then
            local k
            s, k = gsub(s, gsub(tok, "%p", "%%%0"), "")
            n = n + k
        end
    end
    return s, n
end

-- Escaping (policy "escape"): U+200B ZERO WIDTH SPACE goes inside every occurrence of a
-- token, so the tokenizer's added-token matcher (HF tokenizers, on the raw text: Qwen's
-- added tokens are `normalized: false`) cannot match it and the model reads the text
-- as the ordinary pieces. Measured with Qwen3's tokenizer.json against the literal text
-- tokenized without added tokens: after the token's leading punctuation ("<|", "</",
-- "<"), U+200B joins that pre-token and costs exactly 1 token per occurrence, the other
-- pieces kept (U+2060 costs 2; after "<" alone, "<|..." tokens lose the "<|" piece):
-- tests/edge/test_edge_escape_cost.py.
-- clean() removes U+200B before tokens are searched, so in checked text every U+200B
-- the model sees was inserted here.
local ZWSP = "\226\128\139"

-- SPLIT[token] -> bytes of token before the escape character (false: a token of one
-- character, which no insertion can break). Filled on first use: a few dozen tokens.
local SPLIT = {}

local function split_of(tok)
    local p = SPLIT[tok]
    if p ~= nil then
        return p
    end
    p = 0
    for i = 1, #tok do
        local b = byte(tok, i)
        -- letters, digits, space and non-ASCII end the leading punctuation
        if b >= 0x80 or b <= 0x20 or (b >= 48 and b <= 57) or (b >= 65 and b <= 90)
            or (b >= 97 and b <= 122) then
            break
        end
        p = i
    end
    if p == 0 or p == #tok then
        -- no leading punctuation, or nothing else: after the first (UTF-8) character
        local b = byte(tok, 1)
        p = b < 0x80 and 1 or b < 0xE0 and 2 or b < 0xF0 and 3 or 4
    end
    if p >= #tok then
        p = false
    end
    SPLIT[tok] = p
    return p
end

-- escape_special(s, tokens) -> s with U+200B inside every occurrence of every token,
-- number inserted | nil, token (a one-character token, which cannot be escaped).
-- Every occurrence, overlapping ones included, gets its own insertion point strictly
-- inside it; the output is the input plus U+200B characters, and no token holds U+200B,
-- so any token in the output would lie between two insertion points, that is in the
-- input without an insertion point inside it: none is left and none is formed.
local function escape_special(s, tokens)
    local anchor = tokens.anchor
    if anchor and not find(s, anchor, 1, true) then
        return s, 0
    end
    local cuts, n = nil, 0
    for i = 1, #tokens do
        local tok = tokens[i]
        local at = find(s, tok, 1, true)
        if at then
            local p = split_of(tok)
            if not p then
                return nil, tok
            end
            cuts = cuts or {}
            repeat
                n = n + 1
                cuts[n] = at + p
                at = find(s, tok, at + 1, true)
            until not at
        end
    end
    if n == 0 then
        return s, 0
    end
    sort(cuts)
    local out, k, pos, last = {}, 0, 1, nil
    for i = 1, n do
        local c = cuts[i]
        if c ~= last then
            out[k + 1] = sub(s, pos, c - 1)
            out[k + 2] = ZWSP
            k = k + 2
            pos, last = c, c
        end
    end
    out[k + 1] = sub(s, pos)
    return concat(out, "", 1, k + 1), k / 2
end

-- Walkers ------------------------------------------------------------------------------

-- State of one request's pass: st = {removed = <chars>, stripped = <tokens>,
-- escaped = <U+200B inserted>, policy,
-- by_role = {role = token list}, all = token list (tools, documents, template kwargs),
-- structural = {token = true}, depth = edge.max_json_depth,
-- bad = nil | {param, token, why = nil | "key" | "formed" | "escaped" | "single",
-- at = <path>}}.

-- flag(st, param, token, why, at): records the first refusal of the request.
local function flag(st, param, token, why, at)
    if not st.bad then
        st.bad = { param = param, token = token, why = why, at = at }
    end
end

-- check_text(st, s, param, tokens) -> s under the policy: unchanged (allow, or no token),
-- flagged (reject), with each token escaped (escape) or without the tokens (strip).
-- Nothing else is removed: schema strings (property values, enums, patterns) and ids
-- must stay byte-exact, yet the template renders them; escape and strip rewrite them
-- the same way wherever they occur, so a tool call's id still matches its result's.
local function check_text(st, s, param, tokens, at)
    if not tokens or st.policy == "allow" then
        return s
    end
    if st.policy == "escape" then
        local out, k = escape_special(s, tokens)
        if not out then
            flag(st, param, k, "single", at)
            return s
        end
        st.escaped = st.escaped + k
        return out
    end
    local tok = find_special(s, tokens)
    if not tok then
        return s
    end
    if st.policy == "reject" then
        flag(st, param, tok, nil, at)
        return s
    end
    local out, k = strip_special(s, tokens)
    st.stripped = st.stripped + k
    local left = find_special(out, tokens)
    if left then
        flag(st, param, left, "formed", at)
    end
    return out
end

-- check_key(st, k, param, tokens): an object key is checked but never rewritten (strip
-- and escape cannot rename a property or an argument: a client's code matches it byte
-- for byte), so a token there is refused under strip and escape too.
local function check_key(st, k, param, tokens, at)
    if tokens and st.policy ~= "allow" then
        local tok = find_special(k, tokens)
        if tok then
            flag(st, param, tok, "key", at)
        end
    end
end

-- visit_text(st, s, param, tokens) -> s cleaned of invisible characters, then under the
-- token policy when tokens is a token list (nil: the role is not checked).
local function visit_text(st, s, param, tokens, at)
    local out, n = clean(s)
    st.removed = st.removed + n
    return check_text(st, out, param, tokens, at)
end

-- content: string | array of parts ({"type": "text", "text": "..."}, refusal, thinking,
-- or a bare string, which vLLM reads as a text part: renderers/chat_utils.py
-- _parse_chat_message_content_part) | other (kept). Part params:
-- "messages[i].content[j].<field>".
local function visit_content(st, content, param, tokens)
    if type(content) == "string" then
        return visit_text(st, content, param, tokens)
    end
    if is_array(content) then
        for j = 1, #content do
            local part = content[j]
            if type(part) == "string" then
                content[j] = visit_text(st, part, format("%s[%d]", param, j - 1), tokens)
            elseif is_object(part) then
                for f = 1, #PART_FIELDS do
                    local k = PART_FIELDS[f]
                    local v = part[k]
                    if type(v) == "string" then
                        part[k] = visit_text(st, v, format("%s[%d].%s", param, j - 1, k),
                            tokens)
                    end
                end
            end
        end
    end
    return content
end

-- child(param, at, suffix) -> the param and inside-path of a member: a member of the
-- body is named by its own path; one inside a decoded JSON string by the string's field,
-- with the path inside it apart.
local function child(param, at, suffix)
    if at then
        return param, at .. suffix
    end
    return param .. suffix, nil
end

local visit_value -- (below; visit_member and it call each other)

-- visit_member(st, node, k, clean, param, tokens, cleaned, at): node[k], a member of an
-- object or array that visit_value walks: a string is cleaned (clean true) or checked,
-- a table walked.
local function visit_member(st, node, k, clean, param, tokens, cleaned, at)
    local v = node[k]
    if type(v) == "string" then
        local visit = clean and visit_text or check_text
        node[k] = visit(st, v, param, tokens, at)
    elseif type(v) == "table" then
        visit_value(st, v, param, tokens, cleaned, at)
    end
end

-- visit_value(st, node, param, tokens, cleaned, at): every key and string of a JSON value,
-- to any depth: the decoder already bounds nesting at edge.max_json_depth, so whatever
-- it accepted is scanned whole (a depth limit of the walker's own was a place to hide
-- text). Strings under the keys in `cleaned` (every string when cleaned == true) are also
-- cleaned of invisible characters. at: nil, or the path inside a decoded JSON string
-- ("" at its top).
visit_value = function(st, node, param, tokens, cleaned, at)
    if is_object(node) then
        local keys = node[KEYS]
        for i = 1, #keys do
            local k = keys[i]
            local cparam, cat = child(param, at, "." .. k)
            check_key(st, k, cparam, tokens, cat)
            visit_member(st, node, k, cleaned == true or (cleaned and cleaned[k]), cparam,
                tokens, cleaned, cat)
        end
    elseif is_array(node) then
        for i = 1, #node do
            local cparam, cat = child(param, at, format("[%d]", i - 1))
            visit_member(st, node, i, cleaned == true, cparam, tokens, cleaned, cat)
        end
    end
end

-- Strings of a tool schema that are prose for the model: cleaned as well as checked.
local SCHEMA_PROSE = { description = true, title = true }

local ESCAPED = { ['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n",
                  r = "\r", t = "\t" }
local REPLACEMENT = "\239\191\189" -- U+FFFD, for a lone surrogate (no token holds one)

-- unescape(s) -> s with every JSON string escape resolved, left to right (so "\\u003c"
-- stays the six characters \u003c). Each string that any JSON reader decodes from s is
-- then a substring of the result: a superset to search when s is not strict JSON.
local function unescape(s)
    if not find(s, "\\", 1, true) then
        return s
    end
    local out, n, pos = {}, 0, 1
    while true do
        local a = find(s, "\\", pos, true)
        if not a then
            break
        end
        n = n + 1
        out[n] = sub(s, pos, a - 1)
        local c = sub(s, a + 1, a + 1)
        local hex = c == "u" and match(s, "^%x%x%x%x", a + 2)
        if hex then
            local cp = tonumber(hex, 16)
            pos = a + 6
            if cp >= 0xD800 and cp <= 0xDBFF then
                local lo = match(s, "^\\u([dD][c-fC-F]%x%x)", pos)
                if lo then
                    cp = 0x10000 + (cp - 0xD800) * 0x400 + (tonumber(lo, 16) - 0xDC00)
                    pos = pos + 6
                else
                    cp = nil
                end
            elseif cp >= 0xDC00 and cp <= 0xDFFF then
                cp = nil
            end
            n = n + 1
            out[n] = cp and utf8_char(cp) or REPLACEMENT
        else
            n = n + 1
            out[n] = ESCAPED[c] or c
            pos = a + 2
        end
    end
    n = n + 1
    out[n] = sub(s, pos)
    return concat(out, "", 1, n)
end

-- visit_arguments(st, fn, param, tokens): a tool call's arguments as the template gets
-- them. vLLM json.loads an arguments string and the template re-serializes the object
-- (renderers/chat_utils.py _postprocess_messages; Qwen3: `arguments | tojson`), so
-- "\u003c|im_end|\u003e" inside the string reaches the prompt as <|im_end|>: the decoded
-- keys and strings are what is checked. Text that is not a JSON object vLLM renders as {}
-- (counting.py _postprocess_tool_calls); text the strict decoder refuses but json.loads
-- may read (duplicate keys, NaN, lone surrogates, deeper nesting) is searched with its
-- escapes resolved, and refused under either policy when a token shows (it cannot be
-- stripped without a reader that agrees with json.loads). An object (vLLM also takes
-- one) is walked directly.
local function visit_arguments(st, fn, param, tokens)
    local args = fn.arguments
    if is_object(args) then
        visit_value(st, args, param, tokens, true)
        return
    end
    if type(args) ~= "string" then
        return
    end
    if st.policy == "escape" then
        -- decoded first: an escape in the raw text would land in keys too, and a later
        -- clean() of the decoded strings would remove it again
        local n
        args, n = clean(args)
        st.removed = st.removed + n
        local v = decode(args, st.depth)
        if is_object(v) then
            local removed, escaped = st.removed, st.escaped
            visit_value(st, v, param, tokens, true, "")
            fn.arguments = (st.removed ~= removed or st.escaped ~= escaped) and encode(v)
                or args
            return
        end
        args = check_text(st, args, param, tokens)
        fn.arguments = args
        if v == nil and tokens then
            local tok = find_special(unescape(args), tokens)
            if tok then
                flag(st, param, tok, "escaped")
            end
        end
        return
    end
    args = visit_text(st, args, param, tokens)
    fn.arguments = args
    local v = decode(args, st.depth)
    if v == nil then
        if tokens and st.policy ~= "allow" then
            local tok = find_special(unescape(args), tokens)
            if tok then
                flag(st, param, tok, "escaped")
            end
        end
    elseif is_object(v) then
        local removed, stripped = st.removed, st.stripped
        visit_value(st, v, param, tokens, true, "")
        if st.removed ~= removed or st.stripped ~= stripped then
            fn.arguments = encode(v)
        end
    end
end

-- new_state(model, edge) -> per-request state (see "State of one request's pass")
local function new_state(model, edge)
    return { removed = 0, stripped = 0, escaped = 0, collapsed = 0,
             policy = edge.special_tokens,
             by_role = model.role_tokens, all = model.all_tokens,
             structural = model.structural_set, depth = edge.max_json_depth }
end

-- WHY[bad.why]: how the token got past the policy, for the message.
local WHY = {
    key = " in an object key, which is never rewritten",
    formed = " once the other tokens were stripped around it",
    escaped = ", once its JSON escapes are resolved (it is not strict JSON, so it cannot "
        .. "be %s)",
    single = ", a token of one character, which cannot be escaped",
}
local REWRITTEN = { strip = "stripped", escape = "escaped" }

-- refusal(st) -> err (400 special_token_in_content) for st.bad
local function refusal(st)
    local bad = st.bad
    local what
    if st.structural[bad.token] then
        what = format("the token %q, which the model's chat template uses for its own "
            .. "structure (a forged tool call, tool response or reasoning block)", bad.token)
    else
        what = format("the special token %q, which the model would read as a control token "
            .. "(a forged turn)", bad.token)
    end
    local where = ""
    if bad.at then
        where = format(" (in its decoded JSON, at %s)", bad.at == "" and "the top" or bad.at)
    end
    local why = format(WHY[bad.why] or "", REWRITTEN[st.policy] or "stripped")
    return errors.refuse(400, format("%s contains %s%s%s. Remove it from the text.",
        bad.param, what, where, why), bad.param, "special_token_in_content")
end

-- The visitors, with which every API module sanitizes its own body shape
-- (tokengate.apis.*: sanitize), under one policy (edge.special_tokens) and with the
-- same counts:
--   state(model, edge) -> st; text(st, s, param, tokens) -> s cleaned and checked;
--   check(st, s, param, tokens) -> s checked only (identifiers); content(st, content,
--   param, tokens) -> a chat content (string or parts); value(st, node, param, tokens,
--   cleaned) walks any JSON value (cleaned: true, false or a set of keys such as
--   SCHEMA_PROSE); verdict(st) -> st | nil, err (400 special_token_in_content).
_M.state, _M.text, _M.check, _M.content = new_state, visit_text, check_text, visit_content
_M.value, _M.SCHEMA_PROSE = visit_value, SCHEMA_PROSE
-- arguments(st, call, param, tokens): a tool call's arguments (call.arguments, a JSON
-- string or an object) as the template gets them (visit_arguments)
_M.arguments = visit_arguments
function _M.verdict(st)
    if st.bad then
        return refusal(st)
    end
    return st
end

-- objects(st, list, param, visit): visit(st, obj, "<param>[i]") for each object of the
-- array list (nothing when list is no array): a body's tools, a message's tool calls.
function _M.objects(st, list, param, visit)
    if not is_array(list) then
        return
    end
    for i = 1, #list do
        local v = list[i]
        if is_object(v) then
            visit(st, v, format("%s[%d]", param, i - 1))
        end
    end
end

-- strings(st, t, param, tokens, visit, keys): t[k] for each k of the list keys that holds
-- a string, through visit (text: cleaned and checked; check: checked only, for
-- identifiers) as "<param>.<k>", in the order of keys: the named string fields of an
-- API's objects (a tool call's id, a block's name).
local function visit_strings(st, t, param, tokens, visit, keys)
    for i = 1, #keys do
        local k = keys[i]
        if type(t[k]) == "string" then
            t[k] = visit(st, t[k], param .. "." .. k, tokens)
        end
    end
end
_M.strings = visit_strings

local TOOL_PROSE = { "name", "description" }

-- tool(st, t, param, schema): a tool's name and description (cleaned) and its schema
-- t[schema] (its prose cleaned: SCHEMA_PROSE), against every special and structural
-- token: tools are client-supplied text that the template renders into the system turn
-- (Qwen3: each tool as JSON inside <tools>...</tools>), and often third-party text.
function _M.tool(st, t, param, schema)
    local tokens = st.all
    visit_strings(st, t, param, tokens, visit_text, TOOL_PROSE)
    if type(t[schema]) == "table" then
        visit_value(st, t[schema], param .. "." .. schema, tokens, SCHEMA_PROSE)
    end
end

-- finish(st, body) -> counts | nil, err: the last of every API's pass: the values of
-- body.chat_template_kwargs against every special and structural token (the template
-- renders them into the system turn), then verdict(st).
function _M.finish(st, body)
    if is_object(body.chat_template_kwargs) then
        visit_value(st, body.chat_template_kwargs, "chat_template_kwargs", st.all, false)
    end
    return _M.verdict(st)
end

return _M
