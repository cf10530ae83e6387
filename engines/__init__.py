"""Engines over HTTP: the token-in/token-out client, the /metrics parser, weight publishing.

Invariant: the project talks to engines over HTTP only; every reply is classified into the error model
(``errors.EngineError`` and its subclasses) where it is received.
"""
