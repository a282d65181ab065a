"""Generation and serving on the model: the plan types (plan.py), sampling, the request builder, the scheduler that
plans, the runner that executes, the loop that drives both, the prefix cache, scoring, speculative decoding's policy
(speculation.py) and its drafters. It imports core/ and never train/.

Reading order: greedy.py (a whole greedy generate with a KV cache), then scheduler.py, runner.py and loop.py."""
