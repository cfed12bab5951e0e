"""``backend: ray``: the rollouter (with its engine), the MessageQueue and the trainer as Ray actors.

The seam is the component interfaces, not ``if ray:`` branches inside them: the trainer actor runs the very
same ``tether.pipeline.trainer.train`` loop, handed a rollouter, an engine handle and a queue that live in other
actors (``remote.py``) instead of its own process. Files:

    ray_backend.py      the driver: connect to / start a cluster, place the actors, run, stop, report failures
    placement.py        resource_pool.* as Ray placement groups; a pool too large fails at start, naming the key
    actors.py           the actors: RolloutWorker (engine + environments + Rollouters), QueueWorker, TrainerWorker
    remote.py           the trainer's side: RemoteRollouter (re-queues a dead actor's groups), RemoteEngine, RemoteQueue
    weight_transfer.py  versioned weights in buckets through the object store
    envvars.py          the environment variables every actor is given explicitly
"""
