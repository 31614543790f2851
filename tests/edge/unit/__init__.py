"""Unit tests of the edge's Lua modules that are pure functions (codecs, sanitizer, bounds,
limit and budget arithmetic), run by one nginx process and no other part of the stack."""
