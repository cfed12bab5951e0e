"""The teacher loop — on-policy distillation: a teacher scores the student's own rollouts token by token.

    rollout finishes → ``score_trajectory`` (the teacher's log-prob of every response token, and its top-k)
    → the group reaches the trainer → ``Distillation`` adds coef · distill to the loss (or replaces the RL term)

Files: ``scorer.py`` (the local and remote teachers, scoring as trajectories finish), ``tokenizer.py`` (the
shared-tokenizer check at start). The learner's side (batch tensors, loss term, metrics) is
``tether.learner.distill``, so that the learner never imports this package; the losses are pure functions in
``tether.algo.distill``; the config is ``tether.config.teacher``.
"""
