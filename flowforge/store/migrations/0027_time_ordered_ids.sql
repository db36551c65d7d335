-- New ids made by the database are time-ordered, as the ones the store makes in Python
-- (flowforge/domain/ids.py; issue 22, "Scale of what is stored"; docs/performance.md
-- "Time-ordered ids").
--
-- A random UUID (gen_random_uuid, version 4) puts each new row on a random leaf page of every
-- index keyed by it; once those indexes outgrow shared_buffers, each insert reads and dirties a
-- page nobody touched lately. A version-7 UUID (RFC 9562 section 5.7) begins with the Unix time
-- in milliseconds, so new rows gather at the right edge of each such index. Only a map's items
-- are given ids here (settle of a map: expand_maps); runs and other tasks get theirs from
-- domain/ids.py. PostgreSQL 18 has uuidv7(); this one works from 13 on: the random UUID's first
-- 48 bits replaced by the millisecond clock, its version nibble turned from 4 (0100) into 7
-- (0111) by setting two bits. The variant bits are gen_random_uuid's already.
CREATE FUNCTION flowforge_new_id() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
    SELECT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp())
                                                     * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::uuid
$$;
