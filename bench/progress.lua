-- wrk script: every request is a heartbeat of a random user (token) on a random route, content and
-- position. Counts the answers by status in each thread; done() prints one BENCH_RESULT JSON line.
--
--   wrk -t2 -c64 -d20s --latency -s bench/progress.lua http://127.0.0.1:8000 -- TOKENS_FILE [MAX_CONTENT_ID [MIN_CONTENT_ID]]
--
-- TOKENS_FILE holds one JWT per line.

local threads = {}
local next_id = 0

function setup(thread)
  next_id = next_id + 1
  thread:set("id", next_id)
  table.insert(threads, thread)
end

local routes = {
  { "/engagements/progress/lesson", "lesson_id" },
  { "/audios/progress", "audio_id" },
  { "/meditations/progress", "meditation_id" },
  { "/lives/progress", "live_id" },
}
local authorizations = {}
local max_content = 2000
local min_content = 1
local headers = { ["Content-Type"] = "application/json" }

-- globals, so done() can read them from each thread with thread:get
statuses = {}
non201 = 0

function init(args)
  if args[1] == nil then
    error("usage: wrk ... -s progress.lua URL -- TOKENS_FILE [MAX_CONTENT_ID]")
  end
  for line in io.lines(args[1]) do
    if #line > 0 then
      authorizations[#authorizations + 1] = "Bearer " .. line
    end
  end
  if #authorizations == 0 then
    error("no tokens in " .. args[1])
  end
  if args[2] then
    max_content = tonumber(args[2])
  end
  if args[3] then
    min_content = tonumber(args[3])
  end
  math.randomseed(os.time() * 1000 + (id or 0))
end

function request()
  local route = routes[math.random(4)]
  headers["Authorization"] = authorizations[math.random(#authorizations)]
  local body = string.format('{"%s":%d,"position":%.1f}', route[2], math.random(min_content, max_content),
                             math.random() * 3600)
  return wrk.format("POST", route[1], headers, body)
end

function response(status, _, _)
  statuses[status] = (statuses[status] or 0) + 1
  if status ~= 201 then
    non201 = non201 + 1
  end
end

function done(summary, latency, _)
  local total_non201, counts = 0, {}
  for _, thread in ipairs(threads) do
    total_non201 = total_non201 + thread:get("non201")
    for status, n in pairs(thread:get("statuses")) do
      counts[status] = (counts[status] or 0) + n
    end
  end
  local parts = {}
  for status, n in pairs(counts) do
    parts[#parts + 1] = string.format('"%d":%d', status, n)
  end
  local e = summary.errors
  io.write(string.format(
    'BENCH_RESULT {"requests":%d,"duration_us":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"p999_us":%d,'
      .. '"max_us":%d,"mean_us":%.1f,"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},'
      .. '"non201":%d,"statuses":{%s}}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency:percentile(99.9), latency.max, latency.mean,
    e.connect, e.read, e.write, e.status, e.timeout, total_non201, table.concat(parts, ",")
  ))
end
