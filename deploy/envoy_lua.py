"""Envoy's two Lua filters, one on each side of the picker's: what no client reads of an
engine's answer, and, when the picker routed nothing, what no client sends an engine.
Pure: :func:`answers_lua` and :func:`requests_lua` return the two scripts' sources.

On the response path, the rules of :mod:`kvpilot.routing.serve.withheld`, as the relay
applies them:

- a whole JSON answer (``content-type: application/json``) is buffered; its top-level
  ``kv_transfer_params`` value becomes ``null`` and its top-level ``kvpilot_*`` members go,
  ``content-length`` set to match. An answer that names either but is not a JSON object is
  withheld: Envoy answers 502 instead. A non-streamed answer larger than the listener's
  buffer limit cannot be buffered and Envoy answers it with a 500: ask for such answers
  streamed;
- a stream (``text/event-stream``) is never buffered: each chunk is passed on as it came
  when it ends a line and names neither key (two plain substring searches); otherwise its
  complete lines go on, each ``data:`` line's JSON without those members (or, if that JSON
  names one but cannot be read, the relay's withheld error event instead), and its last
  partial line waits for the next chunk, so that a key split between two chunks is still
  found. What waits is at most one line; a stream that ends inside a line loses that line,
  as an SSE client drops an event that no blank line ended.

On the request path, only for a request without the picker's destination header (the picker
failed and ``round_robin`` sends it on unrouted; a client's own destination header is dropped
on arrival): the checks of :mod:`kvpilot.routing.serve.request_fields` on the body's
top-level fields, generated from :data:`~kvpilot.routing.serve.request_fields.ACCEPTED` and
answered with the picker's own messages (a 400 naming the first refused field, such as
``kv_transfer_params``), a 404 for anything but ``POST`` to the two APIs and ``GET``
``/health`` or ``/v1/models``. The body an engine gets is the client's, unchanged: a check, not
a rewrite. A request the picker routed carries the router's body (P's handoff for D) and is
left alone.

The parser walks one JSON object's top-level members and skips each value by a balanced scan
that respects strings and their escapes (never a pattern over nested braces); anything that
is not one JSON object with nothing after it is refused (request) or withheld (answer).
Key names are compared as written: a key with a JSON escape is refused on the request path
(no accepted field has one) and vLLM writes none in its answers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from kvpilot.routing.gateway.contract import DESTINATION_HEADER
from kvpilot.routing.serve.driver import error_reply
from kvpilot.routing.serve.request_fields import ACCEPTED, ENGINE_INTERNAL, refused_field
from kvpilot.routing.serve.upstream import Api
from kvpilot.routing.serve.withheld import KVPILOT_PREFIX, TRANSFER_PARAMS_KEY, WITHHELD_ANSWER, WITHHELD_CHUNK

OPEN_GETS = ("/health", "/v1/models")
"""What a client may ``GET`` from an engine when the picker routed nothing."""

_PARSER = r"""
-- kvpilot (deploy/envoy_lua.py says why): one JSON object's top-level members

-- the index of the quote that closes the JSON string opening at i (nil: none); a plain
-- find (an answer's bytes are mostly its text), then the backslashes before the quote:
-- an odd count escapes it
local function string_end(s, i)
  local j = i + 1
  while true do
    local k = string.find(s, '"', j, true)
    if k == nil then return nil end
    local b = k - 1
    while string.byte(s, b) == 92 do b = b - 1 end
    if (k - 1 - b) % 2 == 0 then return k end
    j = k + 1
  end
end

-- the index of the last byte of the JSON value starting at i (nil: malformed)
local function value_end(s, i)
  local c = string.sub(s, i, i)
  if c == '"' then return string_end(s, i) end
  if c ~= "{" and c ~= "[" then -- a number, true, false or null: up to what follows it
    local k = string.find(s, "[,}%s]", i)
    return k and k - 1
  end
  local depth, j = 0, i
  while true do
    local k = string.find(s, '[{}%[%]"]', j)
    if k == nil then return nil end
    local b = string.sub(s, k, k)
    if b == '"' then
      k = string_end(s, k)
      if k == nil then return nil end
    elseif b == "{" or b == "[" then
      depth = depth + 1
    else
      depth = depth - 1
      if depth == 0 then return k end
    end
    j = k + 1
  end
end

-- the top-level members of the JSON object that is all of s, in order, each
-- {key, first, value, last} (first: its key's quote; value, last: its value's first and last
-- byte); nil when s is not one JSON object with nothing but whitespace around it
local function members(s)
  local j = string.find(s, "%S")
  if j == nil or string.sub(s, j, j) ~= "{" then return nil end
  local found = {}
  j = string.find(s, "%S", j + 1)
  if j ~= nil and string.sub(s, j, j) == "}" then
    if string.find(s, "%S", j + 1) then return nil end
    return found
  end
  while j ~= nil and string.sub(s, j, j) == '"' do
    local key_end = string_end(s, j)
    if key_end == nil then return nil end
    local colon = string.find(s, "%S", key_end + 1)
    if colon == nil or string.sub(s, colon, colon) ~= ":" then return nil end
    local v = string.find(s, "%S", colon + 1)
    local v_end = v and value_end(s, v)
    if v_end == nil then return nil end
    found[#found + 1] = {string.sub(s, j + 1, key_end - 1), j, v, v_end}
    j = string.find(s, "%S", v_end + 1)
    if j == nil then return nil end
    local c = string.sub(s, j, j)
    if c == "}" then
      if string.find(s, "%S", j + 1) then return nil end
      return found
    end
    if c ~= "," then return nil end
    j = string.find(s, "%S", j + 1)
  end
  return nil
end

"""
_REQUESTS = r"""
local DESTINATION = @DESTINATION@
local ACCEPTED = @ACCEPTED@
local REFUSED = @REFUSED@
local OPEN_GETS = @OPEN_GETS@
local NOT_SERVED = @NOT_SERVED@
local NOT_AN_OBJECT = @NOT_AN_OBJECT@

local function refuse(handle, status, body)
  handle:respond({[":status"] = tostring(status), ["content-type"] = "application/json"}, body)
end

function envoy_on_request(handle)
  local headers = handle:headers()
  if headers:get(DESTINATION) ~= nil then return end -- the picker routed it: the router's body
  local path = string.match(headers:get(":path") or "", "^[^?]*")
  local method = headers:get(":method")
  local accepted = ACCEPTED[path]
  if method == "GET" and OPEN_GETS[path] then return end
  if method ~= "POST" or accepted == nil then return refuse(handle, 404, NOT_SERVED) end
  local body = handle:body()
  local found = members(body and body:getBytes(0, body:length()) or "")
  if found == nil then return refuse(handle, 400, NOT_AN_OBJECT) end
  for _, m in ipairs(found) do
    local key = m[1]
    if not accepted[key] then
      local reason = REFUSED[path][key]
      if reason == nil then -- named only when its name cannot break the JSON it is quoted in
        local shown = string.match(key, "^[%w_%-%.]+$") and ("'" .. key .. "'")
          or "a key with characters no field's name has"
        reason = '{"error": {"message": "' .. shown .. ' is not a field the router accepts '
          .. '(docs/reference/request-fields.md lists them)", "type": "invalid_request_error", "code": 400}}'
      end
      return refuse(handle, 400, reason)
    end
  end
end

"""
_ANSWERS = r"""
local KEY = @KEY@
local PREFIX = @PREFIX@
local WITHHELD_ANSWER = @WITHHELD_ANSWER@
local WITHHELD_CHUNK = @WITHHELD_CHUNK@

local function names_withheld(s)
  return string.find(s, KEY, 1, true) ~= nil or string.find(s, PREFIX, 1, true) ~= nil
end

-- the JSON object s rebuilt without its kvpilot_* members and with KEY's value as
-- `transfer` says ("null": replaced; nil: dropped); s itself when nothing changes; nil when s
-- is not a JSON object
local function scrubbed(s, transfer)
  local found = members(s)
  if found == nil then return nil end
  local kept, changed = {}, false
  for _, m in ipairs(found) do
    local key = m[1]
    if key == KEY then
      changed = true
      if transfer ~= nil then kept[#kept + 1] = string.sub(s, m[2], m[3] - 1) .. transfer end
    elseif string.sub(key, 1, #PREFIX) == PREFIX then
      changed = true
    else
      kept[#kept + 1] = string.sub(s, m[2], m[4])
    end
  end
  if not changed then return s end
  return "{" .. table.concat(kept, ",") .. "}"
end

-- complete lines of a stream, each data line's JSON scrubbed of KEY and kvpilot_* members
local function scrubbed_lines(s)
  if not names_withheld(s) then return s end
  local out, from = {}, 1
  while from <= #s do
    local nl = string.find(s, "\n", from, true) or #s + 1
    local line = string.sub(s, from, nl - 1)
    if string.sub(line, 1, 5) == "data:" and names_withheld(line) then
      local cr = ""
      if string.sub(line, -1) == "\r" then
        cr, line = "\r", string.sub(line, 1, -2)
      end
      local head = string.sub(line, 6, 6) == " " and 6 or 5
      local data = string.sub(line, head + 1)
      line = string.sub(line, 1, head) .. (scrubbed(data, nil) or WITHHELD_CHUNK) .. cr
    end
    out[#out + 1] = line
    if nl <= #s then out[#out + 1] = "\n" end
    from = nl + 1
  end
  return table.concat(out)
end

function envoy_on_response(handle)
  local kind = handle:headers():get("content-type")
  kind = kind and string.lower(kind) or ""
  if string.find(kind, "text/event-stream", 1, true) == 1 then
    local carry = ""
    for chunk in handle:bodyChunks() do
      local s = chunk:getBytes(0, chunk:length())
      if carry ~= "" or string.sub(s, -1) ~= "\n" or names_withheld(s) then
        local out = carry .. s
        local last = string.find(out, "\n[^\n]*$") -- the last line end (nil: none)
        if last == nil then
          carry, out = out, ""
        else
          carry, out = string.sub(out, last + 1), scrubbed_lines(string.sub(out, 1, last))
        end
        if out ~= s then chunk:setBytes(out) end
      end
    end
    return
  end
  if string.find(kind, "application/json", 1, true) ~= 1 then return end -- never buffered
  local body = handle:body()
  if body == nil then return end
  local s = body:getBytes(0, body:length())
  if not names_withheld(s) then return end
  local out = scrubbed(s, "null")
  if out == nil then -- it names a withheld key but cannot be read: withheld, not passed on
    out = WITHHELD_ANSWER
    handle:headers():replace(":status", "502") -- headers() again: body() ended the first's scope
  end
  if out ~= s then
    body:setBytes(out) -- sets content-length to match
  end
end
"""


def _lua_string(value: str) -> str:
    """``value`` as a Lua string literal (JSON's escapes for ASCII are Lua's too)."""
    if not value.isascii():
        raise ValueError(f"not ASCII: {value!r}")
    return json.dumps(value)


def _lua_set(names: Iterable[str]) -> str:
    return "{" + ", ".join(f"[{_lua_string(name)}] = true" for name in sorted(names)) + "}"


def _lua_table(entries: Mapping[str, str]) -> str:
    return "{" + ", ".join(f"[{_lua_string(k)}] = {v}" for k, v in sorted(entries.items())) + "}"


def _error(status: int, message: str, kind: str = "invalid_request_error") -> str:
    return _lua_string(json.dumps(error_reply(status, message, kind).payload))


def _refusals(api: Api) -> str:
    """The picker's 400 for each field it names by kind when ``api`` is called (the router's
    own fields, another API's): every other refused field gets the generic message."""
    names = ENGINE_INTERNAL | ({name for other in Api for name in ACCEPTED[other]} - ACCEPTED[api])
    return _lua_table({name: _error(400, refused_field({name: None}, api) or "") for name in names})


def requests_lua() -> str:
    """The request path's script (see the module doc): it must run after the picker's
    filter, which sets the destination header."""
    return _filled(_PARSER + _REQUESTS)


def answers_lua() -> str:
    """The response path's script (see the module doc): it must run nearer the client than
    any filter that holds a response's headers (GAIE's response phase). ``setBytes`` on a
    streamed chunk also writes ``content-length`` into the response's headers: harmless
    once they went to the client, a cut stream if another filter still holds them."""
    return _filled(_PARSER + _ANSWERS)


def _filled(script: str) -> str:
    served = " and ".join(api.value for api in Api)
    values = {
        "KEY": _lua_string(TRANSFER_PARAMS_KEY),
        "PREFIX": _lua_string(KVPILOT_PREFIX),
        "DESTINATION": _lua_string(DESTINATION_HEADER),
        "ACCEPTED": _lua_table({api.value: _lua_set(ACCEPTED[api]) for api in Api}),
        "REFUSED": _lua_table({api.value: _refusals(api) for api in Api}),
        "OPEN_GETS": _lua_set(OPEN_GETS),
        "NOT_SERVED": _error(404, f"kvpilot serves POST {served} (its picker is down: unrouted)"),
        "NOT_AN_OBJECT": _error(400, "request body must be a JSON object"),
        "WITHHELD_ANSWER": _lua_string(WITHHELD_ANSWER),
        "WITHHELD_CHUNK": _lua_string(WITHHELD_CHUNK),
    }
    for name, value in values.items():
        script = script.replace(f"@{name}@", value)
    return script
