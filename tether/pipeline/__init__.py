"""The data flow: Rollouter → (queue, scheduler, buffer: the async issue) → Trainer, plus evaluation."""
