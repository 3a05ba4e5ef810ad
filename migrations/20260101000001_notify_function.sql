-- bloomgate_notify(key_column [, announced_table]): a row trigger that
-- announces every change of a key on the channel `bloomgate`, so each gateway
-- adds new keys to its filter and drops stale cache entries within
-- milliseconds of the commit (notifications are delivered at commit).
--
-- Payload (JSON): {"table": ..., "op": "INSERT"|"UPDATE"|"DELETE"|"TRUNCATE"|"RESCAN",
--                  "key": ..., "old_key": ..., "ts": <epoch seconds>}
-- `table` is schema.table, or the second trigger argument when given: put the
-- trigger on the base table of a view and name the view the resource serves.
-- A key too long for a notification (which must stay under 8000 bytes) is
-- announced as RESCAN, which makes the gateways rebuild, rather than failing
-- the writer's transaction.
--
-- `bloomgate install-triggers` runs this file too, for tables the
-- migrations do not know.
CREATE OR REPLACE FUNCTION bloomgate_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    tbl text := coalesce(TG_ARGV[1], TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME);
    new_key text;
    old_key text;
    op text := TG_OP;
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        PERFORM pg_notify('bloomgate', json_build_object(
            'table', tbl, 'op', op, 'ts', extract(epoch FROM clock_timestamp()))::text);
        RETURN NULL;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        new_key := to_jsonb(NEW) ->> TG_ARGV[0];
    END IF;
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        old_key := to_jsonb(OLD) ->> TG_ARGV[0];
    END IF;
    IF octet_length(coalesce(new_key, '')) + octet_length(coalesce(old_key, '')) > 7000 THEN
        op := 'RESCAN';
        new_key := NULL;
        old_key := NULL;
    END IF;
    PERFORM pg_notify('bloomgate', json_build_object(
        'table', tbl, 'op', op, 'key', new_key, 'old_key', old_key,
        'ts', extract(epoch FROM clock_timestamp()))::text);
    RETURN NULL;
END
$$;
