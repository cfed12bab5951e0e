"""Supervised warm starts: demonstrations → SFT → an HF checkpoint that RL can learn from.

Above ``agent/`` (it replays demonstrations through the agent loop) and below ``runtime.py`` (which builds
the ``tiny-sft`` preset into the cache on first use).

    demos.py            demonstrations: an environment's scripted expert replayed through the agent loop,
                        or a JSONL file of OpenAI-style conversations (format in its docstring)
    tiny_sft.py         the ``tiny-sft`` preset: tiny model → copy task → SFT on imperfect expert demos
    entities.py         one digit-coded token per database entity, the copy task, id swapping
    imperfect_expert.py the customer-service expert with systematic mistakes (room left for RL)

``tether sft CONFIG… --demos FILE.jsonl | --expert`` runs ``tether.learner.sft.sft`` on either source.
"""
