"""HTTPS deliveries: the connection goes to a checked address, and the
certificate is verified for the URL's host name (not for the address)."""

from __future__ import annotations

import datetime
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from engine.webhooks import delivery
from jobs import transitions
from jobs.models import WebhookAttempt, WebhookEvent
from tests.support.factories import T0, claim, make_batch, make_endpoint
from tests.support.receiver import Receiver

pytestmark = pytest.mark.django_db


def _certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for "localhost" (written as PEM files)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture
def tls_receiver(tmp_path, settings) -> Iterator[tuple[Receiver, Path]]:
    settings.RECALL_WEBHOOK_ALLOW_PRIVATE = True
    cert, key = _certificate(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    receiver = Receiver(tls=context)
    yield receiver, cert
    receiver.close()


def _finish(worker) -> WebhookEvent:
    make_batch(1)
    job = claim(worker)
    transitions.complete(
        job, job.lease_token, worker=worker, result={"text": "x"}, now=T0
    )
    return WebhookEvent.objects.get()


def test_an_untrusted_certificate_is_refused(worker, tls_receiver):
    receiver, _ = tls_receiver
    make_endpoint(receiver.url)
    _finish(worker)

    assert delivery.deliver(now=T0).retrying == 1

    assert receiver.received == []
    assert "CERTIFICATE_VERIFY_FAILED" in WebhookAttempt.objects.get().error


def test_a_trusted_certificate_for_the_host_name_is_delivered_to(
    worker, tls_receiver, monkeypatch
):
    receiver, cert = tls_receiver
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trust it, as a CA would be
    make_endpoint(receiver.url)
    event = _finish(worker)

    assert delivery.deliver(now=T0).delivered == 1

    [request] = receiver.received
    assert request.headers["webhook-id"] == event.webhook_id
    assert request.headers["host"] == f"localhost:{receiver.server.server_address[1]}"
