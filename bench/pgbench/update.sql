-- Update a non-key column of a row holding 100 kB of text.
\set id random(1, 1000)
UPDATE tc_docs SET n = n + 1 WHERE id = :id;
