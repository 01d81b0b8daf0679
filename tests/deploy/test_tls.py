"""TLS end to end: the mesh and the CLI over ``amqps://`` and MongoDB ``tls=true``, verifying the
servers' certificates, and a wrong CA refused with a clear error instead of a reconnect loop.

Certificates are made with openssl at test time. The servers are extra ones of this test's own,
beside the shared ones: a RabbitMQ node (tests/support/rabbit_node.py) with a TLS listener that
also requires a client certificate, and a FerretDB listening with TLS on the shared PostgreSQL.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from pymongo import AsyncMongoClient
from pymongo.errors import ServerSelectionTimeoutError

from tests.support import rabbit_node
from tests.support.cli import run_yoke
from tests.support.mesh import Mesh
from tests.support.processes import eventually, free_port
from tests.support.rabbit_node import RabbitNode
from tests.support.tls_servers import Certificates, TLSFerretDB, ferretdb_binary, tls_ferretdb
from yoke.core.errors import EXIT_MISCONFIGURED, is_transient
from yoke.core.models import Message
from yoke.core.tls import verification_failure
from yoke.runtime.joins import create_forum
from yoke.store.database import Store

# Its FerretDB, a second one on the shared PostgreSQL, lists every test's database (its ping
# does) without knowing of the drops the shared one makes: one dropped meanwhile by a test
# beside it fails that listing (relation "<db>._ferretdb_database_metadata" does not exist).
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module", autouse=True)
def _prerequisites() -> None:
    """What ``make services`` installs: a missing piece fails here, by name (never a skip)."""
    rabbit_node.require()
    assert ferretdb_binary() is not None, "no FerretDB binary: run `make services` (it builds one)"
    assert shutil.which("openssl"), "no openssl: `make services` installs it"


class TLSServers:
    """The extra servers and the URLs and settings that reach them with verification."""

    def __init__(self, certificates: Certificates, rabbit: RabbitNode, amqps_port: int,
                 mongo: TLSFerretDB, database: str) -> None:  # fmt: skip
        self.certificates = certificates
        self.rabbit = rabbit
        self.amqps_url = f"amqps://guest:guest@127.0.0.1:{amqps_port}/"
        self.mongo = mongo
        self.database = database

    def env(self, *, amqp_ca: Path | None = None, mongodb_ca: Path | None = None) -> dict[str, str]:
        """A process's environment: amqps and MongoDB TLS URLs, the CA and client files as
        settings (``amqp_ca`` / ``mongodb_ca`` put another CA in their place)."""
        certificates = self.certificates
        return {
            "YOKE_AMQP_URL": self.amqps_url,
            "YOKE_AMQP_CA_FILE": str(amqp_ca or certificates.ca),
            "YOKE_AMQP_CERT_FILE": str(certificates.client_cert),
            "YOKE_AMQP_KEY_FILE": str(certificates.client_key),
            "YOKE_MONGODB_URL": self.mongo.url(self.database),
            "YOKE_MONGODB_CA_FILE": str(mongodb_ca or certificates.ca),
        }


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return Certificates.make(tmp_path_factory.mktemp("certificates"))


@pytest.fixture(scope="module")
def tls_rabbit(certificates: Certificates) -> Iterator[tuple[RabbitNode, int]]:
    """A RabbitMQ node of its own with a TLS listener that requires a client certificate."""
    port = free_port()
    tls_config = [
        f"listeners.ssl.default = 127.0.0.1:{port}",
        f"ssl_options.cacertfile = {certificates.ca}",
        f"ssl_options.certfile = {certificates.server_cert}",
        f"ssl_options.keyfile = {certificates.server_key}",
        "ssl_options.verify = verify_peer",
        "ssl_options.fail_if_no_peer_cert = true",
    ]
    with RabbitNode.temporary(f"yoke-tls-{uuid.uuid4().hex[:6]}", extra_config=tls_config) as node:
        yield node, port


@pytest.fixture(scope="module")
async def servers(
    certificates: Certificates, tls_rabbit: tuple[RabbitNode, int]
) -> AsyncIterator[TLSServers]:
    with tls_ferretdb(certificates) as mongo:
        database = f"yoke_tls_{uuid.uuid4().hex[:12]}"
        url = mongo.url(database, tlsCAFile=str(certificates.ca))
        client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(
            url, serverSelectionTimeoutMS=2000
        )

        async def answers() -> bool:
            if mongo.popen.poll() is not None:
                raise AssertionError(f"FerretDB exited:\n{mongo.output()[-3000:]}")
            try:
                await client.admin.command("ping")
                return True
            except ServerSelectionTimeoutError:
                return False

        try:
            await eventually(answers, timeout=60, what="FerretDB's TLS listener")
            yield TLSServers(certificates, tls_rabbit[0], tls_rabbit[1], mongo, database)
        finally:
            try:
                await client.drop_database(database)
            finally:
                await client.close()


async def ok(*args: str, env: dict[str, str]) -> str:
    code, out, err = await run_yoke(env, *args)
    assert code == 0, f"yoke {' '.join(args)} exited {code}: {err}"
    return out.strip().splitlines()[-1]


async def test_mesh_and_cli_answer_over_amqps_and_mongodb_tls(
    servers: TLSServers, tmp_path: Path
) -> None:
    env = servers.env()
    mesh = Mesh(env["YOKE_AMQP_URL"], env["YOKE_MONGODB_URL"], tmp_path, env)
    try:
        await mesh.start_all()
        # The CLI takes the CA from the URL instead of the setting: both ways work.
        cli_env = {
            **env,
            "YOKE_MONGODB_URL": servers.mongo.url(
                servers.database, tlsCAFile=str(servers.certificates.ca)
            ),
            "YOKE_MONGODB_CA_FILE": "",
        }
        agent = await ok("agent", "create", "--name", "echo", env=cli_env)
        forum = await ok("forum", "create", "--title", "over tls", env=cli_env)
        await ok("join", "--agent", agent, "--forum", forum, env=cli_env)
        await ok("post", "--forum", forum, "--author", "ada", "hello over tls", env=cli_env)

        answered: list[Message] = []

        async def echoed() -> bool:
            nonlocal answered
            _, out, _ = await run_yoke(cli_env, "history", forum, "--json")
            answered = [Message.model_validate_json(line) for line in out.splitlines() if line]
            return any(line.role == "agent" for line in answered)

        await eventually(echoed, timeout=90, interval=1, what="the agent's answer over TLS")
        lines = [(line.role, line.text) for line in answered]
        assert lines == [("user", "hello over tls"), ("agent", "hello over tls")], lines

        # Every service's broker connection is TLS, with this client's certificate.
        connections = servers.rabbit.api("GET", "/api/connections")
        by_name = {
            (entry.get("client_properties") or {}).get("connection_name"): entry
            for entry in connections
        }
        for name in mesh.processes:
            assert name in by_name, sorted(str(key) for key in by_name)
            assert by_name[name]["ssl"] is True, by_name[name]
            assert by_name[name].get("peer_cert_subject") == "CN=client", by_name[name]
    finally:
        codes = mesh.stop_all()
    assert all(code == 0 for code in codes.values()), codes


@pytest.mark.parametrize("server", ["RabbitMQ", "MongoDB"])
async def test_a_service_given_the_wrong_ca_exits_with_a_clear_error(
    servers: TLSServers, server: str, tmp_path: Path
) -> None:
    other = servers.certificates.other_ca
    env = servers.env(**({"amqp_ca": other} if server == "RabbitMQ" else {"mongodb_ca": other}))
    mesh = Mesh(env["YOKE_AMQP_URL"], env["YOKE_MONGODB_URL"], tmp_path, env)
    process = mesh.start("ingestion")
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while process.popen.poll() is None:
            assert loop.time() < deadline, f"still running after 60 s:\n{process.output()[-2000:]}"
            await asyncio.sleep(0.2)
        output = process.output()
        assert process.popen.returncode == EXIT_MISCONFIGURED, output[-3000:]
        setting = "YOKE_AMQP_CA_FILE" if server == "RabbitMQ" else "YOKE_MONGODB_CA_FILE"
        assert f"TLS verification of {server}'s certificate failed" in output, output[-3000:]
        assert setting in output, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    finally:
        process.stop()


@pytest.mark.parametrize("server", ["RabbitMQ", "MongoDB"])
async def test_the_cli_given_the_wrong_ca_says_so_and_exits_78(
    servers: TLSServers, server: str
) -> None:
    other = servers.certificates.other_ca
    command: tuple[str, ...]
    if server == "RabbitMQ":
        env = servers.env(amqp_ca=other)
        command = ("post", "--forum", "f-any", "--author", "ada", "--timeout", "5", "hello")
    else:
        env = servers.env(mongodb_ca=other)
        command = ("forum", "create", "--title", "never")
    code, out, err = await run_yoke(env, *command)
    assert code == EXIT_MISCONFIGURED, err
    # Its last line says what failed and what to set (the client library may log before it).
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"yoke: TLS verification of {server}'s certificate failed ("), err
    assert ("YOKE_AMQP_CA_FILE" if server == "RabbitMQ" else "YOKE_MONGODB_CA_FILE") in last
    assert "Traceback" not in err, err
    assert out == ""


async def test_an_unreachable_server_is_not_taken_for_a_certificate_refusal() -> None:
    """Only certificate refusals are misconfigurations: a server that is away stays transient
    (retried for as long as it lasts)."""
    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(
        f"mongodb://127.0.0.1:{free_port()}/x?tls=true", serverSelectionTimeoutMS=300
    )
    try:
        with pytest.raises(ServerSelectionTimeoutError) as caught:
            await client.admin.command("ping")
    finally:
        await client.close()
    assert verification_failure(caught.value) is None
    assert is_transient(caught.value)


async def test_mongodb_client_certificate_from_the_settings(
    certificates: Certificates, monkeypatch: pytest.MonkeyPatch
) -> None:
    """YOKE_MONGODB_CERT_FILE is presented to a server that requires client certificates.

    (A refusal of a missing client certificate is not asserted: under TLS 1.3 it arrives after
    the handshake and often only as a closed connection, which looks like any other outage.)
    """
    with tls_ferretdb(certificates, client_ca=True) as mongo:
        url = mongo.url(f"yoke_tls_{uuid.uuid4().hex[:12]}")
        anonymous: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(
            url, tlsCAFile=str(certificates.ca), serverSelectionTimeoutMS=2000
        )
        monkeypatch.setenv("YOKE_MONGODB_CA_FILE", str(certificates.ca))
        monkeypatch.setenv("YOKE_MONGODB_CERT_FILE", str(certificates.client_bundle))
        store = Store(url)

        async def answers() -> bool:
            if mongo.popen.poll() is not None:
                raise AssertionError(f"FerretDB exited:\n{mongo.output()[-3000:]}")
            try:
                async with asyncio.timeout(3):
                    await store.ping()
                return True
            except (TimeoutError, ServerSelectionTimeoutError):
                return False

        try:
            await eventually(answers, timeout=60, what="FerretDB's TLS listener")
            forum = await create_forum(store, "mutual tls")
            assert (await store.get_conversation(forum.id)) is not None
            with pytest.raises(ServerSelectionTimeoutError):  # the server does require one
                await anonymous.admin.command("ping")
            await store.client.drop_database(store.db.name)
        finally:
            await store.close()
            await anonymous.close()


@pytest.mark.parametrize(
    ("setting", "command"),
    [
        ("YOKE_AMQP_CA_FILE", ("post", "--forum", "f-any", "--author", "ada", "hello")),
        ("YOKE_MONGODB_CA_FILE", ("forum", "create", "--title", "never")),
    ],
)
async def test_an_unreadable_ca_file_is_refused_naming_the_setting(
    servers: TLSServers, tmp_path: Path, setting: str, command: tuple[str, ...]
) -> None:
    missing = tmp_path / "no-such-ca.pem"
    code, _, err = await run_yoke({**servers.env(), setting: str(missing)}, *command)
    assert code == EXIT_MISCONFIGURED, err
    last = err.strip().splitlines()[-1]
    assert last == f"yoke: {setting} {missing}: No such file or directory", err
