-- Sanitizing the strings a model reads, after strict JSON decoding (so escapes such as
-- \u200b are already characters and every string is valid UTF-8).
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

local find = string.find
local gsub = string.gsub
local sub = string.sub
local byte = string.byte
local concat = table.concat
local type = type
local format = string.format
local is_array = json.is_array
local is_object = json.is_object
local encode = json.encode
local KEYS = json.KEYS

local REASONING_FIELDS = { "reasoning_content", "reasoning" }
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

-- Special tokens -------------------------------------------------------------------

-- find_special(s, tokens) -> the special-token string that occurs first in s, or nil.
-- tokens: array of literal strings (longest first, so of two tokens starting at the
-- same byte the longer wins).
local function find_special(s, tokens)
    if not find(s, "<", 1, true) then
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

-- strip_special(s, tokens) -> s without any of the token strings, number removed
local function strip_special(s, tokens)
    local n = 0
    for i = 1, #tokens do
        local tok = tokens[i]
        while true do
            local a, b = find(s, tok, 1, true)
            if not a then
                break
            end
            s = s:sub(1, a - 1) .. s:sub(b + 1)
            n = n + 1
        end
    end
    return s, n
end

-- Walkers ------------------------------------------------------------------------------

-- State of one request's pass: st = {removed = <chars>, specials = policy,
-- tokens = {...}, roles = {role = true}, bad = nil | {param, token}}.

-- visit_text(st, s, param, check) -> cleaned s; with check, applies the special-token
-- policy (records st.bad = {param, token} on reject, strips on strip)
local function visit_text(st, s, param, check)
    local out, n = clean(s)
    st.removed = st.removed + n
    if check and st.policy ~= "allow" then
        local tok = find_special(out, st.tokens)
        if tok then
            if st.policy == "reject" then
                if not st.bad then
                    st.bad = { param = param, token = tok }
                end
            else
                local k
                out, k = strip_special(out, st.tokens)
                st.stripped = st.stripped + k
            end
        end
    end
    return out
end

-- content: string | array of parts ({"type": "text", "text": "..."}, refusal, thinking)
-- | other (kept). Part params: "messages[i].content[j].<field>".
local function visit_content(st, content, param, check)
    if type(content) == "string" then
        return visit_text(st, content, param, check)
    end
    if is_array(content) then
        for j = 1, #content do
            local part = content[j]
            if is_object(part) then
                for f = 1, #PART_FIELDS do
                    local k = PART_FIELDS[f]
                    local v = part[k]
                    if type(v) == "string" then
                        part[k] = visit_text(st, v, format("%s[%d].%s", param, j - 1, k), check)
                    end
                end
            end
        end
    end
    return content
end

-- check_only(st, s, param) -> s, with the special-token policy applied but nothing else
-- removed: schema strings other than descriptions (property names' values, enums,
-- patterns) must stay byte-exact, yet the template renders them into the system turn.
local function check_only(st, s, param)
    if st.policy == "allow" or not find_special(s, st.tokens) then
        return s
    end
    if st.policy == "reject" then
        if not st.bad then
            st.bad = { param = param, token = find_special(s, st.tokens) }
        end
        return s
    end
    local out, k = strip_special(s, st.tokens)
    st.stripped = st.stripped + k
    return out
end

-- The tools array is rendered into the system turn (Qwen3: each tool as JSON inside
-- <tools>...</tools>), so all of it is checked like message content; descriptions and
-- titles are also cleaned of invisible characters. Keys are checked, never rewritten
-- (strip cannot rename a property). param: the node's path, e.g.
-- "tools[0].function.parameters.properties.city".
local function visit_schema(st, node, depth, param)
    if depth > 32 then
        return
    end
    if is_object(node) then
        local keys = node[KEYS]
        for i = 1, #keys do
            local k = keys[i]
            local v = node[k]
            if st.policy == "reject" and not st.bad and find_special(k, st.tokens) then
                st.bad = { param = param .. "." .. k, token = find_special(k, st.tokens) }
            end
            if type(v) == "string" then
                if k == "description" or k == "title" then
                    node[k] = visit_text(st, v, param .. "." .. k, true)
                else
                    node[k] = check_only(st, v, param .. "." .. k)
                end
            elseif type(v) == "table" then
                visit_schema(st, v, depth + 1, param .. "." .. k)
            end
        end
    elseif is_array(node) then
        for i = 1, #node do
            local v = node[i]
            if type(v) == "string" then
                node[i] = check_only(st, v, format("%s[%d]", param, i - 1))
            elseif type(v) == "table" then
                visit_schema(st, v, depth + 1, format("%s[%d]", param, i - 1))
            end
        end
    end
end

-- visit_tools(st, tools): cleans and checks each tool's function name, description and
-- schema ("tools[i].function.name" ...), whatever special_token_roles says: tools are
-- client-supplied text in the system turn.
local function visit_tools(st, tools)
    if not is_array(tools) then
        return
    end
    for i = 1, #tools do
        local fn = is_object(tools[i]) and tools[i]["function"]
        if is_object(fn) then
            local param = format("tools[%d].function", i - 1)
            if type(fn.name) == "string" then
                fn.name = visit_text(st, fn.name, param .. ".name", true)
            end
            if type(fn.description) == "string" then
                fn.description = visit_text(st, fn.description, param .. ".description", true)
            end
            if type(fn.parameters) == "table" then
                visit_schema(st, fn.parameters, 0, param .. ".parameters")
            end
        end
    end
end

-- new_state(model, policy) -> per-request state (see "State of one request's pass")
local function new_state(model, policy)
    return { removed = 0, stripped = 0, collapsed = 0, policy = policy,
             tokens = model.special_tokens or {}, roles = model.special_token_roles or {} }
end

-- chat(body, model, policy) -> state {removed, stripped, collapsed, bad}
-- Sanitizes a validated chat body in place: message content (string or text / refusal /
-- thinking parts), assistant reasoning, tool-call names and arguments, tools; checks
-- special tokens in those of model.special_token_roles messages and everywhere in tools
-- (policy "reject" | "strip" | "allow"); then removes each system message that exactly
-- repeats an earlier one (same JSON after sanitizing).
-- state.bad = {param = "messages[i].content", token = "<|im_end|>"} when rejected
-- (indices are the client's, before collapsing).
function _M.chat(body, model, policy)
    local st = new_state(model, policy)
    local messages = body.messages
    for i = 1, #messages do
        local m = messages[i]
        local check = st.roles[m.role] == true
        local param = format("messages[%d].content", i - 1)
        if m.content ~= nil then
            m.content = visit_content(st, m.content, param, check)
        end
        for r = 1, #REASONING_FIELDS do
            local f = REASONING_FIELDS[r]
            if type(m[f]) == "string" then
                m[f] = visit_text(st, m[f], format("messages[%d].%s", i - 1, f), check)
            end
        end
        local calls = m.tool_calls
        if is_array(calls) then
            for j = 1, #calls do
                local fn = is_object(calls[j]) and calls[j]["function"]
                if is_object(fn) then
                    -- the template writes the name into the assistant turn verbatim
                    if type(fn.name) == "string" then
                        fn.name = visit_text(st, fn.name,
                            format("messages[%d].tool_calls[%d].function.name", i - 1, j - 1),
                            check)
                    end
                    if type(fn.arguments) == "string" then
                        fn.arguments = visit_text(st, fn.arguments,
                            format("messages[%d].tool_calls[%d].function.arguments", i - 1,
                                j - 1), check)
                    end
                end
            end
        end
    end
    visit_tools(st, body.tools)

    -- A client that rebuilds its history often prepends the same system prompt again;
    -- exact repeats carry no information and cost tokens on every turn.
    local seen, kept, n = nil, nil, 0
    for i = 1, #messages do
        local m = messages[i]
        local drop = false
        if m.role == "system" then
            local sig = encode(m)
            seen = seen or {}
            if seen[sig] then
                drop = true
            else
                seen[sig] = true
            end
        end
        if drop then
            if not kept then
                kept = json.array()
                for j = 1, i - 1 do
                    kept[j] = messages[j]
                end
                n = i - 1
            end
            st.collapsed = st.collapsed + 1
        elseif kept then
            n = n + 1
            kept[n] = m
        end
    end
    if kept then
        body.messages = kept
    end
    return st
end

-- completions(body, model, policy) -> state. Sanitizes the prompt (string or array of
-- strings; token-id prompts are numbers and pass unchanged). Completions prompts are raw
-- text by definition (no turns to forge), so special tokens are not checked there.
function _M.completions(body, model, policy)
    local st = new_state(model, policy)
    local p = body.prompt
    if type(p) == "string" then
        body.prompt = visit_text(st, p, "prompt", false)
    elseif is_array(p) then
        for i = 1, #p do
            if type(p[i]) == "string" then
                p[i] = visit_text(st, p[i], format("prompt[%d]", i - 1), false)
            end
        end
    end
    return st
end

-- request(route, body, model, policy) -> counts | nil, err
--   Sanitizes body in place (chat() / completions()). counts = {removed (invisible or
--   control characters), stripped (special tokens, policy "strip"), collapsed (repeated
--   system messages dropped)}, reported in the usage event. err: 400
--   special_token_in_content naming the field, when policy "reject" found one.
function _M.request(route, body, model, policy)
    local st
    if route == "chat" then
        st = _M.chat(body, model, policy)
    else
        st = _M.completions(body, model, policy)
    end
    local bad = st.bad
    if bad then
        return errors.refuse(400, format("%s contains the special token %q, which the model "
            .. "would read as a control token (a forged turn). Remove it from the text.",
            bad.param, bad.token), bad.param, "special_token_in_content")
    end
    return st
end

_M.find_special = find_special

return _M
