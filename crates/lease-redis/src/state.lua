-- The lease state's operations, each run whole (atomically) on the server, on the server's clock.
--
-- KEYS[1] is the counter of lease serials, `{prefix}:serial`: every key below shares its hash tag, so a cluster
-- keeps them in one slot. ARGV[1] is the key prefix (`{prefix}:`), ARGV[2] the operation, the rest its arguments.
-- Times are milliseconds since the Unix epoch; cooldown policies are (base, factor, max) in milliseconds.
--
-- Keys:
--   serial              counter of lease serials (started at a random value below 2^47 the caller gives)
--   seq                 counter ordering grants, for "least recently leased" and "newest first"
--   exp                 ZSET serial -> expiry, every live lease
--   l:<serial>          HASH a live lease: proxy target owner exp endpoint granted reported adopted seq, and slot
--                       (<owner>\n<session>\n<target>) for a session's lease
--   p:<proxy>           ZSET serial -> expiry, the live leases on a proxy
--   o:<owner>           ZSET serial -> expiry, the live leases of an owner
--   held                HASH owner -> live leases
--   active              HASH proxy -> the slots its live leases take, which its cap bounds (read for many proxies
--                       at once): one per lease without a session, one per session and target however many share it
--   ps:<proxy>          HASH slot -> the live leases sharing it (every gateway replica a session reaches holds one)
--   last                HASH proxy -> seq of its last grant
--   e:<serial>          HASH a lease ended before its expiry (expires then): released proxy target granted reported
--   c:<proxy>\n<target> HASH a cooldown (expires when forgotten): until streak cleared, r:<owner> -> 1 ban / 0 throttle
--   pc:<proxy>          ZSET target -> forget time, the cooldowns of a proxy
--   cooling             ZSET <proxy>\n<target> -> until, the running cooldowns
--   s:<owner>\n<session>\n<target>  STRING the session's proxy, when it chose it and how many leases it took there
--                       since: <proxy>\n<since>\n<leases> (expires when forgotten; a bare <proxy> is from before
--                       session lifetimes, and counts as chosen now)
--   g:<address>\n<target> STRING the theoretical arrival time of the pace of an egress address (or a proxy's name)
--                       for a site (expires then)
--   x:<proxy>\n<target> HASH outcome counts ok failed banned throttled (expire an hour after the last report)
--   refusals            the channel each ban and throttle is published on, as JSON: owner target until proxies

local P = ARGV[1]
local op = ARGV[2]
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local function num(value)
  if value == false or value == nil or value == '' then return nil end
  return tonumber(value)
end

local function id(n)
  return string.format('%.0f', n)
end

-- The cooldown after the streak-th ban in a row.
local function after(base, factor, max, streak)
  local cooldown = base
  for _ = 2, streak do
    if cooldown >= max then break end
    cooldown = cooldown * math.max(factor, 1)
  end
  return math.min(cooldown, max)
end

-- Sets field of each item of list to its proxy's number in the hash at P .. hash (0 when absent), a thousand
-- proxies per command.
local SAMPLE = 16

local function fetch(hash, list, field)
  for from = 1, #list, 1000 do
    local names = {}
    for i = from, math.min(from + 999, #list) do table.insert(names, list[i].proxy) end
    local values = redis.call('HMGET', P .. hash, unpack(names))
    for i = 1, #names do list[from + i - 1][field] = num(values[i]) or 0 end
  end
end

local function free(serial)
  local key = P .. 'l:' .. serial
  local l = redis.call('HMGET', key, 'proxy', 'owner', 'target', 'exp', 'granted', 'reported', 'slot')
  if not l[1] then return nil end
  redis.call('DEL', key)
  redis.call('ZREM', P .. 'exp', serial)
  redis.call('ZREM', P .. 'p:' .. l[1], serial)
  redis.call('ZREM', P .. 'o:' .. l[2], serial)
  if redis.call('HINCRBY', P .. 'held', l[2], -1) <= 0 then redis.call('HDEL', P .. 'held', l[2]) end
  -- A session's slot is free once no other lease shares it.
  local last = true
  if l[7] then
    last = redis.call('HINCRBY', P .. 'ps:' .. l[1], l[7], -1) <= 0
    if last then redis.call('HDEL', P .. 'ps:' .. l[1], l[7]) end
  end
  if last and redis.call('HINCRBY', P .. 'active', l[1], -1) <= 0 then redis.call('HDEL', P .. 'active', l[1]) end
  return { proxy = l[1], owner = l[2], target = l[3], exp = num(l[4]), granted = l[5], reported = l[6] }
end

-- Remembers a lease that ended before `ends` (its latest expiry), so its IDs are refused until then.
local function ended(serial, proxy, target, ends, released, granted, reported)
  if ends <= now then return end
  local key = P .. 'e:' .. serial
  redis.call('HSET', key, 'released', released, 'proxy', proxy, 'target', target, 'granted', granted,
    'reported', reported)
  redis.call('PEXPIREAT', key, ends)
end

local function expire(limit)
  local count = 0
  for _, serial in ipairs(redis.call('ZRANGEBYSCORE', P .. 'exp', '-inf', now, 'LIMIT', 0, limit)) do
    if free(serial) then count = count + 1 end
  end
  return count
end

-- Adds a live lease: a slot of its own on proxy, or (slot not '') a share of its session's slot there.
local function add_lease(serial, proxy, target, owner, exp, endpoint, adopted, slot)
  local seq = redis.call('INCR', P .. 'seq')
  redis.call('HSET', P .. 'l:' .. serial, 'proxy', proxy, 'target', target, 'owner', owner, 'exp', exp,
    'endpoint', endpoint, 'granted', now, 'reported', 0, 'adopted', adopted, 'seq', seq)
  redis.call('ZADD', P .. 'exp', exp, serial)
  redis.call('ZADD', P .. 'p:' .. proxy, exp, serial)
  redis.call('ZADD', P .. 'o:' .. owner, exp, serial)
  redis.call('HINCRBY', P .. 'held', owner, 1)
  local first = true
  if slot ~= '' then
    redis.call('HSET', P .. 'l:' .. serial, 'slot', slot)
    first = redis.call('HINCRBY', P .. 'ps:' .. proxy, slot, 1) == 1
  end
  if first then redis.call('HINCRBY', P .. 'active', proxy, 1) end
  return seq
end

-- Whether the session's slot is taken on proxy already (a lease in it takes no more room).
local function shares(proxy, slot)
  return slot ~= '' and redis.call('HEXISTS', P .. 'ps:' .. proxy, slot) == 1
end

local function cooling_until(proxy, target)
  local ends = num(redis.call('HGET', P .. 'c:' .. proxy .. '\n' .. target, 'until'))
  if ends and ends > now then return ends end
  return nil
end

local function set_cooldown(proxy, target, ends, streak, base, factor, max)
  local key = P .. 'c:' .. proxy .. '\n' .. target
  local forget = ends + after(base, factor, max, streak + 1)
  redis.call('HSET', key, 'until', ends, 'streak', streak)
  redis.call('PEXPIREAT', key, forget)
  redis.call('ZADD', P .. 'pc:' .. proxy, forget, target)
  redis.call('ZADD', P .. 'cooling', ends, proxy .. '\n' .. target)
end

local function reporters(key)
  local who = {}
  for _, field in ipairs(redis.call('HKEYS', key)) do
    if string.sub(field, 1, 2) == 'r:' then table.insert(who, string.sub(field, 3)) end
  end
  table.sort(who)
  return who
end

local function forget_reporters(key)
  for _, owner in ipairs(reporters(key)) do redis.call('HDEL', key, 'r:' .. owner) end
end

-- Notes that owner's report (a ban when ban) made the cooldown at key.
local function reported_by(key, owner, ban, running)
  if redis.call('EXISTS', key) == 0 then return end
  if not running then forget_reporters(key) end
  if ban then
    redis.call('HSET', key, 'r:' .. owner, 1)
  else
    redis.call('HSETNX', key, 'r:' .. owner, 0)
  end
end

local function cooldown_of(proxy, target)
  local key = P .. 'c:' .. proxy .. '\n' .. target
  local c = redis.call('HMGET', key, 'until', 'streak')
  if not c[1] then return nil end
  return { proxy, target, c[1], c[2] or '0', table.concat(reporters(key), '\n') }
end

-- Lease: ttl owner quota target session keep mode start maxage maxleases, then (proxy cap endpoint pace address)
-- per candidate in the caller's order, pace being `<interval ms>:<burst>` for a paced proxy ('' otherwise) and
-- address what its pace is kept by (its egress address, or its name). `start` is where a fresh server's serials begin; maxage (ms) and maxleases ('' for none)
-- are the session's lifetime, past which it moves to another proxy (the same one only when no other can take it).
local function lease()
  local ttl, owner, quota, target = num(ARGV[3]), ARGV[4], num(ARGV[5]), ARGV[6]
  local session, keep, mode, start = ARGV[7], num(ARGV[8]), ARGV[9], ARGV[10]
  local maxage, maxleases = num(ARGV[11]), num(ARGV[12])
  local FIRST = 13
  expire(1000)
  if quota then
    local held = redis.call('ZRANGE', P .. 'o:' .. owner, 0, 0, 'WITHSCORES')
    if redis.call('ZCARD', P .. 'o:' .. owner) >= quota then return { 'quota', held[2] or '' } end
  end
  -- Candidates are read from the arguments only as far as the choice needs: a lease costs what it looks at.
  local STRIDE = 5
  local count = math.floor((#ARGV - FIRST + 1) / STRIDE)
  local candidates = {}
  local function candidate(k)
    local c = candidates[k]
    if not c then
      local i = FIRST + (k - 1) * STRIDE
      c = { proxy = ARGV[i], cap = num(ARGV[i + 1]), endpoint = ARGV[i + 2] }
      local interval, burst = string.match(ARGV[i + 3], '^(%d+):(%d+)$')
      if interval then
        c.interval, c.burst = num(interval), math.max(num(burst), 1)
        c.pacekey = P .. 'g:' .. ARGV[i + 4] .. '\n' .. target
      end
      candidates[k] = c
    end
    return c
  end
  -- The next up to SAMPLE candidates from k on, with their leases counted; and where the next ones start.
  local function sample(k)
    local list = {}
    while #list < SAMPLE and k <= count do
      table.insert(list, candidate(k))
      k = k + 1
    end
    fetch('active', list, 'active')
    return list, k
  end
  -- A session's leases for one site share one slot on their proxy.
  local slot = ''
  if session ~= '' then slot = session .. '\n' .. target end
  -- When a paced candidate's next slot for the target is, if later than now (GCRA: `burst` at once, then one per
  -- interval; the key holds the theoretical arrival time).
  local function paced_until(c)
    if not c.interval then return nil end
    local tat = num(redis.call('GET', c.pacekey))
    if not tat then return nil end
    local earliest = tat - c.interval * (c.burst - 1)
    if earliest > now then return earliest end
    return nil
  end
  local function unpaced(c)
    return (c.active < c.cap or shares(c.proxy, slot)) and not cooling_until(c.proxy, target)
  end
  local function usable(c)
    return unpaced(c) and not paced_until(c)
  end
  local chosen
  -- When the session chose the proxy it is given, for its lifetime ('' without a session).
  local chose_at = ''
  if mode == 'named' then
    local c = sample(1)[1]
    if c.active >= c.cap and not shares(c.proxy, slot) then return { 'proxy-full' } end
    local ends = cooling_until(c.proxy, target)
    if ends then return { 'proxy-cooling', ends } end
    local slot_at = paced_until(c)
    if slot_at then return { 'proxy-paced', id(slot_at), c.proxy } end
    chosen = c
  else
    local sessionkey = P .. 's:' .. session .. '\n' .. target
    -- The session's proxy, when it chose it, how many leases it took there; and the proxy of a session past its
    -- lifetime, which it leaves for another.
    local sticky, since, used, lapsed
    -- The candidate proxy is, when usable; and when only its pace holds it back, when its next slot is.
    local function take(proxy)
      for k = 1, count do
        if ARGV[FIRST + (k - 1) * STRIDE] == proxy then
          local c = candidate(k)
          fetch('active', { c }, 'active')
          if not unpaced(c) then return nil end
          local slot_at = paced_until(c)
          if slot_at then return nil, slot_at end
          return c
        end
      end
    end
    if session ~= '' then
      local value = redis.call('GET', sessionkey)
      if value then
        sticky, since, used = string.match(value, '^(.-)\n(%d+)\n(%d+)$')
        if not sticky then sticky, since, used = value, now, 0 end
        since, used = num(since), num(used)
        if (maxage and now >= since + maxage) or (maxleases and used >= maxleases) then
          lapsed = sticky
        else
          -- A session waits for its own proxy's next slot rather than move.
          local slot_at
          chosen, slot_at = take(sticky)
          if slot_at then return { 'proxy-paced', id(slot_at), sticky } end
        end
      end
    end
    local k = 1
    while not chosen and k <= count do
      local list
      list, k = sample(k)
      if mode == 'session' then
        -- In the caller's order (the session's rendezvous order): the first usable.
        for _, c in ipairs(list) do
          if c.proxy ~= lapsed and usable(c) then
            chosen = c
            break
          end
        end
      else
        -- The least loaded (then least recently leased) of SAMPLE candidates in the caller's (random) order, the
        -- next SAMPLE only when none of these can take it: nearly as balanced as choosing among all, at a cost
        -- that does not grow with the fleet.
        local roomy = {}
        for _, c in ipairs(list) do
          if c.active < c.cap then table.insert(roomy, c) end
        end
        fetch('last', roomy, 'last')
        while not chosen do
          local best
          for _, c in ipairs(roomy) do
            if not c.cooling and (not best or c.active < best.active
                or (c.active == best.active and c.last < best.last)) then
              best = c
            end
          end
          if not best then break end
          if cooling_until(best.proxy, target) or paced_until(best) then best.cooling = true else chosen = best end
        end
      end
    end
    -- A session past its lifetime that no other proxy can take stays where it was, and starts a new one.
    if not chosen and lapsed then chosen = take(lapsed) end
    if not chosen then
      if count == 0 then return { 'none' } end
      -- Why none: every candidate is looked at, only on this path.
      local k = 1
      while k <= count do
        local _
        _, k = sample(k)
      end
      -- Proxies with room that only their pace holds back: the first slot is the answer.
      local slot_at
      for _, c in ipairs(candidates) do
        if c.active < c.cap and not cooling_until(c.proxy, target) then
          local at = paced_until(c)
          if at and (not slot_at or at < slot_at) then slot_at = at end
        end
      end
      if slot_at then return { 'paced', id(slot_at) } end
      local first, cooling, full = nil, 0, 0
      for _, c in ipairs(candidates) do
        if c.active < c.cap then
          local ends = cooling_until(c.proxy, target)
          if ends then
            cooling = cooling + 1
            if not first or ends < first then first = ends end
          end
        else
          full = full + 1
        end
      end
      if first then return { 'cooling', first, cooling, full } end
      local retry
      for _, c in ipairs(candidates) do
        local soonest = redis.call('ZRANGE', P .. 'p:' .. c.proxy, 0, 0, 'WITHSCORES')[2]
        if soonest and (not retry or num(soonest) < retry) then retry = num(soonest) end
      end
      return { 'capacity', retry or '' }
    end
    if session ~= '' then
      if lapsed or chosen.proxy ~= sticky then since, used = now, 0 end
      redis.call('SET', sessionkey, chosen.proxy .. '\n' .. id(since) .. '\n' .. id(used + 1),
        'PX', math.floor((now + ttl) / 1000) * 1000 + keep - now)
      chose_at = id(since)
    end
  end
  redis.call('SET', KEYS[1], start, 'NX')
  local serial = id(redis.call('INCR', KEYS[1]))
  local exp = math.floor((now + ttl) / 1000) * 1000
  local seq = add_lease(serial, chosen.proxy, target, owner, exp, chosen.endpoint, 0, slot)
  redis.call('HSET', P .. 'last', chosen.proxy, seq)
  if chosen.interval then
    local tat = num(redis.call('GET', chosen.pacekey))
    if not tat or tat < now then tat = now end
    tat = tat + chosen.interval
    redis.call('SET', chosen.pacekey, id(tat), 'PX', tat - now)
  end
  return { 'ok', serial, chosen.proxy, exp, chosen.endpoint, chose_at }
end

-- Resolves a lease ID's serial (live, or adopted when valid and unknown here): serial owner proxy target exp healthy
-- endpoint. Returns nil when live or adopted, else the refusal.
local function resolve(serial, owner, proxy, target, exp, healthy, endpoint)
  if redis.call('EXISTS', P .. 'l:' .. serial) == 1 then return nil end
  local released = redis.call('HGET', P .. 'e:' .. serial, 'released')
  if released == '1' then return { 'unknown' } end
  if released == '0' then return { 'revoked' } end
  if exp <= now then return { 'unknown' } end
  if healthy ~= '1' then return { 'revoked' } end
  -- An ID does not name its session: a lease taken over takes a slot of its own.
  add_lease(serial, proxy, target, owner, exp, endpoint, 1, '')
  return nil
end

-- Renew: serial owner proxy target exp healthy endpoint ttl.
local function renew()
  local serial, owner, healthy, endpoint, ttl = ARGV[3], ARGV[4], ARGV[8], ARGV[9], num(ARGV[10])
  expire(1000)
  local key = P .. 'l:' .. serial
  local adopted = 1 - redis.call('EXISTS', key)
  local refused = resolve(serial, owner, ARGV[5], ARGV[6], num(ARGV[7]), healthy, endpoint)
  if refused then return refused end
  if healthy ~= '1' then
    local l = free(serial)
    ended(serial, l.proxy, l.target, l.exp, 0, l.granted, l.reported)
    return { 'revoked' }
  end
  local exp = math.floor((now + ttl) / 1000) * 1000
  local l = redis.call('HMGET', key, 'proxy', 'owner', 'endpoint')
  redis.call('HSET', key, 'exp', exp, 'endpoint', endpoint)
  redis.call('ZADD', P .. 'exp', exp, serial)
  redis.call('ZADD', P .. 'p:' .. l[1], exp, serial)
  redis.call('ZADD', P .. 'o:' .. l[2], exp, serial)
  local moved = ''
  if l[3] ~= endpoint then moved = l[3] end
  return { 'ok', exp, moved, adopted }
end

-- Release: serial exp keep.
local function release()
  local serial, exp, keep = ARGV[3], num(ARGV[4]), num(ARGV[5])
  expire(1000)
  local l = free(serial)
  if l then
    ended(serial, l.proxy, l.target, l.exp, 1, l.granted, l.reported)
    return { 'ok' }
  end
  if redis.call('EXISTS', P .. 'e:' .. serial) == 1 then
    redis.call('HSET', P .. 'e:' .. serial, 'released', 1)
    return { 'ok' }
  end
  if exp > now then
    ended(serial, '', '', now + keep, 1, now, 0)
    return { 'ok' }
  end
  return { 'unknown' }
end

-- Report: serial owner proxy target exp healthy endpoint outcome ok failed release wait burst rate base factor max,
-- then (proxy base factor max) per proxy leaving through the same address.
local function report()
  local serial, owner, healthy, endpoint = ARGV[3], ARGV[4], ARGV[8], ARGV[9]
  local outcome, okn, failn, rel, wait = ARGV[10], num(ARGV[11]), num(ARGV[12]), ARGV[13], num(ARGV[14])
  local burst, rate, base, factor, max = num(ARGV[15]), num(ARGV[16]), num(ARGV[17]), num(ARGV[18]), num(ARGV[19])
  expire(1000)
  local lkey, ekey = P .. 'l:' .. serial, P .. 'e:' .. serial
  local adopted = 0
  if redis.call('EXISTS', ekey) == 0 and redis.call('EXISTS', lkey) == 0 then
    local refused = resolve(serial, owner, ARGV[5], ARGV[6], num(ARGV[7]), healthy, endpoint)
    if not refused then adopted = 1 end
    if refused and refused[1] == 'revoked' then
      ended(serial, ARGV[5], ARGV[6], num(ARGV[7]), 0, now, 0)
    elseif refused then
      return refused
    end
  end
  local source = lkey
  if redis.call('EXISTS', lkey) == 0 then source = ekey end
  local l = redis.call('HMGET', source, 'proxy', 'target', 'granted', 'reported')
  if not l[1] then return { 'unknown' } end
  local proxy, target = l[1], l[2]
  if proxy == '' then
    proxy, target = ARGV[5], ARGV[6]
    redis.call('HSET', ekey, 'proxy', proxy, 'target', target)
  end
  local age = math.max(0, math.floor((now - (num(l[3]) or now)) / 1000))
  local budget = math.max(0, burst + rate * age - (num(l[4]) or 0))
  local function take(asked)
    local taken = math.min(asked, budget)
    budget = budget - taken
    return taken
  end
  if outcome ~= '' then take(1) end
  local counted = { ok = take(okn), failed = take(failn), banned = 0, throttled = 0 }
  local ckey = P .. 'c:' .. proxy .. '\n' .. target
  if (okn > 0 or outcome == 'ok') and redis.call('EXISTS', ckey) == 1 then redis.call('HSET', ckey, 'streak', 0) end
  local running_until = cooling_until(proxy, target)
  local running = running_until ~= nil
  local mine = running and redis.call('HGET', ckey, 'r:' .. owner)
  local changed, cooldown = false, nil
  if outcome == 'ok' then
    counted.ok = counted.ok + 1
  elseif outcome == 'failed' then
    counted.failed = counted.failed + 1
  elseif outcome == 'banned' then
    counted.banned = 1
    if mine == '1' then
      cooldown = running_until
    else
      local streak = (num(redis.call('HGET', ckey, 'streak')) or 0) + 1
      cooldown = math.max(now + after(base, factor, max, streak), running_until or now)
      set_cooldown(proxy, target, cooldown, streak, base, factor, max)
      reported_by(ckey, owner, true, running)
      changed = true
    end
  elseif outcome == 'throttled' then
    counted.throttled = 1
    if mine then
      cooldown = running_until
    else
      local streak = num(redis.call('HGET', ckey, 'streak')) or 0
      cooldown = math.max(running_until or now, now + wait)
      set_cooldown(proxy, target, cooldown, streak, base, factor, max)
      reported_by(ckey, owner, false, running)
      changed = true
    end
  end
  local result = { 'ok', proxy, target, cooldown or '', adopted }
  if changed then
    local streak = num(redis.call('HGET', ckey, 'streak')) or 0
    table.insert(result, proxy)
    for i = 20, #ARGV, 4 do
      local sibling = ARGV[i]
      local skey = P .. 'c:' .. sibling .. '\n' .. target
      local c = redis.call('HMGET', skey, 'until', 'streak')
      local known_until, known_streak = num(c[1]) or cooldown, num(c[2]) or 0
      local sibling_running = num(c[1]) ~= nil and num(c[1]) > now
      set_cooldown(sibling, target, math.max(known_until, cooldown), math.max(known_streak, streak),
        num(ARGV[i + 1]), num(ARGV[i + 2]), num(ARGV[i + 3]))
      reported_by(skey, owner, outcome == 'banned', sibling_running)
      table.insert(result, sibling)
    end
  end
  -- Every replica's refusal streams hear of it: the gateways move the owner's sessions off these proxies.
  if cooldown and (outcome == 'banned' or outcome == 'throttled') then
    local proxies = { proxy }
    if changed then proxies = { unpack(result, 6) } end
    redis.call('PUBLISH', P .. 'refusals', cjson.encode({ owner = owner, target = target,
      ['until'] = string.format('%.0f', cooldown), proxies = proxies }))
  end
  local used = counted.ok + counted.failed + counted.banned + counted.throttled
  if used > 0 then
    local xkey = P .. 'x:' .. proxy .. '\n' .. target
    for field, n in pairs(counted) do
      if n > 0 then redis.call('HINCRBY', xkey, field, n) end
    end
    redis.call('PEXPIRE', xkey, 3600000)
    redis.call('HINCRBY', source, 'reported', used)
  end
  if rel == '1' then
    local freed = free(serial)
    if freed then
      ended(serial, freed.proxy, freed.target, freed.exp, 1, freed.granted, freed.reported)
    elseif redis.call('EXISTS', ekey) == 1 then
      redis.call('HSET', ekey, 'released', 1)
    end
  end
  return result
end

-- Revoke: proxy keep. Revokes the newest slots of proxy (each with every lease sharing it) until at most keep
-- remain.
local function revoke()
  local proxy, keep = ARGV[3], num(ARGV[4])
  local slots, order = {}, {}
  for _, serial in ipairs(redis.call('ZRANGE', P .. 'p:' .. proxy, 0, -1)) do
    local l = redis.call('HMGET', P .. 'l:' .. serial, 'seq', 'slot')
    local key = l[2] or ('#' .. serial)
    local slot = slots[key]
    if not slot then
      slot = { seq = 0, serials = {} }
      slots[key] = slot
      table.insert(order, slot)
    end
    slot.seq = math.max(slot.seq, num(l[1]) or 0)
    table.insert(slot.serials, serial)
  end
  table.sort(order, function(a, b) return a.seq > b.seq end)
  local revoked = 0
  for _, slot in ipairs(order) do
    if (num(redis.call('HGET', P .. 'active', proxy)) or 0) <= keep then break end
    for _, serial in ipairs(slot.serials) do
      local l = free(serial)
      if l then
        ended(serial, l.proxy, l.target, l.exp, 0, l.granted, l.reported)
        revoked = revoked + 1
      end
    end
  end
  return revoked
end

-- Cooldowns: every running one, as (proxy target until streak reporters) five at a time.
local function cooldowns()
  redis.call('ZREMRANGEBYSCORE', P .. 'cooling', '-inf', now)
  local out = {}
  for _, member in ipairs(redis.call('ZRANGE', P .. 'cooling', 0, -1)) do
    local split = string.find(member, '\n', 1, true)
    local c = cooldown_of(string.sub(member, 1, split - 1), string.sub(member, split + 1))
    if c and num(c[3]) > now then
      for _, v in ipairs(c) do table.insert(out, v) end
    end
  end
  return out
end

-- Proxy cooldowns: proxy. Its cooldowns, running or with a streak still remembered.
local function proxy_cooldowns()
  local proxy = ARGV[3]
  redis.call('ZREMRANGEBYSCORE', P .. 'pc:' .. proxy, '-inf', now)
  local out = {}
  for _, target in ipairs(redis.call('ZRANGE', P .. 'pc:' .. proxy, 0, -1)) do
    local c = cooldown_of(proxy, target)
    if c then
      for _, v in ipairs(c) do table.insert(out, v) end
    end
  end
  return out
end

-- Restore: (proxy target until streak reporters base factor max) per cooldown.
local function restore()
  local restored = 0
  for i = 3, #ARGV, 8 do
    local proxy, target, ends, streak = ARGV[i], ARGV[i + 1], num(ARGV[i + 2]), num(ARGV[i + 3])
    local base, factor, max = num(ARGV[i + 5]), num(ARGV[i + 6]), num(ARGV[i + 7])
    local key = P .. 'c:' .. proxy .. '\n' .. target
    local known = redis.call('HMGET', key, 'until', 'cleared')
    local newer = (num(known[1]) and num(known[1]) >= ends) or (num(known[2]) and num(known[2]) >= ends)
    if not newer and ends + after(base, factor, max, streak + 1) > now then
      set_cooldown(proxy, target, ends, streak, base, factor, max)
      for owner in string.gmatch(ARGV[i + 4], '[^\n]+') do reported_by(key, owner, true, true) end
      restored = restored + 1
    end
  end
  return restored
end

-- Clear: target, then the proxies whose cooldowns for it end now.
local function clear()
  local target = ARGV[3]
  local out = {}
  for i = 4, #ARGV do
    local proxy = ARGV[i]
    local key = P .. 'c:' .. proxy .. '\n' .. target
    local c = cooldown_of(proxy, target)
    if c then
      local ends = num(c[3])
      if ends > now then
        for _, v in ipairs(c) do table.insert(out, v) end
      end
      local cleared = math.max(num(redis.call('HGET', key, 'cleared')) or 0, ends)
      redis.call('HSET', key, 'cleared', cleared, 'until', math.min(ends, now), 'streak', 0)
      forget_reporters(key)
      redis.call('ZREM', P .. 'cooling', proxy .. '\n' .. target)
    end
  end
  return out
end

-- Loads: target (or ''), then proxies: (active cooling ok failed banned throttled) per proxy.
local function loads()
  local target = ARGV[3]
  expire(1000)
  local out = {}
  for i = 4, #ARGV do
    local proxy = ARGV[i]
    table.insert(out, num(redis.call('HGET', P .. 'active', proxy)) or 0)
    if target == '' then
      for _ = 1, 5 do table.insert(out, '') end
    else
      table.insert(out, cooling_until(proxy, target) or '')
      local x = redis.call('HMGET', P .. 'x:' .. proxy .. '\n' .. target, 'ok', 'failed', 'banned', 'throttled')
      local any = x[1] or x[2] or x[3] or x[4]
      for j = 1, 4 do
        if any then table.insert(out, x[j] or '0') else table.insert(out, '') end
      end
    end
  end
  return out
end

-- Held: owner. The proxies of its live leases.
local function held()
  expire(1000)
  local out = {}
  for _, serial in ipairs(redis.call('ZRANGE', P .. 'o:' .. ARGV[3], 0, -1)) do
    table.insert(out, redis.call('HGET', P .. 'l:' .. serial, 'proxy'))
  end
  return out
end

-- A glob pattern matching text literally (SCAN's MATCH).
local function literal(text)
  return (string.gsub(text, '[%*%?%[%]\\]', '\\%0'))
end

-- End sessions: owner session ('' for every one of owner's). Releases the sessions' live leases and forgets their
-- proxies (the s: keys of idle sessions too, found by SCAN: every key shares one hash tag, so one node holds them);
-- returns (sessions ended, leases released).
local function end_sessions()
  local owner, session = ARGV[3], ARGV[4]
  expire(1000)
  local prefix = owner .. '\n'
  if session ~= '' then prefix = prefix .. session .. '\n' end
  local slots, count, released = {}, 0, 0
  local function note(slot)
    if not slots[slot] then
      slots[slot] = true
      count = count + 1
    end
  end
  for _, serial in ipairs(redis.call('ZRANGE', P .. 'o:' .. owner, 0, -1)) do
    local slot = redis.call('HGET', P .. 'l:' .. serial, 'slot')
    if slot and string.sub(slot, 1, #prefix) == prefix then
      local l = free(serial)
      if l then
        ended(serial, l.proxy, l.target, l.exp, 1, l.granted, l.reported)
        released = released + 1
        note(slot)
      end
    end
  end
  local cursor = '0'
  repeat
    local page = redis.call('SCAN', cursor, 'MATCH', literal(P .. 's:' .. prefix) .. '*', 'COUNT', 1000)
    cursor = page[1]
    for _, key in ipairs(page[2]) do
      redis.call('DEL', key)
      note(string.sub(key, #P + 3))
    end
  until cursor == '0'
  return { count, released }
end

-- On: proxy endpoint. How many live leases on proxy were last told endpoint.
local function on()
  expire(1000)
  local count = 0
  for _, serial in ipairs(redis.call('ZRANGE', P .. 'p:' .. ARGV[3], 0, -1)) do
    if redis.call('HGET', P .. 'l:' .. serial, 'endpoint') == ARGV[4] then count = count + 1 end
  end
  return count
end

local function sweep()
  local count, batch = 0, 1
  while batch > 0 do
    batch = expire(1000)
    count = count + batch
  end
  return count
end

local operations = {
  lease = lease, renew = renew, release = release, report = report, revoke = revoke, cooldowns = cooldowns,
  proxy_cooldowns = proxy_cooldowns, restore = restore, clear = clear, loads = loads, held = held, on = on,
  expire = sweep, end_sessions = end_sessions,
}
return operations[op]()
