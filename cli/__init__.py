"""The ``rollouts`` command and its sub-commands (``cli.rollouts``: run, status, export, worker, ...;
``runs``; ``feed``, ``stack``, operating a run: ``stuck``, ``top``, ``cancel``, ``retry``, ``terminate``;
``reproduce``; ``train``; ``chaos``), and what they show (``progress``).

Invariant: the command line is a view; the work happens in the packages it calls (workflows through
Temporal, the store, the embedded stack, the worker). Heavy imports happen inside commands, so
``rollouts --help`` answers at once. No other package imports this one.
"""
