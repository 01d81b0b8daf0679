// Loaded before each /docker-entrypoint-initdb.d script: FerretDB 1.x refuses createUser with
// roles (it enforces no roles at all), so the user is made with none and the roles are dropped.
Object.getPrototypeOf(db).createUser = function createUser(user) {
  return this.runCommand({ createUser: user.user, pwd: user.pwd, roles: [] });
};
// Nor has it createRole: the role is not made (a role's privileges cannot be checked here;
// tests/test_compose_config.py reads them from deploy/mongodb/init-yoke-user.js).
Object.getPrototypeOf(db).createRole = function createRole() {
  return { ok: 1 };
};
