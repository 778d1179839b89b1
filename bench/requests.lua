-- wrk script of every HTTP benchmark (harness.wrk): one kind of request per run, random users (tokens), contents
-- and positions; counts the answers by status, and done() prints one BENCH_RESULT JSON line.
--   wrk -t2 -c64 -d20s --latency -s bench/requests.lua URL -- TOKENS_FILE MODE FIRST_ID LAST_ID
-- MODE: heartbeat (POST one of the four routes), lesson (POST the lesson route), one (GET /progress/lesson/{id}),
-- many (GET /progress/lesson?ids= 100 ids), sync (POST /progress/sync, 500 items).

local threads, next_id = {}, 0
local routes = { { "/engagements/progress/lesson", "lesson_id" }, { "/audios/progress", "audio_id" },
  { "/meditations/progress", "meditation_id" }, { "/lives/progress", "live_id" } }
local types = { "lesson", "audio", "meditation", "live" }
local authorizations, sync_bodies, headers = {}, {}, { ["Content-Type"] = "application/json" }
local mode, first, last = "heartbeat", 1, 2000
statuses = {} -- a global, so done() can read it from each thread

function setup(thread)
  next_id = next_id + 1
  thread:set("thread_id", next_id)
  table.insert(threads, thread)
end

local function id() return math.random(first, last) end

function init(args)
  for line in io.lines(args[1]) do
    if #line > 0 then authorizations[#authorizations + 1] = "Bearer " .. line end
  end
  mode, first, last = args[2], tonumber(args[3]), tonumber(args[4])
  math.randomseed(os.time() * 1000 + (thread_id or 0))
  for body = 1, mode == "sync" and 20 or 0 do
    local items = {}
    for i = 1, 500 do
      items[i] = string.format('{"content_type":"%s","content_id":%d,"position":%.1f,"listened_at":"%s"}',
        types[math.random(4)], id(), math.random() * 600, os.date("!%Y-%m-%dT%H:%M:%SZ", os.time() - math.random(3600)))
    end
    sync_bodies[body] = '{"items":[' .. table.concat(items, ",") .. "]}"
  end
end

function request()
  headers["Authorization"] = authorizations[math.random(#authorizations)]
  if mode == "heartbeat" or mode == "lesson" then
    local route = routes[mode == "lesson" and 1 or math.random(4)]
    return wrk.format("POST", route[1], headers, string.format('{"%s":%d,"position":%.1f}', route[2], id(),
      math.random() * 600))
  elseif mode == "one" then
    return wrk.format("GET", "/progress/lesson/" .. id(), headers)
  elseif mode == "many" then
    local ids = {}
    for i = 1, 100 do ids[i] = id() end
    return wrk.format("GET", "/progress/lesson?ids=" .. table.concat(ids, ","), headers)
  end
  return wrk.format("POST", "/progress/sync", headers, sync_bodies[math.random(#sync_bodies)])
end

function response(status, _, _)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, _)
  local counts, parts = {}, {}
  for _, thread in ipairs(threads) do
    for status, n in pairs(thread:get("statuses")) do counts[status] = (counts[status] or 0) + n end
  end
  for status, n in pairs(counts) do parts[#parts + 1] = string.format('"%d":%d', status, n) end
  local e = summary.errors -- e.status counts the non-2xx answers, already in statuses
  io.write(string.format('BENCH_RESULT {"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,"p999_us":%d,'
    .. '"socket_errors":%d,"statuses":{%s}}\n', summary.requests, summary.duration, latency:percentile(50),
    latency:percentile(99), latency:percentile(99.9), e.connect + e.read + e.write + e.timeout, table.concat(parts, ",")))
end
