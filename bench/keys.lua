-- wrk script for bench/run.sh: GET /users/{id} with keys from a seeded RNG.
--
--   wrk -t2 -c64 -d10s -s bench/keys.lua http://127.0.0.1:18080 -- WORKLOAD SEED [KEYLOG]
--
-- WORKLOAD
--   attack  100 % absent keys: uniform over 1,000,000,001..2,000,000,000
--   hot     existing keys, Zipf(s = 1.0) over ranks 1..N (N = 1,000,000);
--           rank r is user ((r - 1) * 7919) % N + 1, so the hot keys are
--           spread over the table rather than its first pages
--   cold    existing keys, uniform over 1..N (N is 10x the gateway's cache)
--   mixed   90 % hot, 10 % attack
--   hit     existing keys, uniform over K = HIT_KEYS (env, default 10,000)
--           ranks, rank r being user ((r - 1) * 7919) % N + 1 as for hot: a
--           key set every system's cache holds, so once warmed every request
--           is a cache hit (run.sh warms it with hitwarm and checks it)
--   hitwarm the same K keys in order, each wrk thread cycling through all of
--           them from its own offset; done() reports min_sent, the fewest
--           requests any thread sent: a thread that sent K + its connections
--           has had an answer for every key (run.sh repeats the warm-up until
--           then)
-- SEED    integer; thread t uses SEED * 1000 + t, so runs are repeatable.
-- KEYLOG  optional path prefix: thread t writes every key it sends to
--         KEYLOG.t, one per line (run.sh counts distinct keys from them).
--
-- Environment (bench/auth.sh): PATH_PREFIX [/users/]; AUTH_HEADER, one
-- header sent with every request ("Authorization: Bearer ..."); TOKENS_FILE,
-- a file of tokens, one a line, each request sending the next as a bearer
-- token (each thread from its own offset), for credentials the gateway has
-- not seen.
--
-- done() prints one line "RESULT k=v ..." (latencies in microseconds) that
-- run.sh parses. `bad` counts responses other than 200 and 404: wrk's own
-- "status errors" count every 404, which is the right answer for an absent
-- key.

local N = 1000000
local ABSENT_LO, ABSENT_HI = 1000000001, 2000000000
local STRIDE = 7919 -- prime, coprime with N: rank -> id is a bijection
local K = tonumber(os.getenv("HIT_KEYS") or "10000")
assert(K >= 1 and K <= N, "HIT_KEYS must be in 1.." .. N)

local threads = {}
local PREFIX = os.getenv("PATH_PREFIX") or "/users/"
local headers = nil
do
  local h = os.getenv("AUTH_HEADER")
  if h and h ~= "" then
    local name, value = h:match("^([^:]+):%s*(.*)$")
    headers = { [name] = value }
  end
end
local tokens, token_at = nil, 0

function setup(thread)
  thread:set("tid", #threads + 1)
  table.insert(threads, thread)
end

local workload, log
-- Rank r of N (hot, hit) to a user id, scattered over the table.
local function rank_id(r)
  return ((r - 1) * STRIDE) % N + 1
end

bad = 0
sent = 0
absent_sent = 0

-- Zipf(s = 1.0) over ranks 1..N by rejection-inversion (Hoermann and
-- Derflinger 1996, as in Apache Commons RNG): exact, O(1), no table, so the
-- load generator spends as little as possible per key. For s = 1 the
-- integral of h(x) = 1/x is log(x) and its inverse exp(y).
local zx1, zn, zs
local function build_zipf()
  zx1 = math.log(1.5) - 1.0
  zn = math.log(N + 0.5)
  zs = 2.0 - math.exp(math.log(2.5) - 0.5)
end

local function zipf_id()
  local r
  while true do
    local u = zn + math.random() * (zx1 - zn)
    local x = math.exp(u)
    r = math.floor(x + 0.5)
    if r < 1 then r = 1 elseif r > N then r = N end
    if r - x <= zs or u >= math.log(r + 0.5) - 1.0 / r then break end
  end
  return rank_id(r)
end

local function absent_id()
  absent_sent = absent_sent + 1
  return math.random(ABSENT_LO, ABSENT_HI)
end

local next_id

function init(args)
  workload = args[1] or "hot"
  local seed = tonumber(args[2] or "1")
  math.randomseed(seed * 1000 + (tid or 0))
  if workload == "attack" then
    next_id = absent_id
  elseif workload == "hot" then
    build_zipf()
    next_id = zipf_id
  elseif workload == "cold" then
    next_id = function() return math.random(1, N) end
  elseif workload == "hit" then
    next_id = function() return rank_id(math.random(1, K)) end
  elseif workload == "hitwarm" then
    -- Each thread walks all K keys, threads from different offsets so that
    -- they do not ask for the same key at the same moment.
    local r = math.floor(K * (((tid or 1) - 1) * 0.618034 % 1))
    next_id = function()
      r = r % K + 1
      return rank_id(r)
    end
  elseif workload == "mixed" then
    build_zipf()
    next_id = function()
      if math.random() < 0.9 then return zipf_id() end
      return absent_id()
    end
  else
    error("unknown workload " .. workload)
  end
  local tf = os.getenv("TOKENS_FILE")
  if tf and tf ~= "" then
    tokens = {}
    for line in io.lines(tf) do tokens[#tokens + 1] = line end
    token_at = math.floor(#tokens * (((tid or 1) - 1) * 0.5 % 1))
  end
  if args[3] and args[3] ~= "" then
    log = assert(io.open(args[3] .. "." .. (tid or 0), "w"))
    log:setvbuf("full", 65536)
  end
end

function request()
  local id = next_id()
  sent = sent + 1
  if log then log:write(string.format("%d\n", id)) end
  local path = PREFIX .. string.format("%d", id)
  if tokens then
    token_at = token_at % #tokens + 1
    return wrk.format("GET", path, { ["Authorization"] = "Bearer " .. tokens[token_at] })
  end
  return wrk.format("GET", path, headers)
end

function response(status, headers, body)
  if status ~= 200 and status ~= 404 then
    bad = bad + 1
  end
end

function done(summary, latency, requests)
  local b, s, a, m = 0, 0, 0, nil
  for _, t in ipairs(threads) do
    b = b + (t:get("bad") or 0)
    local ts = t:get("sent") or 0
    s = s + ts
    a = a + (t:get("absent_sent") or 0)
    if m == nil or ts < m then m = ts end
  end
  local e = summary.errors
  io.write(string.format(
    "RESULT requests=%d duration_us=%d rps=%.1f p50_us=%d p99_us=%d p999_us=%d max_us=%d " ..
    "connect=%d read=%d write=%d timeout=%d status_ge400=%d bad=%d sent=%d absent_sent=%d min_sent=%d\n",
    summary.requests, summary.duration, summary.requests / (summary.duration / 1e6),
    latency:percentile(50), latency:percentile(99), latency:percentile(99.9), latency.max,
    e.connect, e.read, e.write, e.timeout, e.status, b, s, a, m or 0))
end
