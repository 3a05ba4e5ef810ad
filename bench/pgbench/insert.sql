-- One single-row insert per transaction (a new, unique email each time).
INSERT INTO tc_users (email, name) VALUES (md5(random()::text || clock_timestamp()::text), 'bench');
