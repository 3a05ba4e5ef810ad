-- Announce key changes of the demo tables (see bloomgate_notify).
CREATE OR REPLACE TRIGGER bloomgate_notify
    AFTER INSERT OR UPDATE OR DELETE ON users
    FOR EACH ROW EXECUTE FUNCTION bloomgate_notify('id');
CREATE OR REPLACE TRIGGER bloomgate_notify_truncate
    AFTER TRUNCATE ON users
    FOR EACH STATEMENT EXECUTE FUNCTION bloomgate_notify('id');

CREATE OR REPLACE TRIGGER bloomgate_notify
    AFTER INSERT OR UPDATE OR DELETE ON articles
    FOR EACH ROW EXECUTE FUNCTION bloomgate_notify('id');
CREATE OR REPLACE TRIGGER bloomgate_notify_truncate
    AFTER TRUNCATE ON articles
    FOR EACH STATEMENT EXECUTE FUNCTION bloomgate_notify('id');
