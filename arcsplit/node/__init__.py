"""The node agent: ``arcsplit node --stdio`` runs a host's rpc-servers for a supervisor on another machine.

The supervisor starts it over SSH (hosts.node_argv) and speaks JSON lines on its stdin/stdout, one object per
line; stderr is for humans. Client -> node ops: hello, ports, start, stop, ping. Node -> client events: hello,
ports, started, line, ready, exit, error, pong, stats. docs/multihost.md describes each
message; proc/wire.py owns them.

The agent is the trust boundary on that host: it runs only its own build's rpc-server with the rpc-server's own
flags, bound to loopback unless started with ``--allow-bind ADDR``, and kills everything it started when its
stdin closes or the pings stop.
"""
