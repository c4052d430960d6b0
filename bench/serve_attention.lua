-- wrk script: POST /api/attention of `qkv serve` with a 6-token sentence, the page's default
-- layer (8 heads, embed 64). A benchmark, not a test; loopback only:
--
--   qkv serve --port 8080 &
--   wrk -t2 -c50 -d20s --latency -s bench/serve_attention.lua http://127.0.0.1:8080/api/attention
--
-- Prints the non-200 answers' count at the end; every answer should be 200 (at most
-- --max-concurrent computations run at once, the rest wait up to 10 s for a slot).
wrk.method = "POST"
wrk.path = "/api/attention"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"text": "The cat sat on the mat", "heads": 8, "embed": 64, "mask": "causal"}'

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  not_ok = 0
end

function response(status, headers, body)
  if status ~= 200 then not_ok = not_ok + 1 end
end

function done(summary, latency, requests)
  local total = 0
  for _, thread in ipairs(threads) do total = total + thread:get("not_ok") end
  io.write(string.format("non-200 answers: %d\n", total))
end
