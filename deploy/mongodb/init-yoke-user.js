// Run by the mongo image on a first start (empty data volume), as root: the services' user and
// the HTTP gateway's, each with a password from .env (make env). The objects below are JSON
// literals on purpose: tests/test_compose_config.py reads them, since FerretDB (the MongoDB-wire
// server of make test and make compose-check) enforces no roles and cannot check them live.
const passwords = {
  yoke: process.env.YOKE_MONGODB_PASSWORD,
  "yoke-gateway": process.env.YOKE_MONGODB_GATEWAY_PASSWORD,
};
for (const [user, password] of Object.entries(passwords)) {
  if (!password) {
    throw new Error(`no password for MongoDB's ${user} user: run \`make env\` (it writes .env)`);
  }
}

// The services: readWrite on the yoke database only.
const services = {
  "user": "yoke",
  "roles": [{ "role": "readWrite", "db": "yoke" }]
};

// The gateway reads what it shows (lines, forums, tokens, calls) and writes only bookkeeping:
// its webhook worker's, its retention sweep's progress, the console's forum list (positions
// of forums made before it), the MCP door's owed answers (calls that ran out of time) and the
// A2A door's tasks and push configs (a push's cursor is removed once its task's end is
// delivered); it inserts into the token's line count (line_limits: an MCP call that collects
// an owed answer sends no line, yet counts as one; the count's slots are never updated); it creates collections and indexes because it starts before or without the
// services (Store.ensure_indexes). It cannot write a line, an actor, a token or a call.
const gatewayRole = {
  "role": "yokeGateway",
  "privileges": [
    {
      "resource": { "db": "yoke", "collection": "" },
      "actions": ["find", "listCollections", "listIndexes", "createCollection", "createIndex", "dropIndex"]
    },
    {
      "resource": { "db": "yoke", "collection": "webhook_cursors" },
      "actions": ["find", "insert", "update", "remove"]
    },
    {
      "resource": { "db": "yoke", "collection": "webhook_leases" },
      "actions": ["find", "insert", "update", "remove"]
    },
    {
      "resource": { "db": "yoke", "collection": "webhook_dead_letters" },
      "actions": ["find", "insert", "update", "remove"]
    },
    {
      "resource": { "db": "yoke", "collection": "retention" },
      "actions": ["find", "insert", "update"]
    },
    {
      "resource": { "db": "yoke", "collection": "forum_list" },
      "actions": ["find", "insert"]
    },
    {
      "resource": { "db": "yoke", "collection": "mcp_owed_answers" },
      "actions": ["find", "insert", "update", "remove"]
    },
    {
      "resource": { "db": "yoke", "collection": "line_limits" },
      "actions": ["find", "insert"]
    },
    {
      "resource": { "db": "yoke", "collection": "a2a_tasks" },
      "actions": ["find", "insert", "update", "remove"]
    },
    {
      "resource": { "db": "yoke", "collection": "a2a_push_configs" },
      "actions": ["find", "insert", "update", "remove"]
    }
  ],
  "roles": []
};

const gateway = {
  "user": "yoke-gateway",
  "roles": [{ "role": "yokeGateway", "db": "yoke" }]
};

// Idempotent, so that a data volume made by an earlier version gets the gateway's user by
// running this script again (README, "With Docker"); what exists already is left as it is.
const ALREADY_EXISTS = new Set([51002, 51003]); // RoleAlreadyExists, UserAlreadyExists
function unlessPresent(create) {
  try {
    create();
  } catch (error) {
    if (!ALREADY_EXISTS.has(error.code)) {
      throw error;
    }
  }
}
const yoke = db.getSiblingDB("yoke");
unlessPresent(() => yoke.createRole(gatewayRole));
for (const user of [services, gateway]) {
  unlessPresent(() => yoke.createUser({ ...user, pwd: passwords[user.user] }));
}
