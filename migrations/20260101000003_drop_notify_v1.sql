-- The notification triggers are no longer part of the schema: the gateway
-- (database.install_triggers) or `bloomgate install-triggers` generates one
-- function per table with every watched key column written in (see
-- src/db/triggers.rs). This drops the first version: the generic
-- `bloomgate_notify(key_column [, table])`, which serialised the whole row
-- with to_jsonb and announced one key column per table, and every trigger
-- that calls it (the demo tables', and those `install-triggers` created).
-- Run `bloomgate install-triggers` (or start with install_triggers = true)
-- after this migration, or key changes are seen only at rebuilds.
DO $$
DECLARE
    t record;
BEGIN
    FOR t IN
        SELECT tg.tgname, tg.tgrelid::regclass AS rel
          FROM pg_trigger tg
          JOIN pg_proc p ON p.oid = tg.tgfoid
          JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE p.proname = 'bloomgate_notify' AND NOT tg.tgisinternal
    LOOP
        EXECUTE format('DROP TRIGGER %I ON %s', t.tgname, t.rel);
    END LOOP;
END
$$;
DROP FUNCTION IF EXISTS bloomgate_notify();
