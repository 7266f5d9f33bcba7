"""Issue 28: etcd behind TLS and passwords, as production clusters run it. One real etcd on
loopback (tests/support/etcd_server.py: https with certificates made here by openssl, client certificates
required, etcd's authentication enabled with a read-write user, a user without permission and
root). The store, ``etcd://`` with the settings in its query, ``fastdist doctor --store``, and each
part that can fail named: a CA that did not sign the server's certificate, no client certificate,
a wrong password, a user without permission. The password never appears in a message or a log."""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import etcd_server
import fastdist
import pytest
from etcd_server import PASSWORDS
from fastdist.store.etcd import EtcdAccessError, EtcdSecurity, parse_url, redact, security_of, tls_failure
from fastdist.tools.doctor import run_etcd_checks

pytestmark = [
    pytest.mark.timeout(120),
    etcd_server.NEEDS_ETCD,
]


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Any:
    server = etcd_server.start_secure(tmp_path_factory.mktemp("etcd-tls"))
    try:
        yield server
    finally:
        server.stop()


def _security(secure: Any, **changes: Any) -> EtcdSecurity:
    given: dict[str, Any] = {
        "ca": str(secure.ca),
        "cert": str(secure.cert),
        "key": str(secure.key),
        "user": "trainer",
        "password": PASSWORDS["trainer"],
    }
    given.update(changes)
    return EtcdSecurity(**given)


def _url(secure: Any, job: str, **query: str) -> str:
    given = {"ca": str(secure.ca), "cert": str(secure.cert), "key": str(secure.key), "user": "trainer"}
    given.update(query)
    return f"etcd://127.0.0.1:{secure.member.client_port}/{job}?" + "&".join(
        f"{k}={v}" for k, v in given.items()
    )


def test_the_store_works_over_tls_with_a_password(secure: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    job = f"tls-{uuid.uuid4().hex[:8]}"
    store = fastdist.EtcdStore([secure.endpoint], job, timeout=10, ttl=5, security=_security(secure))
    try:
        store.set("a", b"1")
        assert store.get("a") == b"1"
        assert store.add("n", 2) == 2 and store.add("n", 3) == 5
        twin = store.clone()  # another connection pool, the same credentials
        twin.set("b", b"2")
        store.wait(["b"], __import__("datetime").timedelta(seconds=5))
        assert store.compare_set("a", b"1", b"3") == b"3"
        assert PASSWORDS["trainer"] not in repr(store) and PASSWORDS["trainer"] not in repr(_security(secure))
    finally:
        store.close()
    assert PASSWORDS["trainer"] not in caplog.text


def test_each_refusal_names_the_part_that_failed(secure: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    job = f"tls-{uuid.uuid4().hex[:8]}"
    cases = [
        (_security(secure, ca=str(secure.other_ca)), "certificate", "not trusted by the CA file"),
        (_security(secure, cert=None, key=None), "certificate", "asks for a client certificate"),
        (_security(secure, password="wrong-pw-9"), "password", "wrong user or password"),
        (_security(secure, user="guest", password=PASSWORDS["guest"]), "permission", "permission denied"),
        (_security(secure, user=None, password=None), "password", "authentication is enabled there"),
    ]
    for security, part, words in cases:
        with pytest.raises(EtcdAccessError) as info:
            fastdist.EtcdStore([secure.endpoint], job, timeout=5, ttl=5, security=security)
        assert info.value.part == part, (part, str(info.value))
        assert words in str(info.value), str(info.value)
        assert "wrong-pw-9" not in str(info.value) and PASSWORDS["guest"] not in str(info.value)
    assert "wrong-pw-9" not in caplog.text and PASSWORDS["guest"] not in caplog.text


def test_each_mismatch_between_client_and_server_is_named_for_what_it_is(secure: Any, tmp_path: Path) -> None:
    """Issue 40: a name the certificate does not list was called an untrusted CA; TLS against a
    plain server "asked for a client certificate"; plain http against TLS was an untyped "can't be
    reached". Each is an EtcdAccessError ("certificate") that says what happened."""
    plain = etcd_server.start(tmp_path)
    try:
        job = f"tls-{uuid.uuid4().hex[:8]}"
        port = secure.member.client_port
        cases = [
            # The certificate lists IP:127.0.0.1 only; localhost is another name for the same server.
            ([f"https://localhost:{port}"], _security(secure), "is trusted but not issued for 'localhost'"),
            (
                [f"https://{plain.members[0].endpoint}"],
                EtcdSecurity(ca=str(secure.ca)),
                "does not speak TLS (it answers plain http",
            ),
            ([f"http://127.0.0.1:{port}"], EtcdSecurity(), "the server speaks TLS (https)"),
        ]
        for endpoints, security, words in cases:
            with pytest.raises(EtcdAccessError) as info:
                fastdist.EtcdStore(endpoints, job, timeout=5, ttl=5, security=security)
            assert info.value.part == "certificate", str(info.value)
            assert words in str(info.value), str(info.value)
            assert "not trusted" not in str(info.value) and "client certificate" not in str(info.value)
        # The same words from the client (whether etcd's alert or only the end of the stream
        # reached it first) say different things about the two servers: asking them tells.
        eof = "SSLEOFError(8, '[SSL: UNEXPECTED_EOF_WHILE_READING] EOF occurred in violation of protocol')"
        no_cert = EtcdSecurity(ca=str(secure.ca))
        assert "asks for a client certificate" in str(tls_failure(eof, no_cert, ("127.0.0.1", port)))
        assert "does not speak TLS" in str(
            tls_failure(eof, no_cert, ("127.0.0.1", plain.members[0].client_port))
        )
        # The doctor says the same, where it said "accepts connections but is no working etcd".
        checks = run_etcd_checks(f"etcd://127.0.0.1:{port}/{job}", 5.0)
        bad = {c.name: c for c in checks}
        assert bad["certificate"].ok is False and "the server speaks TLS" in bad["certificate"].detail, checks
    finally:
        plain.stop()


def test_doctor_checks_the_secure_store_and_says_which_part_failed(
    secure: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = f"tls-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("FASTDIST_ETCD_PASSWORD", PASSWORDS["trainer"])
    checks = {c.name: c for c in run_etcd_checks(_url(secure, job), 5.0)}
    assert checks["store"].ok, checks
    bad = {c.name: c for c in run_etcd_checks(_url(secure, job, ca=str(secure.other_ca)), 5.0)}
    assert bad["certificate"].ok is False and "not trusted" in bad["certificate"].detail, bad
    monkeypatch.setenv("FASTDIST_ETCD_PASSWORD", "wrong-pw-9")
    bad = {c.name: c for c in run_etcd_checks(_url(secure, job), 5.0)}
    assert bad["password"].ok is False and "wrong user or password" in bad["password"].detail, bad
    monkeypatch.setenv("FASTDIST_ETCD_PASSWORD", PASSWORDS["guest"])
    bad = {c.name: c for c in run_etcd_checks(_url(secure, job, user="guest"), 5.0)}
    assert bad["permission"].ok is False and f"/fastdist/{job}/" in bad["permission"].detail, bad
    assert "READWRITE" in bad["permission"].fix


def test_a_job_rendezvous_through_etcd_url_with_tls_and_a_password(secure: Any, tmp_path: Path) -> None:
    """One process, as a user runs it: etcd:// with the files in the query, the password from the
    environment; a collective on the group, then the doctor's command line on the same URL."""
    url = _url(secure, f"tls-{uuid.uuid4().hex[:8]}")
    code = (
        "import sys, torch, fastdist\n"
        "fastdist.init_process_group('gloo', sys.argv[1], rank=0, world_size=1)\n"
        "t = torch.ones(2)\n"
        "fastdist.all_reduce(t, timeout=10)\n"
        "print('ok', t.tolist(), flush=True)\n"
    )
    env = {**__import__("os").environ, "FASTDIST_ETCD_PASSWORD": PASSWORDS["trainer"]}
    out = subprocess.run(
        [sys.executable, "-c", code, url], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0 and "ok [1.0, 1.0]" in out.stdout, out.stderr[-3000:]
    assert PASSWORDS["trainer"] not in out.stdout + out.stderr
    env["FASTDIST_ETCD_PASSWORD"] = "wrong-pw-9"
    out = subprocess.run(
        [sys.executable, "-c", code, url], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode != 0 and "EtcdAccessError" in out.stderr and "wrong user or password" in out.stderr
    assert "wrong-pw-9" not in out.stderr + out.stdout


def test_settings_are_checked_at_the_edge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="ca= names no readable file"):
        EtcdSecurity(ca=str(tmp_path / "missing.crt"))
    (tmp_path / "c.crt").write_text("x")
    with pytest.raises(ValueError, match="cert= and key= go together"):
        EtcdSecurity(cert=str(tmp_path / "c.crt"))
    with pytest.raises(ValueError, match="the password"):
        EtcdSecurity(user="trainer")
    assert EtcdSecurity(ca=str(tmp_path / "c.crt")).tls  # a CA file means https
    with pytest.raises(ValueError, match="takes \\?ttl=") as info:
        parse_url("etcd://h:2379/job?password=hunter2&colour=red")
    assert "hunter2" not in str(info.value)
    assert redact("etcd://h/job?user=u&password=hunter2") == "etcd://h/job?user=u&password=***"
    monkeypatch.setenv("FASTDIST_ETCD_USER", "envuser")
    monkeypatch.setenv("FASTDIST_ETCD_PASSWORD", "envpw")
    sec = security_of("etcd://h:2379/job?user=urluser&tls=1")
    assert sec.user == "urluser" and sec.password == "envpw" and sec.tls  # the URL wins, else the env
    assert security_of(None, ["https://h:2379"]).tls
    with pytest.raises(ValueError, match="tls= is 1 or 0"):
        security_of("etcd://h:2379/job?tls=maybe")
    with pytest.raises(TypeError, match="security"):
        fastdist.EtcdStore(["127.0.0.1:1"], "job", security={"user": "x"})  # type: ignore[arg-type]
