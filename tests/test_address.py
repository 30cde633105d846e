"""checkmate.address: the one HOST:PORT parser, and checkmate.sockets' bind errors that name the address."""

from __future__ import annotations

import errno
import os
import socket

import pytest

from checkmate.address import AddressError, format_host_port, parse_host_port
from checkmate.sockets import BindError, bind, create_server


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:5000", ("127.0.0.1", 5000)),
        ("localhost:1", ("localhost", 1)),
        ("sh1:65535", ("sh1", 65535)),
        ("[::1]:5000", ("::1", 5000)),
        ("[fe80::1%eth0]:80", ("fe80::1%eth0", 80)),
        (" 10.0.0.1:48880 ", ("10.0.0.1", 48880)),
    ],
)
def test_host_and_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("10.0.0.1", ("10.0.0.1", 7)), ("[::1]", ("::1", 7)), ("::1", ("::1", 7)), ("h:9", ("h", 9))],
)
def test_default_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(text, 7) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty address"),
        ("localhost", "missing port"),
        ("localhost:", "missing port"),
        ("[::1]", "missing port"),
        (":5000", "empty host"),
        ("[]:5000", "not an IPv6 address"),
        ("h:70000", "outside 1..65535"),
        ("h:0", "outside 1..65535"),
        ("h:-1", "is not a number"),
        ("h:http", "is not a number"),
        ("::1:5000", "missing port"),  # a bare IPv6 address: no port can follow it
        ("h:1:2", "[ADDR]:PORT"),
        ("[::1:5000", "without ']'"),
        ("[::1]5000", "expected ':PORT'"),
        ("[nothost]:5000", "not an IPv6 address"),
        ("my host:5000", "white space"),
    ],
)
def test_refused(text: str, message: str) -> None:
    with pytest.raises(AddressError) as caught:
        parse_host_port(text)
    assert message in str(caught.value)
    if text.strip():
        assert repr(text) in str(caught.value), "the message quotes the text"


def test_defaults_for_listeners() -> None:
    assert parse_host_port(":0", 5, default_host="0.0.0.0", allow_zero=True) == ("0.0.0.0", 0)
    with pytest.raises(AddressError, match="outside 0..65535"):
        parse_host_port("h:65536", allow_zero=True)


@pytest.mark.parametrize(("host", "port"), [("127.0.0.1", 5000), ("::1", 5000), ("sh1", 1)])
def test_format_reads_back(host: str, port: int) -> None:
    assert parse_host_port(format_host_port(host, port)) == (host, port)
    assert format_host_port("::1", 5) == "[::1]:5"


def test_bind_error_names_role_and_address() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as second:
            with pytest.raises(BindError) as caught:
                bind(second, ("127.0.0.1", port), "shadow sh1's data socket")
    assert caught.value.errno == errno.EADDRINUSE
    assert isinstance(caught.value, OSError)
    assert f"shadow sh1's data socket cannot bind UDP 127.0.0.1:{port}" in str(caught.value)


def test_create_server_error_names_role_and_address() -> None:
    with create_server(("127.0.0.1", 0), "first") as taken:
        port = taken.getsockname()[1]
        with pytest.raises(BindError) as caught:
            create_server(("127.0.0.1", port), "shadow sh2's control socket")
    assert caught.value.errno == errno.EADDRINUSE
    assert f"shadow sh2's control socket cannot bind TCP 127.0.0.1:{port}" in str(caught.value)


def test_checkmate_shadow_names_the_address_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    from shadow.cli import main as shadow_main

    umask = os.umask(0o022)  # checkmate-shadow run sets the process's umask to 0077: put it back after
    try:
        with create_server(("127.0.0.1", 0), "another process") as taken:
            port = taken.getsockname()[1]
            argv = ["run", "--name", "sh1", "--control", f"127.0.0.1:{port}", "--data", "127.0.0.1:0"]
            code = shadow_main(argv)
    finally:
        os.umask(umask)
    err = capsys.readouterr().err
    assert code == 1
    assert f"shadow sh1's control socket cannot bind TCP 127.0.0.1:{port}" in err, err
    assert "Address already in use" in err


@pytest.mark.parametrize("flag", ["--control", "--data"])
@pytest.mark.parametrize(("value", "message"), [("h:99999", "outside 0..65535"), ("[::1", "without ']'")])
def test_checkmate_shadow_refuses_a_bad_address(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from shadow.cli import main as shadow_main

    with pytest.raises(SystemExit) as caught:
        shadow_main(["run", "--name", "sh1", flag, value])
    assert caught.value.code == 2
    assert message in capsys.readouterr().err
