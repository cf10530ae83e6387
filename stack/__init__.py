"""The embedded stack (``stack.stack``: a Temporal dev server, one vLLM engine and one worker, run from one
state directory) and the processes of ours it is made of (``stack.procs``: start them detached, find them
by their pid files, stop them, probe their health; how a process of ours leaves, ``run_main``), with
Ctrl-C for them (``stack.interrupt``).

Invariant: it signals only processes it started, never by name. Importing it is cheap: no temporalio,
torch or vLLM at import time (the ``rollouts`` command imports ``stack.interrupt`` before anything else).
"""
