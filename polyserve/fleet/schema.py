"""The fleet's PostgreSQL schema, as numbered migrations each host applies at start."""

from __future__ import annotations

import psycopg

# One lock for schema changes, one for the change log: pg_advisory_xact_lock keys.
MIGRATION_LOCK = 0x706F6C79_0001
CHANGE_LOCK = 0x706F6C79_0002

# Append only: a migration, once released, never changes. Each runs in one transaction.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE polyserve_spaces (
        name text PRIMARY KEY,
        last_version integer NOT NULL DEFAULT 0,  -- numbers handed out, never reused
        current_version integer                   -- NULL: not deployed (deleted)
    );
    CREATE TABLE polyserve_versions (
        space text NOT NULL REFERENCES polyserve_spaces (name),
        number integer NOT NULL,
        sha256 text NOT NULL,
        meta jsonb NOT NULL,                      -- what the deploy answered, and more
        data bytea NOT NULL,                      -- the upload, as it was sent
        PRIMARY KEY (space, number)
    );
    -- Every change to a space, in the order hosts must apply it: ids are assigned under
    -- CHANGE_LOCK, so they are committed in order and a follower never skips one.
    CREATE TABLE polyserve_changes (
        id bigint PRIMARY KEY,
        space text NOT NULL,
        kind text NOT NULL CHECK (kind IN ('deploy', 'delete', 'release')),
        version integer,
        at timestamptz NOT NULL DEFAULT now()
    );
    CREATE TABLE polyserve_hosts (
        id text PRIMARY KEY,
        url text NOT NULL,
        pool text NOT NULL,
        boot text NOT NULL,
        started_at timestamptz NOT NULL,
        last_seen timestamptz NOT NULL,
        workers integer NOT NULL DEFAULT 0,
        applied bigint NOT NULL DEFAULT 0,        -- the last change this host applied
        left_at timestamptz                       -- set by a graceful stop
    );
    -- Absolute totals per (host, boot): a retried write never double-counts, a restart
    -- starts a new row instead of resetting one.
    CREATE TABLE polyserve_usage (
        host text NOT NULL,
        boot text NOT NULL,
        space text NOT NULL,
        requests bigint NOT NULL,
        errors bigint NOT NULL,
        busy_us bigint NOT NULL,
        resident_us bigint NOT NULL,
        loads bigint NOT NULL,
        import_us bigint NOT NULL,
        updated_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (host, boot, space)
    );
    """,
    # The autoscaler: a host it is taking out of the fleet (no deploy waits for it, its
    # load balancer drops it), and requests for a pool's spaces that found no host of
    # that pool (the demand that brings a pool up from zero).
    """
    ALTER TABLE polyserve_hosts ADD COLUMN draining_at timestamptz;
    CREATE TABLE polyserve_demand (
        pool text NOT NULL,
        space text NOT NULL,
        requests bigint NOT NULL,
        last_at timestamptz NOT NULL,
        PRIMARY KEY (pool, space)
    );
    """,
    # The ledger's fence (docs/fleet.md, "Usage, billed once"): the data directory a
    # host's current boot runs on, and the totals that boot's rows leave out. A new boot
    # of the same directory starts billing where the boot it replaces stopped.
    """
    ALTER TABLE polyserve_hosts ADD COLUMN lineage text, ADD COLUMN baseline jsonb;
    """,
    # Applying safely (docs/fleet.md): each host's limits, so a deploy some live host
    # cannot take is refused before it is committed; each change's token, so a host
    # tells a database that went back in time (a restore, a failover to a lagging
    # replica) from the one whose changes it applied; the changes a host skipped, for
    # the deploy's answer and the operator; uploads stored uncompressed, so a host
    # reads one in slices without the server inflating it from the start each time.
    """
    ALTER TABLE polyserve_hosts ADD COLUMN max_spaces integer,
        ADD COLUMN max_upload_mb integer, ADD COLUMN max_unpacked_mb integer;
    ALTER TABLE polyserve_changes ADD COLUMN token uuid NOT NULL DEFAULT gen_random_uuid();
    ALTER TABLE polyserve_versions ALTER COLUMN data SET STORAGE EXTERNAL;
    CREATE TABLE polyserve_skipped (
        host text NOT NULL,
        space text NOT NULL,
        change_id bigint NOT NULL,                -- the change this host did not apply
        version integer,
        error text NOT NULL,
        at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (host, space)                 -- cleared by its next change applied
    );
    """,
    # What each host's workers hold now, written with its usage: the fleet usage's
    # `loaded` and `workers_loaded`, counted over the hosts whose boot is live.
    """
    CREATE TABLE polyserve_loaded (
        host text NOT NULL,
        boot text NOT NULL,
        space text NOT NULL,
        workers integer NOT NULL,
        PRIMARY KEY (host, space)
    );
    """,
    # Private spaces and secrets (docs/private-spaces.md, docs/secrets.md): one row of
    # access per space (its keys as digests, never the keys), one row per secret, and
    # the change kinds that tell every host to apply them.
    """
    CREATE TABLE polyserve_access (
        space text PRIMARY KEY,
        private boolean NOT NULL DEFAULT false,
        keys jsonb NOT NULL DEFAULT '[]'          -- [{id, sha256, rate, created}]
    );
    CREATE TABLE polyserve_secrets (
        space text NOT NULL,
        name text NOT NULL,
        value bytea NOT NULL,
        updated_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (space, name)
    );
    ALTER TABLE polyserve_changes DROP CONSTRAINT polyserve_changes_kind_check;
    ALTER TABLE polyserve_changes ADD CONSTRAINT polyserve_changes_kind_check
        CHECK (kind IN ('deploy', 'delete', 'release', 'access', 'secrets'));
    """,
    # Rollouts (docs/rollouts.md): one state per space, the counts each host reports for
    # its step, and the change kind that tells every host to apply a state (and to keep
    # a version deployed with current=false).
    """
    CREATE TABLE polyserve_rollouts (
        space text PRIMARY KEY,
        state jsonb NOT NULL,
        updated_at timestamptz NOT NULL DEFAULT now()
    );
    CREATE TABLE polyserve_rollout_counts (
        space text NOT NULL,
        host text NOT NULL,
        started_at float8 NOT NULL,             -- which rollout of the space
        step integer NOT NULL,
        counts jsonb NOT NULL,                  -- _step's: new and old requests, errors
        PRIMARY KEY (space, host, started_at, step)
    );
    ALTER TABLE polyserve_changes DROP CONSTRAINT polyserve_changes_kind_check;
    ALTER TABLE polyserve_changes ADD CONSTRAINT polyserve_changes_kind_check
        CHECK (kind IN ('deploy', 'delete', 'release', 'access', 'secrets', 'rollout'));
    """,
)


def migrate(conn: psycopg.Connection) -> int:
    """Bring the schema up to date; safe when several hosts start at once. Returns the
    schema version."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS polyserve_migrations"
            " (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        row = conn.execute("SELECT coalesce(max(version), 0) FROM polyserve_migrations").fetchone()
        done = row[0] if row else 0
        for version, sql in enumerate(MIGRATIONS[done:], start=done + 1):
            conn.execute(sql.encode())
            conn.execute("INSERT INTO polyserve_migrations (version) VALUES (%s)", (version,))
    return len(MIGRATIONS)
