"""``make chaos``: echo agents under load while services die and the servers go away.

``python -m tests.chaos`` is the full run against the servers ``make services`` started;
``tests/e2e/test_chaos.py`` is the bounded one inside ``make test``, on stand-ins it owns alone.
"""
