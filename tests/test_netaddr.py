"""Where a client on this machine reaches a server by its bind address: the one rule llama-server's URL (ServeConfig.url,
the health check) uses. A wildcard bind answers on loopback, and an IPv6 address is bracketed, or the URL is not one."""

from __future__ import annotations

import socket

import httpx

from arcsplit.netaddr import LOOPBACK, free_port, local_url


def test_a_wildcard_bind_is_reached_on_loopback():
    assert local_url("0.0.0.0", 8080) == local_url("", 8080) == f"http://{LOOPBACK}:8080"
    assert local_url("192.168.1.5", 80) == "http://192.168.1.5:80"


def test_an_ipv6_bind_gives_a_url_httpx_can_parse():
    for host, want in (("::", "::1"), ("::1", "::1"), ("fe80::1", "fe80::1")):
        assert httpx.URL(local_url(host, 8080)).host == want


def test_free_port_is_bindable_on_loopback():
    with socket.socket() as s:
        s.bind((LOOPBACK, free_port()))
