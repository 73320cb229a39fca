"""Deciding what to run, before anything runs: a request -> backend, build, cards, mode, plan (prepare) -> the
complete argv and environment of every process (specs), with the rpc-servers' weight cache made ready (weightcache).
Pure of supervision: run/ receives what this package decides and runs it.
"""
