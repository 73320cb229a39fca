"""What ``arcsplit tune`` and ``arcsplit.tune()`` run: measure every route on this machine's cards and keep the
fastest correct one (docs/tune.md). candidates (what is tried), verify (correct output), measure (speed),
fingerprint (what a kept result is valid for), runner (the run), picks (what was kept, read back for serve and
plan), result (the API's typed view), api (``arcsplit.tune()``)."""
