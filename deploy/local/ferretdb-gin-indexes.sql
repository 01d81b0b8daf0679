-- FerretDB 1.x builds a btree index on (_jsonb -> 'field') for every index a client declares,
-- but translates an equality filter into (_jsonb -> 'field') @> value, which a btree cannot
-- answer: every query becomes a sequential scan of the whole collection (FerretDB issue 4646).
-- A GIN index over the same expressions answers @>. This event trigger gives every index
-- FerretDB creates such a twin, so an equality query reads only the rows it returns, as it
-- would on MongoDB. Idempotent: run it before FerretDB starts (its sessions read the database
-- setting below when they connect); it also backfills existing indexes.

-- FerretDB sends its filters as prepared statements with the field name as a parameter
-- (_jsonb->$1 @> $2). After five runs PostgreSQL may settle on a generic plan, which cannot
-- know the field and so can use no expression index: a sequential scan again. Custom plans,
-- made with the values at hand, keep every run on the index.
ALTER DATABASE ferretdb SET plan_cache_mode = force_custom_plan;

CREATE OR REPLACE FUNCTION yoke_gin_twin(index_oid oid) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    definition text := pg_get_indexdef(index_oid);
    expressions text;
    twin text;
    target regclass;
BEGIN
    IF definition NOT LIKE '% USING btree (%_jsonb -> %' THEN
        RETURN;
    END IF;
    expressions := substring(definition FROM 'USING btree \((.*)\)$');
    expressions := regexp_replace(expressions, ' (ASC|DESC)', '', 'g');
    expressions := regexp_replace(expressions, ' NULLS (FIRST|LAST)', '', 'g');
    SELECT indrelid::regclass INTO target FROM pg_index WHERE indexrelid = index_oid;
    SELECT left(relname, 58) || '_gin' INTO twin FROM pg_class WHERE oid = index_oid;
    EXECUTE format(
        'CREATE INDEX IF NOT EXISTS %I ON %s USING gin (%s)',
        twin, target, expressions
    );
END $$;

CREATE OR REPLACE FUNCTION yoke_gin_twins_on_create() RETURNS event_trigger
LANGUAGE plpgsql AS $$
DECLARE
    command record;
BEGIN
    FOR command IN
        SELECT objid FROM pg_event_trigger_ddl_commands()
        WHERE command_tag = 'CREATE INDEX' AND object_type = 'index'
    LOOP
        PERFORM yoke_gin_twin(command.objid);
    END LOOP;
END $$;

DROP EVENT TRIGGER IF EXISTS yoke_gin_twins;
CREATE EVENT TRIGGER yoke_gin_twins ON ddl_command_end
    WHEN TAG IN ('CREATE INDEX')
    EXECUTE FUNCTION yoke_gin_twins_on_create();

-- Backfill: indexes FerretDB created before the trigger existed.
DO $$
DECLARE
    existing record;
BEGIN
    FOR existing IN
        SELECT i.indexrelid
        FROM pg_index i
        JOIN pg_class c ON c.oid = i.indexrelid
        JOIN pg_am am ON am.oid = c.relam
        WHERE am.amname = 'btree'
          AND pg_get_indexdef(i.indexrelid) LIKE '%_jsonb -> %'
          AND NOT EXISTS (
              SELECT 1 FROM pg_class twin
              WHERE twin.relname = left(c.relname, 58) || '_gin'
                AND twin.relnamespace = c.relnamespace
          )
    LOOP
        PERFORM yoke_gin_twin(existing.indexrelid);
    END LOOP;
END $$;
