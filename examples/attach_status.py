"""Attach to an instance started elsewhere (`arcsplit serve ...` or another script) and print its state.

    python examples/attach_status.py [RUN]
"""

import sys

import arcsplit

with arcsplit.attach(sys.argv[1] if len(sys.argv) > 1 else None) as client:
    status = client.status()
    print(client.info.run_id, status["state"], status["mode"], status["url"])
    for name, proc in status["processes"].items():
        print(f"  {name:<7} {proc['state']:<9} pid {proc['pid']}  restarts {proc['restarts']}")
    for event in client.events(timeout=1.0):  # a snapshot first, then whatever happens within a second
        print("event:", event["kind"], event["name"])
