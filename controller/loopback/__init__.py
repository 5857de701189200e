"""Agents on 127.0.0.1, without a network: real agent processes (``python -m agents...``)
talking real TCP, started the way the controller starts them but without Mininet or root.

What the loopback tests and the benchmarks that need no network (``benchmarks/robustness.py``,
``benchmarks/pipeline.py``) share: :mod:`controller.loopback.dp` (a PS and its workers, the
handshake by hand), :mod:`controller.loopback.pipeline` (pipeline stages, their PS and
one-process references), :mod:`controller.loopback.hostile` (peers that misbehave on
purpose), the flooder, a process of its own that a test may also start inside an emulated
host (:mod:`controller.loopback.flood`: slow connections that hold a listener's slots,
thousands of them from several processes, and connections that each cost a refusal) and
:mod:`controller.warm` (agent processes forked
from one warm interpreter, so each starts in milliseconds).
"""
