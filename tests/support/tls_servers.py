"""TLS for tests: certificates made with openssl at test time, and a FerretDB of its own
listening with TLS beside the shared one (same PostgreSQL, other ports and state directory).

The shared FerretDB on 27017 is never touched; the one started here is killed on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.processes import ROOT, free_port

# What deploy/local/services.sh gives the shared FerretDB when nothing better is known.
DEFAULT_POSTGRESQL_URL = "postgres://ferretdb:ferretdb@127.0.0.1:5432/ferretdb"


def _openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run(
        ["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True, timeout=60
    )


@dataclass(frozen=True)
class Certificates:
    """PEM files: a CA, a server certificate it signed for 127.0.0.1 and localhost, a client
    certificate it signed, and a second CA that signed nothing here (the wrong one)."""

    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    @property
    def other_ca(self) -> Path:
        return self.dir / "other-ca.pem"

    @property
    def server_cert(self) -> Path:
        return self.dir / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.dir / "server.key"

    @property
    def client_cert(self) -> Path:
        return self.dir / "client.pem"

    @property
    def client_key(self) -> Path:
        return self.dir / "client.key"

    @property
    def client_bundle(self) -> Path:
        """The client's certificate and key in one file, as pymongo takes it."""
        return self.dir / "client-bundle.pem"

    @classmethod
    def make(cls, where: Path) -> Certificates:
        where.mkdir(parents=True, exist_ok=True)
        key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
        for name, subject in (("ca", "yoke test CA"), ("other-ca", "unrelated test CA")):
            _openssl(
                "req", "-x509", *key, "-days", "2", "-subj", f"/CN={subject}",
                "-keyout", f"{name}.key", "-out", f"{name}.pem",
                "-addext", "basicConstraints=critical,CA:TRUE",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign",
                cwd=where,
            )  # fmt: skip
        for name, usage, names in (
            ("server", "serverAuth", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
            ("client", "clientAuth", "subjectAltName=DNS:yoke-client"),
        ):
            (where / f"{name}.ext").write_text(
                f"{names}\nextendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n"
                "keyUsage=critical,digitalSignature,keyEncipherment\n"
                "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
            )
            _openssl(
                "req", "-new", *key, "-subj", f"/CN={name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr",
                cwd=where,
            )  # fmt: skip
            _openssl(
                "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem",
                cwd=where,
            )  # fmt: skip
        certificates = cls(where)
        certificates.client_bundle.write_text(
            certificates.client_cert.read_text() + certificates.client_key.read_text()
        )
        for path in where.iterdir():  # the RabbitMQ node may run as another user
            path.chmod(0o644)
        return certificates


def running_ferretdb() -> list[bytes]:
    """The command line of the FerretDB serving this machine (empty when none runs): the one
    ``make services`` started here, or in another checkout of the project."""
    candidates: list[Path] = []
    with contextlib.suppress(OSError, ValueError):
        candidates.append(Path(f"/proc/{int((ROOT / '.local' / 'ferretdb.pid').read_text())}"))
    candidates.extend(Path("/proc").glob("[0-9]*"))
    for process in candidates:
        with contextlib.suppress(OSError):
            arguments = (process / "cmdline").read_bytes().split(b"\0")
            if arguments and Path(arguments[0].decode(errors="replace")).name == "ferretdb":
                return arguments
    return []


def ferretdb_binary() -> Path | None:
    """The FerretDB ``make services`` built (the running one's, or one on PATH), None when
    there is none."""
    built = ROOT / ".local" / "bin" / "ferretdb"
    if built.is_file():
        return built
    if (arguments := running_ferretdb()) and Path(arguments[0].decode()).is_file():
        return Path(arguments[0].decode())
    found = shutil.which("ferretdb")
    return Path(found) if found else None


def postgresql_url() -> str:
    """The PostgreSQL URL (no query) the shared FerretDB runs on: from its command line, else
    from what ``make services`` gives it (deploy/local/services.sh)."""
    if url := os.environ.get("YOKE_TEST_FERRETDB_POSTGRESQL_URL"):
        return url.split("?")[0]
    for argument in running_ferretdb():
        if argument.startswith(b"--postgresql-url="):
            return argument.split(b"=", 1)[1].decode().split("?")[0]
    password_file = ROOT / ".local" / "postgresql-ferretdb.password"  # make services keeps it
    if password_file.is_file():
        password = password_file.read_text().strip()
        return DEFAULT_POSTGRESQL_URL.replace(":ferretdb@", f":{password}@")
    return DEFAULT_POSTGRESQL_URL


@dataclass
class TLSFerretDB:
    """A running FerretDB whose only client port is TLS (``port``)."""

    port: int
    popen: subprocess.Popen[bytes]
    log_path: Path

    def url(self, database: str, **query: str) -> str:
        params = "&".join(f"{key}={value}" for key, value in {"tls": "true", **query}.items())
        return f"mongodb://127.0.0.1:{self.port}/{database}?{params}"

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def tls_ferretdb(certificates: Certificates, *, client_ca: bool = False) -> Iterator[TLSFerretDB]:
    """FerretDB on a free port with TLS only (``client_ca``: it requires client certificates
    signed by the CA). Killed and its state directory removed on exit."""
    binary = ferretdb_binary()
    if binary is None:
        raise FileNotFoundError("no FerretDB binary: run 'make services'")
    state = Path(tempfile.mkdtemp(prefix="yoke-ferretdb-tls-"))
    port = free_port()
    log_path = state / "ferretdb.log"
    pg_url = postgresql_url() + "?pool_max_conns=20"
    arguments = [
        str(binary),
        "--handler=postgresql",
        f"--postgresql-url={pg_url}",
        f"--listen-addr=127.0.0.1:{free_port()}",
        f"--listen-tls=127.0.0.1:{port}",
        f"--listen-tls-cert-file={certificates.server_cert}",
        f"--listen-tls-key-file={certificates.server_key}",
        "--telemetry=disable",
        "--log-level=warn",
        f"--state-dir={state}",
        "--debug-addr=-",
    ]
    if client_ca:
        arguments.append(f"--listen-tls-ca-file={certificates.ca}")
    with log_path.open("ab") as log:
        popen = subprocess.Popen(arguments, stdout=log, stderr=log)
    try:
        yield TLSFerretDB(port, popen, log_path)
    finally:
        popen.kill()
        popen.wait(10)
        shutil.rmtree(state, ignore_errors=True)
