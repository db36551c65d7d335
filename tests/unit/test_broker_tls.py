"""TLS to RabbitMQ without a broker: the SSL context ``broker.tls`` builds, the server name of
each node, and which failed connection attempts are TLS refusals (a configuration error) or an
outage.

Handshakes run in memory (:class:`ssl.MemoryBIO`) between the context under test and a server
context made from a throwaway CA (tests/harness/tls.py), so the errors classified are OpenSSL's
own; the pika wrappers around them have the shapes pika 1.3 gives them (seen against a real
RabbitMQ with TLS: tests/integration/test_tls.py).
"""

from __future__ import annotations

import ssl
from pathlib import Path

import pika.exceptions
import pytest
from cryptography.hazmat.primitives import serialization
from pika.adapters.utils import connection_workflow as workflow

from flowforge.broker.tls import connect_error, context, refusal
from flowforge.broker.topology import connection_parameters
from flowforge.cli import exitcodes
from flowforge.config import BrokerConfig, BrokerTlsConfig
from flowforge.errormap import exit_code_for
from flowforge.errors import BrokerConfigError, BrokerUnavailableError, ConfigError
from tests.harness.tls import MISMATCHED_HOST, Certificates, make_certificates

HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("pki"))


def good(certs: Certificates) -> BrokerTlsConfig:
    return BrokerTlsConfig(str(certs.ca), str(certs.client_cert), str(certs.client_key))


def server_context(certs: Certificates) -> ssl.SSLContext:
    """A broker's side: its certificate, and client certificates required from the CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs.server_cert, certs.server_key)
    ctx.load_verify_locations(certs.ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def handshake(client: ssl.SSLContext, server: ssl.SSLContext, name: str = HOST) -> ssl.SSLObject:
    """Run a TLS handshake in memory; return the server's end (raises either side's error)."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    near = client.wrap_bio(c_in, c_out, server_hostname=name)
    far = server.wrap_bio(s_in, s_out, server_side=True)
    done = {id(near): False, id(far): False}
    for _ in range(20):
        for end in (near, far):
            if not done[id(end)]:
                try:
                    end.do_handshake()
                    done[id(end)] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return far
    raise AssertionError("the handshake did not finish")


# --- the context ----------------------------------------------------------------------------


def test_the_context_verifies_the_broker_and_presents_the_client_certificate(
    certs: Certificates,
) -> None:
    ctx = context(good(certs))
    assert ctx.verify_mode is ssl.CERT_REQUIRED and ctx.check_hostname
    assert len(ctx.get_ca_certs()) == 1  # only broker.tls.ca_file, not the system's CAs
    far = handshake(ctx, server_context(certs))
    subject = dict(pair[0] for pair in far.getpeercert()["subject"])
    assert subject["commonName"] == "postgres"  # the client certificate reached the server


def test_a_broker_signed_by_another_ca_is_refused(certs: Certificates) -> None:
    wrong = BrokerTlsConfig(str(certs.wrong_ca), str(certs.client_cert), str(certs.client_key))
    with pytest.raises(ssl.SSLCertVerificationError) as failed:
        handshake(context(wrong), server_context(certs))
    why = refusal(failed.value)
    assert why is not None and "certificate was refused" in why and "broker.tls.ca_file" in why


def test_a_host_the_certificate_does_not_name_is_refused(certs: Certificates) -> None:
    with pytest.raises(ssl.SSLCertVerificationError) as failed:
        handshake(context(good(certs)), server_context(certs), name=MISMATCHED_HOST)
    why = refusal(failed.value)
    assert why is not None and "Hostname mismatch" in why and MISMATCHED_HOST in why
    assert "must be a name or address in that node's certificate" in why


def test_without_broker_tls_the_systems_cas_are_trusted_and_names_checked() -> None:
    ctx = context(None)
    assert ctx.verify_mode is ssl.CERT_REQUIRED and ctx.check_hostname


@pytest.mark.parametrize(
    ("files", "said"),
    [
        (
            {"ca_file": "missing.pem"},
            "broker.tls.ca_file: cannot use {d}/missing.pem: No such file",
        ),
        ({"ca_file": "not-pem.txt"}, "broker.tls.ca_file: cannot use {d}/not-pem.txt:"),
        (
            {"cert_file": "client.pem", "key_file": "server.key"},
            "broker.tls.cert_file / key_file: cannot use {d}/client.pem, {d}/server.key: "
            "key values mismatch",
        ),
        ({"cert_file": "missing.pem"}, "broker.tls.cert_file: cannot use {d}/missing.pem:"),
    ],
)
def test_a_file_that_cannot_be_used_is_a_configuration_error(
    certs: Certificates, files: dict[str, str], said: str
) -> None:
    d = certs.directory
    (d / "not-pem.txt").write_text("not a certificate\n")
    tls = BrokerTlsConfig(**{k: str(d / v) for k, v in files.items()})
    with pytest.raises(BrokerConfigError) as refused:
        context(tls)
    assert str(refused.value).startswith(said.format(d=d)), str(refused.value)
    assert isinstance(refused.value, ConfigError)
    assert exit_code_for(refused.value) == exitcodes.USAGE


def test_an_encrypted_key_is_refused_without_a_prompt(certs: Certificates, tmp_path: Path) -> None:
    key = serialization.load_pem_private_key(certs.client_key.read_bytes(), password=None)
    locked = tmp_path / "locked.key"
    locked.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"sesame"),
        )
    )
    with pytest.raises(BrokerConfigError, match="is encrypted; FlowForge needs an unencrypted"):
        context(BrokerTlsConfig(str(certs.ca), str(certs.client_cert), str(locked)))


# --- the nodes ------------------------------------------------------------------------------


def test_every_amqps_node_names_its_own_host_and_shares_one_context(certs: Certificates) -> None:
    config = BrokerConfig(
        url=(
            "amqps://u:p@mq-1.example:5671/%2F",
            "amqps://u:p@10.0.0.2:5671/%2F",
            "amqps://u:p@mq-3.example/%2F",
        ),
        tls=good(certs),
    )
    params = connection_parameters(config, start=0)
    assert [p.ssl_options.server_hostname for p in params] == [
        "mq-1.example",
        "10.0.0.2",
        "mq-3.example",
    ]
    assert [p.port for p in params] == [5671, 5671, 5671]
    contexts = {id(p.ssl_options.context) for p in params}
    assert len(contexts) == 1
    assert params[0].ssl_options.context.check_hostname


def test_a_plain_node_has_no_tls() -> None:
    (params,) = connection_parameters(BrokerConfig(url=("amqp://u:p@mq.example/%2F",)))
    assert params.ssl_options is None


def test_a_tls_file_that_cannot_be_used_fails_the_parameters(tmp_path: Path) -> None:
    config = BrokerConfig(
        url=("amqps://u:p@mq.example/%2F",), tls=BrokerTlsConfig(str(tmp_path / "none.pem"))
    )
    with pytest.raises(BrokerConfigError, match=r"broker\.tls\.ca_file"):
        connection_parameters(config)


# --- what a failed attempt means ----------------------------------------------------------


def _wrong_ca_error(certs: Certificates) -> ssl.SSLCertVerificationError:
    wrong = BrokerTlsConfig(str(certs.wrong_ca))
    try:
        handshake(context(wrong), server_context(certs))
    except ssl.SSLCertVerificationError as exc:
        return exc
    raise AssertionError("the handshake passed")


def test_pikas_wrappers_of_a_refused_handshake_are_refusals(certs: Certificates) -> None:
    real = _wrong_ca_error(certs)
    # BlockingConnection unwraps it; SelectConnection reports the workflow's failure
    setup = workflow.AMQPConnectorTransportSetupError(real)
    for shape in (real, setup, workflow.AMQPConnectionWorkflowFailed([setup])):
        why = refusal(shape)
        assert why is not None and "certificate was refused" in why, shape


@pytest.mark.parametrize(
    ("lost", "said"),
    [
        # how a TLS 1.3 broker refuses a client without a certificate: the stream ends right
        # after the handshake, or the alert arrives first
        (
            "SSLEOFError(8, 'EOF occurred in violation of protocol (_ssl.c:2427)')",
            "closed the connection right after the handshake: it refused this client",
        ),
        (
            "SSLError(1, '[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] tlsv13 alert certificate "
            "required (_ssl.c:2580)')",
            "tlsv13 alert certificate required (the broker wants a client certificate",
        ),
        (
            "SSLError(1, '[SSL: TLSV1_ALERT_UNKNOWN_CA] tlsv1 alert unknown ca (_ssl.c:2580)')",
            "tlsv1 alert unknown ca (the broker does not trust this client's certificate",
        ),
    ],
)
def test_a_stream_lost_after_the_handshake_is_a_refusal(lost: str, said: str) -> None:
    stream = pika.exceptions.StreamLostError(f"Stream connection lost: {lost}")
    shape = pika.exceptions.IncompatibleProtocolError(repr(stream))
    why = refusal(shape)
    assert why is not None and said in why, why


def test_a_port_that_does_not_speak_tls_is_a_refusal() -> None:
    real = ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)")
    real.reason = "WRONG_VERSION_NUMBER"  # what OpenSSL's error carries
    why = refusal(real)
    assert why is not None and "wrong version number (does that port speak TLS?" in why


@pytest.mark.parametrize(
    "outage",
    [
        pika.exceptions.AMQPConnectionError(
            workflow.AMQPConnectorSocketConnectError(ConnectionRefusedError(111, "refused"))
        ),
        workflow.AMQPConnectorTransportSetupError(
            ssl.SSLEOFError(8, "EOF occurred in violation of protocol (_ssl.c:1006)")
        ),
        pika.exceptions.IncompatibleProtocolError(
            "StreamLostError: ('Stream connection lost: ConnectionResetError(104)',)"
        ),
        pika.exceptions.StreamLostError("Stream connection lost: SSLEOFError(8, 'EOF')"),
        TimeoutError("timed out"),
    ],
)
def test_an_end_of_stream_or_a_refused_port_is_an_outage(outage: BaseException) -> None:
    assert refusal(outage) is None


def test_one_refusing_node_makes_the_whole_connect_a_configuration_error(
    certs: Certificates,
) -> None:
    dead = pika.exceptions.AMQPConnectionError(
        workflow.AMQPConnectorSocketConnectError(ConnectionRefusedError(111, "refused"))
    )
    error = connect_error([("mq-1:5671", dead), ("mq-2:5671", _wrong_ca_error(certs))])
    assert isinstance(error, BrokerConfigError)
    assert str(error).startswith("cannot use the broker at mq-2:5671: TLS: ")
    assert exit_code_for(error) == exitcodes.USAGE


def test_nodes_that_are_all_down_are_an_outage() -> None:
    dead = pika.exceptions.AMQPConnectionError(
        workflow.AMQPConnectorSocketConnectError(ConnectionRefusedError(111, "refused"))
    )
    timed_out = BrokerUnavailableError("connection timed out after 10 s")
    error = connect_error([("mq-1:5671", dead), ("mq-2:5671", timed_out)])
    assert isinstance(error, BrokerUnavailableError)
    assert "mq-1:5671: AMQPConnectionError" in str(error)
    assert "mq-2:5671: connection timed out after 10 s" in str(error)
    assert exit_code_for(error) == exitcodes.UNAVAILABLE
