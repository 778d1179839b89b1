-- wrk script for bench/bench_reads.py: one kind of request per run, random users and contents.
-- Counts the answers by status in each thread; done() prints one BENCH_RESULT JSON line, where
-- "non201" counts answers outside the mode's expected statuses.
--
--   wrk ... -s bench/reads.lua URL -- TOKENS_FILE MAX_CONTENT_ID MODE
--
-- MODE: heartbeat (POST a lesson heartbeat, 201), one (GET /progress/lesson/{id}, 200 or 404),
-- many (GET /progress/lesson?ids= 100 ids, 200), sync (POST /progress/sync, 500 items, 200).

local threads = {}
local next_id = 0

function setup(thread)
  next_id = next_id + 1
  thread:set("id", next_id)
  table.insert(threads, thread)
end

local authorizations = {}
local max_content = 100
local mode = "heartbeat"
local headers = { ["Content-Type"] = "application/json" }
local expected = {}
local sync_bodies = {}
local types = { "lesson", "audio", "meditation", "live" }

statuses = {}
non201 = 0

local function sync_body()
  local items = {}
  for i = 1, 500 do
    local listened = os.date("!%Y-%m-%dT%H:%M:%SZ", os.time() - math.random(3600))
    items[i] = string.format('{"content_type":"%s","content_id":%d,"position":%.1f,"listened_at":"%s"}',
      types[math.random(4)], math.random(max_content), math.random() * 600, listened)
  end
  return '{"items":[' .. table.concat(items, ",") .. "]}"
end

function init(args)
  if args[3] == nil then
    error("usage: wrk ... -s reads.lua URL -- TOKENS_FILE MAX_CONTENT_ID MODE")
  end
  for line in io.lines(args[1]) do
    if #line > 0 then
      authorizations[#authorizations + 1] = "Bearer " .. line
    end
  end
  max_content = tonumber(args[2])
  mode = args[3]
  math.randomseed(os.time() * 1000 + (id or 0))
  if mode == "heartbeat" then
    expected = { [201] = true }
  elseif mode == "one" then
    expected = { [200] = true, [404] = true }
  elseif mode == "many" then
    expected = { [200] = true }
  elseif mode == "sync" then
    expected = { [200] = true }
    for i = 1, 20 do
      sync_bodies[i] = sync_body()
    end
  else
    error("unknown mode " .. mode)
  end
end

local function many_path()
  local ids = {}
  for i = 1, 100 do
    ids[i] = math.random(max_content)
  end
  return "/progress/lesson?ids=" .. table.concat(ids, ",")
end

function request()
  headers["Authorization"] = authorizations[math.random(#authorizations)]
  if mode == "heartbeat" then
    local body = string.format('{"lesson_id":%d,"position":%.1f}', math.random(max_content), math.random() * 600)
    return wrk.format("POST", "/engagements/progress/lesson", headers, body)
  elseif mode == "one" then
    return wrk.format("GET", "/progress/lesson/" .. math.random(max_content), headers)
  elseif mode == "many" then
    return wrk.format("GET", many_path(), headers)
  end
  return wrk.format("POST", "/progress/sync", headers, sync_bodies[math.random(#sync_bodies)])
end

function response(status, _, _)
  statuses[status] = (statuses[status] or 0) + 1
  if not expected[status] then
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
    e.connect, e.read, e.write, e.status, e.timeout, total_non201, table.concat(parts, ",")))
end
