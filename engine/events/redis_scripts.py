"""The Lua scripts behind the log's atomic steps on Redis, each on one cluster slot.

They are registered (sent by SHA); ``APPEND`` goes by EVAL inside a pipeline, where there
is nothing to load first.
"""

__all__ = ["APPEND", "CAS", "DEAD_LETTER", "HAND_BACK", "KEEP_ALIVE", "ONCE"]

# KEYS[1] guarded stream, KEYS[2..] streams of the follow-up appends; ARGV[1] expected last
# id, ARGV[2] n guarded events, ARGV[3..] encoded guarded events then follow-up events (one
# per extra key, in order).
CAS = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local cur = '0-0'
if #last > 0 then cur = last[1][1] end
if cur ~= ARGV[1] then return {0, cur} end
local n = tonumber(ARGV[2])
local out = {1}
for i = 1, n do
  out[#out + 1] = redis.call('XADD', KEYS[1], '*', 'e', ARGV[2 + i])
end
for k = 2, #KEYS do
  out[#out + 1] = redis.call('XADD', KEYS[k], '*', 'e', ARGV[1 + n + k])
end
return out
"""


# KEYS[1] stream; ARGV[1] group, ARGV[2] consumer, ARGV[3..] entry ids. Refreshes (XCLAIM
# JUSTID, which does not count a delivery) only the entries the consumer still owns.
KEEP_ALIVE = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p > 0 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""


# KEYS[1] stream; ARGV[1] group, ARGV[2] consumer, ARGV[3] idle ms, ARGV[4..] entry ids.
# Each entry the consumer still owns is made idle (claimable at once), its delivery taken back.
HAND_BACK = """
local lost = {}
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p > 0 and p[1][2] == ARGV[2] then
    local times = tonumber(p[1][4])
    if times > 0 then times = times - 1 end
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i],
               'IDLE', ARGV[3], 'RETRYCOUNT', times, 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""

# KEYS[1] stream; ARGV[1..] encoded events, appended in order; returns their ids. One
# command per run of events, where a pipelined XADD per event costs the client far more.
APPEND = """
local out = {}
for i = 1, #ARGV do
  out[i] = redis.call('XADD', KEYS[1], '*', 'e', ARGV[i])
end
return out
"""

# KEYS[1] the dead-letter stream, KEYS[2] the set of entries already dead-lettered; ARGV in
# pairs ("stream@id", encoded DeadLetter). Appends the letters not yet in the set; how many.
DEAD_LETTER = """
local n = 0
for i = 1, #ARGV, 2 do
  if redis.call('SADD', KEYS[2], ARGV[i]) == 1 then
    redis.call('XADD', KEYS[1], '*', 'e', ARGV[i + 1])
    n = n + 1
  end
end
return n
"""

# KEYS[1] stream, KEYS[2] marker; ARGV[1] marker ttl (s), ARGV[2] the encoded event.
ONCE = """
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[1]) then
  return redis.call('XADD', KEYS[1], '*', 'e', ARGV[2])
end
return false
"""
