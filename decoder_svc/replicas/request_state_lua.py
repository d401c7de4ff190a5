"""The Lua scripts of ``decoder_svc.replicas.request_state``: each write is one script (check + write + index, atomic).

Keys (``{p}`` = the store's key prefix):

- ``{p}:request:{id}``: the request's hash (the ``RequestRecord`` fields, ``owner`` among them);
- ``{p}:owner:{replica_id}``: the owner index, a set of the ids of the replica's non-terminal requests (added by
  ``CREATE``, removed by a terminal ``SET_STATE``, dropped whole by ``FAIL_LOST_OWNER``);
- ``{p}:replica:{id}`` and ``{p}:replicas:decoder``: the replica registry's lease key and member set
  (``shared.registry``), read and cleaned by ``FAIL_LOST_OWNER``.

Some scripts touch keys built inside the script (the owner set named in a hash, each request of an owner set):
fine on one Redis server (what the services use), not on Redis Cluster.
"""

from __future__ import annotations

# KEYS[1] hash, KEYS[2] owner set; ARGV: request_id, state, model, now, owner ('' = none, no index).
# Returns 1 if created, 0 if a record exists.
CREATE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'request_id', ARGV[1], 'state', ARGV[2], 'model', ARGV[3], 'owner', ARGV[5],
  'created_at', ARGV[4], 'updated_at', ARGV[4], 'prompt_tokens', '0',
  'completion_tokens', '0', 'finish_reason', '', 'error', '')
if ARGV[5] ~= '' then redis.call('SADD', KEYS[2], ARGV[1]) end
return 1
"""

# KEYS[1] hash. ARGV: 1 new state, 2 now, 3 ttl_ms (0 = none: a non-terminal state), 4 allowed-from states
# joined by ',', 5 owner-set key prefix ('{p}:owner:'), 6 request_id, 7 upsert ('1': a missing record is
# written whole, from 8-10), 8 model, 9 owner, 10 created_at, then field/value pairs.
# Returns {code, current state}: 1 written, 2 written anew (no record: the upsert), 0 no record,
# -1 transition refused. A terminal write (ttl_ms > 0) also removes the id from its owner's set; a non-terminal
# upsert puts it back there (the lost-replica reaper finds it again).
SET_STATE_LUA = """
local cur = redis.call('HGET', KEYS[1], 'state')
local ttl = tonumber(ARGV[3])
if not cur then
  if ARGV[7] ~= '1' then return {0, ''} end
  redis.call('HSET', KEYS[1], 'request_id', ARGV[6], 'state', ARGV[1], 'model', ARGV[8], 'owner', ARGV[9],
    'created_at', ARGV[10], 'updated_at', ARGV[2], 'prompt_tokens', '0', 'completion_tokens', '0',
    'finish_reason', '', 'error', '', unpack(ARGV, 11))
  if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
  if ARGV[9] ~= '' then
    if ttl > 0 then redis.call('SREM', ARGV[5] .. ARGV[9], ARGV[6]) else redis.call('SADD', ARGV[5] .. ARGV[9], ARGV[6]) end
  end
  return {2, ''}
end
if not string.find(',' .. ARGV[4] .. ',', ',' .. cur .. ',', 1, true) then return {-1, cur} end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'updated_at', ARGV[2], unpack(ARGV, 11))
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  local owner = redis.call('HGET', KEYS[1], 'owner')
  if owner and owner ~= '' then redis.call('SREM', ARGV[5] .. owner, ARGV[6]) end
end
return {1, cur}
"""

# KEYS[1] hash. ARGV: owner-set key prefix, request_id. Returns 1 if a record was deleted.
DELETE_LUA = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= '' then redis.call('SREM', ARGV[1] .. owner, ARGV[2]) end
return redis.call('DEL', KEYS[1])
"""

# KEYS[1] the lost replica's owner set, KEYS[2] its lease key, KEYS[3] the decoder member set.
# ARGV: 1 replica id, 2 now, 3 finished ttl_ms, 4 error, 5 request key prefix ('{p}:request:'). Only records whose
# owner field names the lost replica are failed: an id planted in its set cannot fail another replica's request.
# Returns -1 (the lease exists again: nothing done), else how many requests it failed. The owner set and the
# replica's membership are removed: a second run (another replica's) finds nothing.
FAIL_LOST_OWNER_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local failed = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local key = ARGV[5] .. id
  local state, owner = unpack(redis.call('HMGET', key, 'state', 'owner'))
  if owner == ARGV[1] and (state == 'QUEUED' or state == 'ENCODING' or state == 'DECODING') then
    redis.call('HSET', key, 'state', 'FAILED', 'error', ARGV[4], 'updated_at', ARGV[2])
    redis.call('PEXPIRE', key, ARGV[3])
    failed = failed + 1
  end
end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[3], ARGV[1])
return failed
"""
