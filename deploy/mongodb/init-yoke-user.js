// Run by the mongo image on a first start (empty data volume), as root: the services' user,
// readWrite on the yoke database only, its password from YOKE_MONGODB_PASSWORD (.env).
const password = process.env.YOKE_MONGODB_PASSWORD;
if (!password) {
  throw new Error("YOKE_MONGODB_PASSWORD is not set: run `make env` (it writes .env)");
}
db.getSiblingDB("yoke").createUser({
  user: "yoke",
  pwd: password,
  roles: [{ role: "readWrite", db: "yoke" }],
});
