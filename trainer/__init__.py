"""An example GRPO trainer that closes the loop: trainer feed -> torch optimisation -> publish -> engines.

Modules: ``loss`` (the clipped, importance-weighted token loss; pure torch), ``batch`` (feed records to
tensors, from the recorded token ids only), ``policy_io`` (load and save HF weights), ``evaluate`` (math
accuracy through the engine), ``settings`` (the ``[trainer]`` section of a loop config), ``loop`` (the
closed loop and its metrics). Its command, ``rollouts train``, is ``cli.train``.
"""
