"""Training on the model's math: the hand-written backward (backward.py), the step over preallocated buffers
(step.py), AdamW (optim.py) and the trainer's loop, checkpoints and exact resume (trainer.py). It imports core/ and
never runtime/: the trainer draws its samples through a Sampler its caller passes in."""
