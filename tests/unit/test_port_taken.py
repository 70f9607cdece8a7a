"""``services.port_taken``, the launch preflight's port probe: a listener counts, a closed connection
still in TIME_WAIT on the port does not (the servers we start bind with SO_REUSEADDR and would start)."""

import socket

import pytest

from specforge_kimi.run.services import free_ports, port_taken


def _time_wait(port: int) -> None:
    """Leave a connection in TIME_WAIT whose local port is ``port``, and nothing listening there."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen()
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()  # the accepting side closes first: its end (local port = port) goes to TIME_WAIT
    cli.recv(1)
    cli.close()
    srv.close()


def test_a_listener_is_taken_and_a_time_wait_is_not():
    port = free_ports(1)[0]
    with socket.socket() as lis:
        lis.bind(("127.0.0.1", port))
        lis.listen()
        assert port_taken(port)
    _time_wait(port)
    with socket.socket() as plain:  # what the probe did before: a plain bind is refused here
        try:
            plain.bind(("127.0.0.1", port))
            pytest.skip("this kernel let a plain bind through a TIME_WAIT socket; nothing to tell apart")
        except OSError:
            pass
    assert not port_taken(port)
