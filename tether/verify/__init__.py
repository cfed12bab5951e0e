"""``tether verify``: checks that say whether a run is actually learning, and why not (issue 14).

- ``env``: the environment answers scripted probes and the policy as it should.
- ``optim`` (``optim.py``): the learning signal, gradient norm and KL of a run, step by step.
- ``async`` (``async_checks.py``): a short run of the real async pipeline keeps its staleness bound, its queue
  accounting and its parameter-sync interval, with both sides busy.
- ``consistency`` (``consistency.py``, ``consistency_paths.py``): the same tasks through the training path and
  ``tether serve`` over the OpenAI protocol; the action match rate, and the cause of the first divergence.

Each check reads a run's ``metrics.jsonl`` (one row per step) and returns a ``Report``: per criterion, the steps
it was checked on, those that failed, and the diagnosis with the config keys that remedy it.
"""
