#!/bin/sh
# mongosh as the official image has it on PATH: the npm package, on the Node.js beside it.
exec /usr/local/bin/node /opt/mongosh/node_modules/mongosh/bin/mongosh.js "$@"
